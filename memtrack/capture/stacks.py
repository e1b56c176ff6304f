"""Stack capture: the CapturePart that adds bpf/stacks.h and drains its record ring.

The allocator probes (capture core) call `mt_stack_capture` at an outer allocator
entry; it returns the hash of the stack's skeleton, carried by the event, and emits a
stack record the first time a skeleton is seen. This part sizes the program (-D flags),
keeps the kernel's map of kept regions (every executable mapping and the main stack of
each tracked process, marked at each attach stop through `on_stop`) and each main
thread's stack end, and turns the ring's variable-size records into STACKS batches
(and, with `stack_copies`, STACK_COPIES batches holding every capture's raw copy).
"""

from __future__ import annotations

import ctypes as ct
import mmap
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.capture.options import CaptureOptions
from memtrack.capture.parts import RING_STACKS, Ring
from memtrack.capture.procfs import MapLine
from memtrack.capture.ringbuf import Records
from memtrack.capture.stackring import records_to_batches
from memtrack.capture.tables import percpu_counts
from memtrack.schema.artifact import ArtifactWriter
from memtrack.schema.stackrecord import (
    GROUP_WORDS,
    MAX_BUDGET,
    MIN_BUDGET,
    REGION_BYTES,
    REGION_SHIFT,
)

RING = "mt_stack_ring"
REGIONS = "mt_stack_regions"
ENDS = "mt_stack_ends"
# mt_stack_stats indexes of bpf/stacks.h -> counter names.
KERNEL_STATS = (
    "stack_copy_failed",
    "stack_copies_cut",
    "stack_dedupe_full",
    "stacks_ring_full",
    "stack_records",
    "stack_deduped",
    "stack_captures",
    "stack_ends_learned",
    "stack_pages_absent",
)
KERNEL_LOSSES = ("stack_copy_failed", "stack_copies_cut", "stack_dedupe_full",
                 "stacks_ring_full")
FP_DEPTH = 127  # bpf/stacks.h MT_FP_DEPTH
MAX_NEST = 4
NUM_REGS = 17
HDR_WORDS = 7
MAIN_STACK_MAX = 8 << 20  # the main stack's regions marked below its top (its rlimit)
# bpf/stacks.h's tracepoint programs (named: lifecycle.c owns the TRACEPOINT_PROBE names)
TRACEPOINTS = (
    ("syscalls:sys_enter_clone3", "mt_stack_clone3_enter"),
    ("syscalls:sys_exit_clone3", "mt_stack_clone_exit"),
    ("syscalls:sys_enter_clone", "mt_stack_clone_enter"),
    ("syscalls:sys_exit_clone", "mt_stack_clone_exit"),
    ("sched:sched_process_exit", "mt_stack_thread_exit"),
    ("syscalls:sys_enter_mprotect", "mt_stack_mprotect_enter"),
    ("syscalls:sys_enter_mmap", "mt_stack_mmap_enter"),
    ("syscalls:sys_exit_mmap", "mt_stack_mmap_exit"),
)


def check_budget(budget: int) -> int:
    """The stack budget in bytes, or ValueError with a one-line reason."""
    if not MIN_BUDGET <= budget <= MAX_BUDGET or budget % MIN_BUDGET:
        raise ValueError(f"stack budget must be a multiple of {MIN_BUDGET} between "
                         f"{MIN_BUDGET} and {MAX_BUDGET} bytes, got {budget}")
    return budget


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def possible_cpus() -> int:
    """Number of CPU ids the kernel may use (scratch slots are indexed by CPU id)."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            spec = f.read().strip()
        return max(int(r.split("-")[-1]) for r in spec.split(",")) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def record_words(budget: int, copies: bool) -> int:
    """The largest ring record of a budget, in words: header, frame-pointer chain,
    fixups, registers, kept bitmap, every word kept (and the raw copy)."""
    words = budget // 8
    body = NUM_REGS + -(-words // GROUP_WORDS) + words + (words if copies else 0)
    return HDR_WORDS + FP_DEPTH + 2 * MAX_NEST + body


def start_stack(pid: int) -> int | None:
    """The main thread's initial sp (argc's slot: nothing above it is a frame), from
    /proc/PID/stat's startstack; None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: the fields follow the last ')'
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[25]) or None  # field 28 of the whole line
    except (IndexError, ValueError):
        return None


