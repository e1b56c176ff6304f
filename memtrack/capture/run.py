"""`memtrack capture`: one command under one Tracker, a summary, the exit status."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from memtrack.capture.parts import CaptureOptions
from memtrack.capture.tracker import CaptureError, CaptureResult, Tracker


def check_options(options: CaptureOptions) -> None:
    """One-line errors for option values capture cannot use."""
    for name, pages in (("--events-ring-pages", options.events_ring_pages),
                        ("--stacks-ring-pages", options.stacks_ring_pages)):
        if pages <= 0 or pages & (pages - 1):
            raise CaptureError(f"{name} {pages}: must be a power of two (pages)")
    if options.probe_placement not in ("auto", "entry"):
        raise CaptureError(f"--probe-placement {options.probe_placement}: "
                           "expected auto or entry")


def summary(result: CaptureResult, cmd: list[str]) -> list[str]:
    how = (f"killed by signal {result.signal}" if result.signal is not None
           else f"exited with status {result.exit_code}")
    lines = [f"memtrack: {cmd[0]} {how}; {result.events:,} events in "
             f"{result.duration_s:.2f} s written to {result.artifact}"]
    for k, v in result.nonzero_losses().items():
        lines.append(f"memtrack: LOST {k} = {v:,}")
    for k, v in result.fidelity_notes().items():
        hint = " (allocations whose stack went on beyond --stack-budget: their stacks " \
               "end at the cut unless the kernel's frame-pointer chain continues them)" \
            if k == "stack_copies_cut" else ""
        lines.append(f"memtrack: note: {k} = {v:,}{hint}")
    lines += [f"memtrack: warning: {w}" for w in result.warnings]
    return lines


def run_capture(cmd: list[str], output: Path, options: CaptureOptions, *, force: bool = False,
                control: Path | None = None, timeout: float | None = None,
                err: TextIO = sys.stderr) -> int:
    """Capture `cmd` into `output`; returns the exit status for the shell (CMD's, or 1
    when --fail-on-loss finds a loss)."""
    check_options(options)
    live = err if err.isatty() else None
    with Tracker(options) as tracker:
        session = tracker.spawn(cmd, output, overwrite=force, control=control, live=live)
        result = session.wait(timeout=timeout)
    for line in summary(result, cmd):
        print(line, file=err)
    if options.fail_on_loss and result.nonzero_losses():
        print("memtrack: events were lost (--fail-on-loss)", file=err)
        return 1
    return result.status
