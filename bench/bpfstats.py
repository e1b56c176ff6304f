"""BPF programs' own run time (kernel.bpf_stats_enabled), for the benches that cost a
probe by it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memtrack.capture.program import prog_info  # noqa: E402

__all__ = ["bpf_stats", "prog_info", "prog_stats"]

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


@contextmanager
def bpf_stats() -> Iterator[None]:
    """kernel.bpf_stats_enabled on for the block, as it was after it."""
    saved = STATS.read_text().strip()
    STATS.write_text("1")
    try:
        yield
    finally:
        STATS.write_text(saved)


def prog_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded BPF program."""
    info = prog_info(fd)
    return info.get("run_time_ns", 0), info.get("run_cnt", 0)
