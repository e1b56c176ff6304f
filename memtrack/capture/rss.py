"""The resident-memory capture part: kmem:rss_stat, madvise/mremap, and --track-faults.

`RssPart` plugs into the capture core (memtrack.capture.parts.CapturePart). Its BPF side
is memtrack/bpf/rss.c. Tracepoint fields are read at the offsets the running kernel's
format files give (passed to the C code as -D MT_OFF_<EVENT>_<FIELD>), so no kernel
header or struct is needed; a tracepoint that is missing or fails to attach disables
its piece with a warning and never stops allocation capture.

Rings and where they go:
  mt_rss_ring     RSS_DTYPE records      -> rss.arrow
  mt_rss_events   schema.EVENT_DTYPE     -> events.arrow (MADVISE, MREMAP)
  mt_faults_ring  FAULT_DTYPE records    -> faults.arrow (only with track_faults)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.capture.options import CaptureOptions
from memtrack.capture.parts import RING_FAULTS, RING_RSS, RING_RSS_EVENTS, Ring
from memtrack.schema import EVENT_DTYPE, EVENTS, FAULTS, RSS
from memtrack.schema.artifact import ArtifactWriter

TRACEFS_EVENTS = Path("/sys/kernel/tracing/events")

# bpf/rss.c struct mt_rss_rec
RSS_DTYPE = np.dtype(
    [
        ("ts", "<u8"),
        ("pid", "<u4"),
        ("member", "u1"),
        ("external", "u1"),
        ("_pad", "<u2"),
        ("bytes", "<i8"),
    ]
)
assert RSS_DTYPE.itemsize == 24

# bpf/rss.c struct mt_fault_rec
FAULT_DTYPE = np.dtype(
    [
        ("ts", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("address", "<u8"),
        ("error_code", "<u4"),
        ("kernel", "<u4"),
    ]
)
assert FAULT_DTYPE.itemsize == 32

# The rings of each role, and the table each one's records go to.
RINGS = {
    "rss": Ring("mt_rss_ring", RING_RSS, RSS_DTYPE, RSS_DTYPE.itemsize),
    "events": Ring("mt_rss_events", RING_RSS_EVENTS, EVENT_DTYPE, EVENT_DTYPE.itemsize),
    "faults": Ring("mt_faults_ring", RING_FAULTS, FAULT_DTYPE, FAULT_DTYPE.itemsize),
}

# bpf/rss.c mt_rss_lost slots -> manifest loss counters.
LOST_SLOTS = ("rss_ring_full", "rss_events_ring_full", "faults_ring_full",
              "rss_syscall_stash_full")


@dataclass(frozen=True)
class Hook:
    """One BPF function of rss.c and the tracepoint it is attached to."""

    fn_name: str
    category: str
    event: str
    # macro suffix -> format-file field name
    fields: tuple[tuple[str, str], ...]
    role: str  # "rss", "events" or "faults"


HOOKS = (
    Hook("mt_rss_stat", "kmem", "rss_stat",
         (("RSS_MM_ID", "mm_id"), ("RSS_CURR", "curr"), ("RSS_MEMBER", "member"),
          ("RSS_SIZE", "size")), "rss"),
    Hook("mt_madvise_enter", "syscalls", "sys_enter_madvise",
         (("MADVISE_START", "start"), ("MADVISE_LEN_IN", "len_in"),
          ("MADVISE_BEHAVIOR", "behavior")), "events"),
    Hook("mt_madvise_exit", "syscalls", "sys_exit_madvise", (("SYSEXIT_RET", "ret"),), "events"),
    Hook("mt_mremap_enter", "syscalls", "sys_enter_mremap",
         (("MREMAP_ADDR", "addr"), ("MREMAP_OLD_LEN", "old_len"),
          ("MREMAP_NEW_LEN", "new_len"), ("MREMAP_FLAGS", "flags")), "events"),
    Hook("mt_mremap_exit", "syscalls", "sys_exit_mremap", (("SYSEXIT_RET", "ret"),), "events"),
    Hook("mt_fault_user", "exceptions", "page_fault_user",
         (("FAULT_ADDRESS", "address"), ("FAULT_ERROR_CODE", "error_code")), "faults"),
    Hook("mt_fault_kernel", "exceptions", "page_fault_kernel",
         (("FAULT_ADDRESS", "address"), ("FAULT_ERROR_CODE", "error_code")), "faults"),
)

_FIELD_RE = re.compile(r"field:[^;]*?\b(\w+)(?:\[[^\]]*\])?;\s*offset:(\d+);\s*size:(\d+);")


class TracepointUnavailable(Exception):
    """A tracepoint's format file is missing or lacks a field we read."""


def tracepoint_fields(category: str, event: str,
                      tracefs: Path = TRACEFS_EVENTS) -> dict[str, tuple[int, int]]:
    """Field name -> (offset, size) from the tracepoint's format file."""
    path = tracefs / category / event / "format"
    try:
        text = path.read_text()
    except OSError as e:
        raise TracepointUnavailable(f"{category}:{event}: cannot read {path} ({e.strerror})") \
            from None
    return {m[1]: (int(m[2]), int(m[3])) for m in _FIELD_RE.finditer(text)}


def _ring_reader(bpf: Any, name: str) -> Any:
    from memtrack.capture.ringbuf import RingReader

    return RingReader(bpf, name)


def _events_batch(rec: np.ndarray) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array(rec[n]) for n in EVENTS.names], schema=EVENTS)


