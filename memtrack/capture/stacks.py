"""Stack capture: the CapturePart that adds bpf/stacks.h and drains its record ring.

The allocator probes (capture core) call `mt_stack_capture` at an outer allocator
entry; it returns the stack hash carried by the event and emits a stack record the
first time a hash is seen. This part sizes the program (-D flags), turns the ring's
variable-size records into STACKS batches, and keeps the kernel's delta chains sound:
when userspace sees a record it cannot chain (its reference is not the thread's last
record, or it is malformed), it tells the kernel to forget that thread's reference and
the hash's dedupe marker, so that the thread's next capture is a keyframe and the stack
is emitted again.
"""

from __future__ import annotations

import ctypes as ct
import os
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.capture.parts import RING_STACKS, CaptureOptions, Ring
from memtrack.capture.stackring import records_to_batch
from memtrack.schema.artifact import ArtifactWriter
from memtrack.schema.stackrecord import MAX_BUDGET, MIN_BUDGET

RING = "mt_stack_ring"
# mt_stack_stats indexes of bpf/stacks.h -> counter names; the first five are losses.
KERNEL_STATS = (
    "stack_copy_failed",
    "stack_truncated",
    "stack_dedupe_full",
    "stacks_ring_full",
    "stack_delta_fallback",
    "stack_records",
    "stack_deduped",
    "stack_captures",
)
KERNEL_LOSSES = KERNEL_STATS[:5]
HDR_MAX_WORDS = 7 + 64 + 8 + 2 + 17 + 64


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


class StacksPart:
    """CapturePart for allocation stacks (stacks.h)."""

    name = "stacks"

    def __init__(self, options: CaptureOptions, *, seen_entries: int = 131072,
                 ref_entries: int = 512) -> None:
        self.budget = check_budget(options.stack_budget)
        self.delta = options.stack_compression
        self.ring_pages = options.stacks_ring_pages
        if self.ring_pages <= 0 or self.ring_pages & (self.ring_pages - 1):
            raise ValueError(f"stack ring pages must be a power of two, got {self.ring_pages}")
        self.seen_entries = seen_entries
        self.ref_entries = ref_entries
        self.malformed = 0
        self.chain_breaks = 0
        self.records = 0
        self._last: dict[int, int] = {}  # tid -> hash of its last record
        self._reader: Any = None

    def sources(self) -> list[str]:
        return ["stacks.h"]

    def cflags(self) -> list[str]:
        words = _pow2(self.budget // 8)
        flags = [
            "-DMT_STACKS",
            f"-DMT_STACK_BUDGET={self.budget}",
            f"-DMT_STACK_WORDS={words}",
            f"-DMT_STACK_OUT_WORDS={_pow2(max(words, HDR_MAX_WORDS))}",
            f"-DMT_STACK_RING_PAGES={self.ring_pages}",
            f"-DMT_STACK_SEEN={self.seen_entries}",
            f"-DMT_NCPU={possible_cpus()}",
        ]
        if self.delta:
            flags += ["-DMT_STACK_DELTA", f"-DMT_STACK_REFS={self.ref_entries}"]
        return flags

    def attach(self, bpf: Any) -> list[str]:
        return []

    def rings(self) -> list[Ring]:
        # a record is at most its largest header and body words plus the copy
        return [Ring(RING, RING_STACKS, None, HDR_MAX_WORDS * 8 + self.budget)]

    def write(self, bpf: Any, writer: ArtifactWriter, ring: Ring, records: Any) -> int:
        if not records:
            return 0
        batch = self.ingest(bpf, records)
        writer.write("stacks", batch)
        return batch.num_rows

    def drain(self, bpf: Any, writer: ArtifactWriter) -> int:
        if self._reader is None:
            from memtrack.capture.ringbuf import RingReader

            self._reader = RingReader(bpf, RING)
        return self.write(bpf, writer, self.rings()[0], self._reader.read_records())

    def ingest(self, bpf: Any, records: list[bytes]) -> pa.RecordBatch:
        """Parse ring records into a STACKS batch; forget the kernel state of broken chains."""
        batch, bad = records_to_batch(records)
        self.malformed += bad
        self.records += batch.num_rows
        if batch.num_rows and self.delta:
            self._check_chains(bpf, batch)
        if bad:
            # The malformed records' threads are unknown: restart every thread's chain.
            for tid in list(self._last):
                self._forget(bpf, tid, None)
        return batch

    def _check_chains(self, bpf: Any, batch: pa.RecordBatch) -> None:
        tid = batch.column("tid").to_numpy()
        h = batch.column("hash").to_numpy()
        ref = batch.column("ref_hash").to_numpy()
        order = np.argsort(tid, kind="stable")
        st, sh, sr = tid[order], h[order], ref[order]
        first = np.ones(st.size, dtype=bool)
        first[1:] = st[1:] != st[:-1]
        prev = np.empty_like(sh)
        prev[1:] = sh[:-1]
        first_idx = np.flatnonzero(first)
        prev[first_idx] = [self._last.get(int(t), 0) for t in st[first_idx]]
        broken = (sr != 0) & (sr != prev)
        last_idx = np.append(first_idx[1:] - 1, st.size - 1)
        self._last.update(zip(st[last_idx].tolist(), sh[last_idx].tolist(), strict=True))
        for i in np.flatnonzero(broken):
            self.chain_breaks += 1
            self._forget(bpf, int(st[i]), int(sh[i]))

    def _forget(self, bpf: Any, tid: int, stack_hash: int | None) -> None:
        """Make the thread's next capture a keyframe and let the stack be emitted again."""
        self._last.pop(tid, None)
        try:
            del bpf["mt_stack_refs"][ct.c_uint32(tid)]
        except KeyError:
            pass
        if stack_hash is not None:
            try:
                del bpf["mt_stack_seen"][ct.c_uint64(stack_hash)]
            except KeyError:
                pass

    def kernel_stats(self, bpf: Any) -> dict[str, int]:
        table = bpf["mt_stack_stats"]
        out = {}
        for i, name in enumerate(KERNEL_STATS):
            out[name] = int(sum(table[ct.c_int(i)]))
        return out

    def losses(self, bpf: Any) -> dict[str, int]:
        stats = self.kernel_stats(bpf)
        out = {k: stats[k] for k in KERNEL_LOSSES}
        out["stack_records_malformed"] = self.malformed
        out["stack_chain_breaks"] = self.chain_breaks
        return out

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
