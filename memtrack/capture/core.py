"""The capture core's part: allocator probes (bpf/alloc.c) and the process tree,
address-space syscalls and attach requests (bpf/lifecycle.c).

Its tracepoints are attached by bcc when the program loads (TRACEPOINT_PROBE); its
uprobes are attached module by module by the session as the tracked tree maps them.
`mark_region` writes a REGION event into the events ring from memtrack itself, by
running `mt_region_mark` (a raw tracepoint program attached nowhere) once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.capture.options import CaptureOptions
from memtrack.capture.parts import RING_EVENTS, Ring
from memtrack.capture.program import PROG_RAW_TRACEPOINT, LoadError, test_run
from memtrack.capture.ringbuf import RingReader
from memtrack.capture.tables import percpu_counts
from memtrack.schema import EVENT_DTYPE, EVENTS
from memtrack.schema.artifact import ArtifactWriter

# bpf/lifecycle.c struct mt_attach_req
ATTACH_DTYPE = np.dtype(
    [
        ("ts", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("reason", "<u4"),
        ("fd", "<i4"),
        ("len", "<u8"),
        ("off", "<u8"),
    ]
)
assert ATTACH_DTYPE.itemsize == 40
REQ_MMAP = 1
REQ_EXEC = 2  # off: the exec'ing thread's tid before the exec (the pid if it led)
REQ_FORK = 3  # a new process of the tree, stopped before it runs (scoped probes)

# bpf/alloc.c mt_core_losses slots -> manifest loss counters
LOSS_SLOTS = ("events_ring_full", "attach_requests_dropped", "unpaired_returns")
ATTACH_RING_PAGES = 64
EVENTS_RING = Ring("mt_events", RING_EVENTS, EVENT_DTYPE, EVENT_DTYPE.itemsize)


def events_batch(rec: np.ndarray) -> pa.RecordBatch:
    """Drained mt_event records as an events.arrow batch."""
    return pa.RecordBatch.from_arrays(
        [pa.array(np.ascontiguousarray(rec[f.name])) for f in EVENTS], schema=EVENTS)


class CorePart:
    """Allocation, syscall and lifecycle events into events.arrow."""

    name = "core"

    def __init__(self, options: CaptureOptions) -> None:
        self.options = options
        self.events: RingReader | None = None
        self.attach_requests: RingReader | None = None
        self.written = 0
        self._region_fd = -1
        self.regions_unavailable: str | None = "not attached yet"

    def sources(self) -> list[str]:
        return ["alloc.c", "lifecycle.c"]

    def cflags(self) -> list[str]:
        return [f"-DMT_EVENTS_PAGES={self.options.events_ring_pages}",
                f"-DMT_ATTACH_PAGES={ATTACH_RING_PAGES}",
                f"-DMT_THREAD_SLOTS={self.options.tuning.thread_slots}"]

    def attach(self, bpf: Any) -> list[str]:
        self.events = RingReader(bpf, "mt_events")
        self.attach_requests = RingReader(bpf, "mt_attach")
        try:
            self._region_fd = bpf.load_func("mt_region_mark", PROG_RAW_TRACEPOINT).fd
            self.regions_unavailable = None
        except LoadError as e:  # said when a region is asked for, not at every capture
            self.regions_unavailable = str(e)
        return []

    def mark_region(self, pid: int, tid: int, region_id: int, begin: bool) -> bool:
        """Write the REGION event of `tid`'s region now (False: the events ring is full,
        nothing was written). OSError when the kernel cannot run the program."""
        if self.regions_unavailable is not None:
            raise OSError(self.regions_unavailable)
        return test_run(self._region_fd, [pid, tid, region_id, int(begin)]) == 0

    def read_events(self) -> np.ndarray:
        assert self.events is not None, "CorePart.attach was not called"
        return self.events.read_fixed(EVENT_DTYPE)

    def rings(self) -> list[Ring]:
        return [EVENTS_RING]

    def write(self, bpf: Any, writer: ArtifactWriter, ring: Ring, records: Any) -> int:
        if len(records):
            writer.write("events", events_batch(records))
            self.written += len(records)
        return len(records)

    def drain(self, bpf: Any, writer: ArtifactWriter) -> int:
        return self.write(bpf, writer, EVENTS_RING, self.read_events())

    def losses(self, bpf: Any) -> dict[str, int]:
        """Totals since the program was loaded (a session subtracts its start values)."""
        return percpu_counts(bpf["mt_core_losses"], LOSS_SLOTS)

    def close(self) -> None:
        for r in (self.events, self.attach_requests):
            if r is not None:
                r.close()