class RssPart:
    """kmem:rss_stat into rss.arrow; madvise/mremap into events.arrow; faults on request.

    `reader` builds a bulk ring reader for (bpf, map name); the default is the capture
    core's memtrack.capture.ringbuf.RingReader.
    """

    name = "rss"

    def __init__(self, options: CaptureOptions, *, tracefs: Path = TRACEFS_EVENTS,
                 reader: Any = _ring_reader) -> None:
        self.options = options
        self._reader_factory = reader
        self._readers: dict[str, Any] = {}
        self.warnings: list[str] = []
        self.offsets: dict[str, int] = {}
        self.hooks: list[Hook] = []
        self.roles: set[str] = set()
        wanted = [h for h in HOOKS if h.role != "faults" or options.track_faults]
        missing: dict[str, str] = {}
        for h in wanted:
            try:
                fmt = tracepoint_fields(h.category, h.event, tracefs)
                lacking = [f for _, f in h.fields if f not in fmt]
                if lacking:
                    raise TracepointUnavailable(
                        f"{h.category}:{h.event} has no field {', '.join(lacking)}")
                offs = {f"MT_OFF_{macro}": fmt[f][0] for macro, f in h.fields}
                clash = [k for k, v in offs.items() if self.offsets.get(k, v) != v]
                if clash:
                    raise TracepointUnavailable(
                        f"{h.category}:{h.event} lays out {clash[0]} unlike its sibling")
            except TracepointUnavailable as e:
                missing.setdefault(h.role, str(e))
                continue
            self.offsets.update(offs)
            self.hooks.append(h)
        # A role works only with all of its hooks (enter without exit emits nothing).
        for role, why in missing.items():
            self.hooks = [h for h in self.hooks if h.role != role]
            self.warnings.append(f"{_ROLE_TEXT[role]} disabled: {why}")
        self.roles = {h.role for h in self.hooks}

    def sources(self) -> list[str]:
        return ["rss.c"]

    def cflags(self) -> list[str]:
        flags = [f"-D{k}={v}" for k, v in sorted(self.offsets.items())]
        # Macros of a disabled hook still appear in rss.c; they are never attached.
        for h in HOOKS:
            for macro, _ in h.fields:
                if f"MT_OFF_{macro}" not in self.offsets:
                    flags.append(f"-DMT_OFF_{macro}=8")
        tuning = self.options.tuning
        flags += [f"-DMT_RSS_RING_PAGES={tuning.rss_ring_pages}",
                  f"-DMT_RSS_EVENTS_RING_PAGES={tuning.rss_events_ring_pages}",
                  f"-DMT_FAULTS_RING_PAGES={tuning.faults_ring_pages}"]
        if self.options.track_faults and "faults" in self.roles:
            flags.append("-DMT_TRACK_FAULTS")
        return flags

    def attach(self, bpf: Any) -> list[str]:
        failed: dict[str, str] = {}
        for h in self.hooks:
            if h.role in failed:
                continue
            try:
                bpf.attach_tracepoint(tp=f"{h.category}:{h.event}", fn_name=h.fn_name)
            except Exception as e:  # noqa: BLE001 - bcc raises plain Exception
                failed[h.role] = f"cannot attach {h.category}:{h.event} ({e})"
        for role, why in failed.items():
            for h in self.hooks:
                if h.role == role:
                    _detach(bpf, h)
            self.warnings.append(f"{_ROLE_TEXT[role]} disabled: {why}")
        self.hooks = [h for h in self.hooks if h.role not in failed]
        self.roles = {h.role for h in self.hooks}
        return list(self.warnings)

    def _read(self, bpf: Any, ring: str, dtype: np.dtype) -> np.ndarray:
        r = self._readers.get(ring)
        if r is None:
            r = self._readers[ring] = self._reader_factory(bpf, ring)
        return r.read_fixed(dtype)

    def rings(self) -> list[Ring]:
        return [RINGS[role] for role in ("rss", "events", "faults") if role in self.roles]

    def write(self, bpf: Any, writer: ArtifactWriter, ring: Ring, rec: Any) -> int:
        if not len(rec):
            return 0
        if ring.ring_id == RING_RSS:
            writer.write("rss", pa.RecordBatch.from_arrays(
                [pa.array(rec["ts"]), pa.array(rec["pid"]), pa.array(rec["member"]),
                 pa.array(rec["bytes"]), pa.array(rec["external"].astype(bool))],
                schema=RSS))
        elif ring.ring_id == RING_RSS_EVENTS:
            writer.write("events", _events_batch(rec))
        else:
            writer.write("faults", pa.RecordBatch.from_arrays(
                [pa.array(rec["ts"]), pa.array(rec["pid"]), pa.array(rec["tid"]),
                 pa.array(rec["address"]), pa.array(rec["error_code"]),
                 pa.array(rec["kernel"].astype(bool))], schema=FAULTS))
        return len(rec)

    def drain(self, bpf: Any, writer: ArtifactWriter) -> int:
        return sum(self.write(bpf, writer, r, self._read(bpf, r.map_name, r.dtype))
                   for r in self.rings())

    def close(self) -> None:
        """Unmap the rings (the capture core calls this before unloading the program)."""
        for r in self._readers.values():
            close = getattr(r, "close", None)
            if close is not None:
                close()
        self._readers.clear()

    def losses(self, bpf: Any) -> dict[str, int]:
        lost = bpf["mt_rss_lost"]
        return {name: int(lost[i].value) for i, name in enumerate(LOST_SLOTS)}


_ROLE_TEXT = {
    "rss": "RSS (kmem:rss_stat)",
    "events": "madvise/mremap events",
    "faults": "--track-faults",
}


def _detach(bpf: Any, h: Hook) -> None:
    try:
        bpf.detach_tracepoint(f"{h.category}:{h.event}")
    except Exception:  # noqa: BLE001 - it was never attached
        return
