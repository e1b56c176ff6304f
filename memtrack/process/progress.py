"""Where `process` is: its stages (STAGES) run one after another, each once; a stage
that knows its work tells how far it is (events read of the events file's bytes, stack
pieces unwound of the pieces, buckets paired of the buckets) a piece or bucket at
a time, never an event at a time. A sink takes that: `TerminalProgress` draws it on
stderr (a finished stage keeps its counts and time, the running one shows its
percentage and time left, a stage not started is not shown), the tests record it."""

from __future__ import annotations

import time
from typing import Any, Protocol

STAGES = ("read", "lifecycle", "rss", "regions", "decode", "unwind", "pyframes", "symbolize",
          "pair", "load", "metadata")


class Advance(Protocol):
    """How far a stage is: `done` of `total` (None: not known), and counts to show."""

    def __call__(self, done: int, total: int | None = None, **counts: int) -> None: ...


def no_progress(done: int, total: int | None = None, **counts: int) -> None:
    """An Advance that shows nothing (a stage run alone)."""


class ProgressSink(Protocol):
    def start(self, stage: str) -> None: ...

    def advance(self, stage: str, done: int, total: int | None, counts: dict[str, int]
                ) -> None: ...

    def finish(self, stage: str, seconds: float) -> None: ...


class TerminalProgress:
    """The stages as rich progress lines on stderr, one added as each stage starts."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self.tasks: dict[str, Any] = {}
        self.started: dict[str, float] = {}
        self.counts: dict[str, dict[str, int]] = {}

    def __enter__(self) -> TerminalProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start(self, stage: str) -> None:
        self.tasks[stage] = self.progress.add_task(stage, total=None, note="")
        self.started[stage] = time.monotonic()

    def advance(self, stage: str, done: int, total: int | None, counts: dict[str, int]
                ) -> None:
        self.counts[stage] = counts
        note = _counts(counts)
        if total:
            pct = min(done / total, 1.0)
            left = (time.monotonic() - self.started[stage]) * (1 - pct) / pct if pct else None
            note = f"{pct:4.0%} {note}" + (f" ~{left:.0f}s left" if left is not None else "")
        self.progress.update(self.tasks[stage], total=total, completed=done, note=note)

    def finish(self, stage: str, seconds: float) -> None:
        task = self.tasks[stage]
        note = f"{_counts(self.counts.get(stage, {}))} done in {seconds:.2f}s".lstrip()
        self.progress.update(task, total=1, completed=1, note=note)
        self.progress.stop_task(task)


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k} {v:,}" for k, v in counts.items())
