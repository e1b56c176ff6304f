"""Captures of real programs under a real Tracker: the program's stdout (where the
fixtures print the addresses they got) kept apart from pytest's, and the artifact read
back as rows."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from memtrack.capture.options import CaptureOptions, Tuning
from memtrack.capture.procfs import read_maps
from memtrack.schema import ALLOC_KINDS, EventKind
from memtrack.schema.artifact import Artifact

M, C, R, A, F = (EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC,
                 EventKind.ALIGNED_ALLOC, EventKind.FREE)
HEAP_KINDS = {*ALLOC_KINDS, EventKind.FREE}
INT3 = 0xCC


@pytest.fixture(scope="module")
def tracker() -> Any:
    """A Tracker with the core part only (no stacks, no RSS), shared by a test module."""
    from memtrack.capture.tracker import Tracker

    with Tracker(CaptureOptions(stacks=False, rss=False)) as t:
        yield t


# Both ways allocator probes reach the kernel (memtrack.capture.links): one
# uprobe_multi link per module and program where the kernel has them (6.6+), one
# perf-event uprobe per function otherwise. A test module whose `tracker` is this one
# runs every test with both.
@pytest.fixture(scope="module", params=["uprobe_multi", "perf_event"])
def tracker_each_attach(request: pytest.FixtureRequest) -> Any:
    from memtrack.capture.tracker import Tracker

    options = CaptureOptions(stacks=False, rss=False,
                             tuning=Tuning(uprobe_attach=request.param))
    with Tracker(options) as t:
        assert t.uprobes.mode == request.param
        yield t


def spawn(tracker: Any, cmd: list[str], artifact: Path, stdout: Path, *,
          timeout: float = 60, **options: Any) -> Any:
    """Capture `cmd` into `artifact` with its stdout in the file `stdout` (`options` go to
    Tracker.spawn); the result."""
    with open(stdout, "w") as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            session = tracker.spawn(cmd, artifact, **options)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        return session.wait(timeout=timeout)


class Run:
    """A finished capture: its result, the program's stdout and the artifact's events."""

    def __init__(self, path: Path, result: Any, stdout: str) -> None:
        self.path = path
        self.result = result
        self.stdout = stdout
        self.art = Artifact.open(path)
        self.events = self.art.read("events").table.to_pylist()

    def heap(self, pid: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] in HEAP_KINDS
                and (pid is None or e["pid"] == pid)]

    def seq(self, pid: int | None = None) -> list[tuple[int, int]]:
        return [(e["kind"], e["size"]) for e in self.heap(pid)]

    def after_exec(self, pid: int) -> list[tuple[int, int]]:
        """(kind, size) of `pid`'s heap events after its (last) exec: what a forked
        shell does before exec'ing belongs to the shell."""
        execs = [e["ts"] for e in self.events if e["pid"] == pid and e["kind"] == EventKind.EXEC]
        return [(e["kind"], e["size"]) for e in self.heap(pid) if e["ts"] > max(execs)]

    def printed(self, name: str) -> list[int]:
        return [int(v, 16) for v in re.findall(rf"^{name} (0x[0-9a-f]+)$", self.stdout, re.M)]


def run(tracker: Any, tmp_path: Path, cmd: list[str], name: str = "run", *,
        start_disabled: bool = False) -> Run:
    out = tmp_path / "stdout"
    path = tmp_path / f"{name}.memtrack"
    result = spawn(tracker, cmd, path, out, start_disabled=start_disabled)
    return Run(path, result, out.read_text())


def check_no_loss(r: Run) -> None:
    assert r.result.nonzero_losses() == {}
    assert r.art.manifest.complete
    assert r.art.manifest.nonzero_losses() == {}


def probe_bytes(pid: int, art: Path) -> dict[str, int]:
    """The byte at each libc allocator probe of the capture `art`, in `pid`'s memory."""
    m = json.loads((art / "manifest.json").read_text())
    maps = read_maps(pid)
    assert maps is not None
    out = {}
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for p in m["probes"]:
            if "libc.so" not in p["path"]:
                continue
            off = p["file_offset"] + p["probe_offset"]
            for line in maps:
                if line.path == p["path"] and line.offset <= off < line.offset + (
                        line.end - line.start) and "x" in line.perms:
                    mem.seek(line.start + off - line.offset)
                    out[p["function"]] = mem.read(1)[0]
    assert "malloc" in out and "free" in out, out
    return out