class StacksPart:
    """CapturePart for allocation stacks (stacks.h)."""

    name = "stacks"

    def __init__(self, options: CaptureOptions, *, seen_entries: int = 131072,
                 thread_entries: int = 65536) -> None:
        self.budget = options.stack_budget
        self.copies = options.stack_copies
        self.ring_pages = options.stacks_ring_pages
        self.seen_entries = seen_entries
        self.thread_entries = thread_entries
        self.malformed = 0
        self.records = 0
        self._reader: Any = None
        self._regions_map: mmap.mmap | None = None
        self.regions: np.ndarray | None = None  # the kernel's kept-region bytes

    def sources(self) -> list[str]:
        return ["stacks.h"]

    def cflags(self) -> list[str]:
        words = _pow2(self.budget // 8)
        flags = [
            "-DMT_STACKS",
            f"-DMT_STACK_BUDGET={self.budget}",
            f"-DMT_STACK_WORDS={words}",
            f"-DMT_STACK_OUT_WORDS={_pow2(record_words(words * 8, self.copies))}",
            f"-DMT_STACK_RING_PAGES={self.ring_pages}",
            f"-DMT_STACK_SEEN={self.seen_entries}",
            f"-DMT_STACK_THREADS={self.thread_entries}",
            f"-DMT_NCPU={possible_cpus()}",
        ]
        if self.copies:
            flags.append("-DMT_STACK_COPIES")
        return flags

    def attach(self, bpf: Any) -> list[str]:
        self._regions_map = mmap.mmap(bpf[REGIONS].map_fd, REGION_BYTES, mmap.MAP_SHARED,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
        self.regions = np.frombuffer(self._regions_map, dtype=np.uint8)
        warnings = []
        for tp, fn in TRACEPOINTS:
            try:
                bpf.attach_tracepoint(tp=tp, fn_name=fn)
            except Exception as e:  # noqa: BLE001 - bcc raises bare Exception
                warnings.append(f"stacks: cannot attach {fn} to {tp} ({e}); thread stack "
                                "ends are learned from faults and JIT code may be missed")
        return warnings

    def on_stop(self, bpf: Any, pid: int, maps: Iterable[MapLine]) -> None:
        """At an attach stop (the process is stopped, `maps` its mappings now): keep the
        regions of its executable mappings and main stack, and set its main thread's
        stack end, before it runs on."""
        assert self.regions is not None, "StacksPart.attach was not called"
        for m in maps:
            if "x" in m.perms:
                self.mark(m.start, m.end)
            elif m.path == "[stack]":
                self.mark(max(m.end - MAIN_STACK_MAX, 0), m.end)
        top = start_stack(pid)
        if top is not None:
            bpf[ENDS][ct.c_uint32(pid)] = ct.c_uint64(top + 8)

    def mark(self, start: int, end: int) -> None:
        """Keep the words pointing into [start, end) from now on (user addresses only)."""
        assert self.regions is not None
        end = min(end, 1 << 47)
        if start >= end:
            return
        first, last = start >> REGION_SHIFT, (end - 1) >> REGION_SHIFT
        idx = np.arange(first, last + 1, dtype=np.uint64) & np.uint64(REGION_BYTES - 1)
        self.regions[idx] = 1

    def rings(self) -> list[Ring]:
        # a record is at most record_words long
        return [Ring(RING, RING_STACKS, None, record_words(self.budget, self.copies) * 8)]

    def write(self, bpf: Any, writer: ArtifactWriter, ring: Ring, records: Any) -> int:
        if not records:
            return 0
        stacks, copies = self.ingest(records)
        writer.write("stacks", stacks)
        if copies is not None:
            writer.write("stack_copies", copies)
        return stacks.num_rows

    def drain(self, bpf: Any, writer: ArtifactWriter) -> int:
        if self._reader is None:
            from memtrack.capture.ringbuf import RingReader

            self._reader = RingReader(bpf, RING)
        return self.write(bpf, writer, self.rings()[0], self._reader.read_records())

    def ingest(self, records: Records) -> tuple[pa.RecordBatch, pa.RecordBatch | None]:
        """Parse ring records into a STACKS batch (and a STACK_COPIES batch with
        `stack_copies`); a record that does not parse is dropped and counted."""
        out = records_to_batches(records, copies=self.copies)
        self.malformed += out.malformed
        self.records += out.stacks.num_rows
        return out.stacks, out.copies

    def kernel_stats(self, bpf: Any) -> dict[str, int]:
        return percpu_counts(bpf["mt_stack_stats"], KERNEL_STATS)

    def losses(self, bpf: Any) -> dict[str, int]:
        stats = self.kernel_stats(bpf)
        out = {k: stats[k] for k in KERNEL_LOSSES}
        out["stack_records_malformed"] = self.malformed
        return out

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.regions = None
        if self._regions_map is not None:
            self._regions_map.close()
            self._regions_map = None
