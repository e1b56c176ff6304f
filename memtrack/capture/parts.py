"""The plug-in interface between the capture core and the parts that add BPF programs.

The capture core (tracker/session) builds one bcc program from `memtrack/bpf/common.h`
followed by the `sources()` of each enabled part, in the order the parts are given
(stacks first: the allocator probes call its `mt_stack_capture`). After loading it
calls each part's `attach`, then, from its drain loop while the command runs and once
more after it exits, each part's `drain`; at the end `losses` adds the part's loss
counters to the manifest. A part with an `on_stop(bpf, pid, maps)` method is called at
every attach stop, while the process is stopped, with its mappings (procfs.MapLine).

Parts: the allocator probes and lifecycle/syscall events (capture core), stack capture
(`memtrack.capture.stacks`), resident memory (`memtrack.capture.rss`).

Rings are read in bulk with `memtrack.capture.ringbuf.RingReader(bpf, map_name)`:
`read_fixed(dtype) -> numpy array` for rings whose records all have one size, and
`read_records() -> list[bytes]` for variable-size ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from memtrack.schema.artifact import ArtifactWriter

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"


@dataclass
class CaptureOptions:
    """Every capture option; each has a MEMTRACK_<NAME> environment variable."""

    stacks: bool = True
    stack_budget: int = 32768  # at most; a copy stops at the stack's end
    stack_copies: bool = False  # debug: every capture's raw copy too (stack_copies.arrow)
    rss: bool = True
    track_faults: bool = False
    modules: bool = True
    start_disabled: bool = False
    probe_placement: str = "auto"  # "auto" or "entry"
    events_ring_pages: int = 4096  # 16 MiB
    stacks_ring_pages: int = 8192  # 32 MiB
    fail_on_loss: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


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

    def drain(self, bpf: Any, writer: ArtifactWriter) -> int:
        """Bulk-read this part's rings and append batches; returns records written."""
        ...

    def losses(self, bpf: Any) -> dict[str, int]:
        """Loss counters to add to the manifest (names from schema.LOSS_COUNTERS or new)."""
        ...
