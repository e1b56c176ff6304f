"""The plug-in interface between the capture core and the parts that add BPF programs.

The capture core (tracker/session) builds one bcc program from `memtrack/bpf/common.h`
followed by the `sources()` of each enabled part, in the order the parts are given
(stacks first: the allocator probes call its `mt_stack_capture`). After loading it
calls each part's `attach`. While the command runs and once more after it exits, the
session's drain thread reads every ring a part declares in `rings()` (bytes only:
`memtrack.capture.ringbuf.RingReader`, `read_fixed(dtype) -> numpy array` for rings
whose records all have one size, `read_records() -> Records` (one blob, and arrays
of where each record lies) for variable-size ones) and its writer thread hands what was
read, in ring order and coalesced into batches, to the part's `write` (`drain`, read
and write in one, is for callers outside a session). At the end `losses` adds the
part's loss counters to the manifest. A part with an `on_stop(bpf, pid, maps)` method
is called at every attach stop, while the process is stopped, with its mappings
(procfs.MapLine).

Every ring write in BPF calls `mt_backpressure(MT_RING_*)` (common.h) first; `Ring.ring_id`
is that id, so that the session can put the ring's high watermark in place.

Parts: the allocator probes and lifecycle/syscall events (capture core), stack capture
(`memtrack.capture.stacks`), resident memory (`memtrack.capture.rss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from memtrack.schema.artifact import ArtifactWriter

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"

# common.h MT_RING_*: a ring's slot in mt_rings / mt_pause_at / mt_pauses.
RING_EVENTS, RING_STACKS, RING_RSS, RING_RSS_EVENTS, RING_FAULTS, RING_PYFRAMES = range(6)
RING_NAMES = ("events", "stacks", "rss", "rss_events", "faults", "pyframes")
# common.h mt_config's slots: recording enabled (--start-disabled, the control FIFO),
# probes scoped to each traced process (lifecycle.c MT_CONFIG_SCOPED), a wrapper call
# site registered (MT_CONFIG_WRAPPED), the session's generation of thread states
# (MT_CONFIG_GENERATION)
CONFIG_ENABLED, CONFIG_SCOPED, CONFIG_WRAPPED, CONFIG_GENERATION = range(4)


@dataclass(frozen=True)
class Ring:
    """One BPF ring buffer of a part, read by the session's drain thread."""

    map_name: str  # its BPF_RINGBUF_OUTPUT
    ring_id: int  # RING_* (common.h MT_RING_*)
    dtype: np.dtype | None  # every record this one size (read as one array), or None
    max_record: int  # bytes of its largest record (the headroom above a high watermark)

    @property
    def name(self) -> str:
        return RING_NAMES[self.ring_id]


class CapturePart(Protocol):
    name: str

    def sources(self) -> list[str]:
        """BPF C file names under memtrack/bpf/, concatenated after common.h."""
        ...

    def cflags(self) -> list[str]:
        """-D definitions the sources need (sizes, feature switches)."""
        ...

    def attach(self, bpf: Any) -> list[str]:
        """Attach tracepoints etc. Returns warnings; a failure disables the part with a
        warning and never stops allocation capture."""
        ...

    def rings(self) -> list[Ring]:
        """The rings the session's drain thread reads for this part (after attach)."""
        ...

    def write(self, bpf: Any, writer: ArtifactWriter, ring: Ring, records: Any) -> int:
        """Append what the drain read from `ring` (a numpy array of ring.dtype, or
        ringbuf.Records) as batches; returns records written."""
        ...

    def drain(self, bpf: Any, writer: ArtifactWriter) -> int:
        """Bulk-read this part's rings and append batches; returns records written
        (for callers that read and write in one go, outside a session)."""
        ...

    def losses(self, bpf: Any) -> dict[str, int]:
        """Loss counters to add to the manifest (names from schema.LOSS_COUNTERS or new)."""
        ...
