"""`memtrack capture`: one command under one Tracker, a summary, the exit status."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from memtrack.capture.cmdenv import command_environment
from memtrack.capture.options import CaptureError, CaptureOptions
from memtrack.capture.procfs import attach_refusal
from memtrack.capture.tracker import CaptureResult, Tracker, find_command


def summary(result: CaptureResult, cmd: list[str]) -> list[str]:
    if result.attached:
        what = "detached from " + ", ".join(map(str, result.attached))
        if result.interrupted is not None:
            what += f" on signal {result.interrupted}"
        lines = [f"memtrack: {what}; {result.events:,} events "
                 f"in {result.duration_s:.2f} s written to {result.artifact}"]
    else:
        how = (f"killed by signal {result.signal}" if result.signal is not None
               else f"exited with status {result.exit_code}")
        lines = [f"memtrack: {cmd[0]} {how}; {result.events:,} events in "
                 f"{result.duration_s:.2f} s written to {result.artifact}"]
    pauses = {k: v for k, v in result.pauses.items() if v}
    if pauses:
        rings = ", ".join(f"{k} ring {v:,}" for k, v in pauses.items())
        lines.append(f"memtrack: paused the traced processes {sum(pauses.values()):,} times "
                     f"({rings}) for {result.paused_s:.2f} s in all while the rings drained "
                     "(larger rings pause less)")
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
                pids: list[int] | None = None, duration: float | None = None,
                err: TextIO = sys.stderr) -> int:
    """Capture `cmd`, or attach to the running processes `pids` for `duration` seconds
    (None: until SIGINT/SIGTERM or their exits), into `output`; returns the exit status
    for the shell (CMD's; attached: 0, 128 + the signal that ended the capture; 1 when
    --fail-on-loss finds a loss). The status line is drawn only when `err` is a
    terminal (memtrack.capture.status)."""
    if cmd and pids:
        raise CaptureError("give either CMD or --pid, not both")
    if pids:
        if timeout is not None:
            raise CaptureError("--timeout kills CMD: an attached capture ends with --duration")
        for pid in pids:  # before anything is loaded
            why = attach_refusal(pid)
            if why is not None:
                raise CaptureError(f"--pid {pid}: {why}")
    elif duration is not None:
        raise CaptureError("--duration ends an attached capture (--pid): CMD ends with "
                           "--timeout")
    elif not cmd:
        raise CaptureError("no command given (CMD after --, or --pid PID)")
    else:
        find_command(cmd[0])  # before anything is loaded: a typo fails at once
    live = err if err.isatty() else None
    with Tracker(options, progress=err) as tracker:
        if pids:
            session = tracker.attach(pids, output, overwrite=force, control=control,
                                     live=live)
            print(f"memtrack: attached to {', '.join(map(str, pids))}; control FIFO "
                  f"{session.control.path} (answers: {session.control.ack_path})",
                  file=err)
            result = session.wait(timeout=duration)
        else:
            session = tracker.spawn(cmd, output, env=command_environment(),
                                    overwrite=force, control=control, live=live)
            result = session.wait(timeout=timeout)
    for line in summary(result, cmd):
        print(line, file=err)
    if options.fail_on_loss and result.nonzero_losses():
        print("memtrack: events were lost (--fail-on-loss)", file=err)
        return 1
    return result.status
