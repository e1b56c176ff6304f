"""`memtrack capture -o OUT.memtrack -- CMD...` (or `--pid PID`): record every allocation
of CMD and its descendants, or of running processes and theirs (memtrack.capture.run)."""

from __future__ import annotations

from pathlib import Path

from memtrack.commands import (
    MAX_SECONDS,
    CommandError,
    bounded,
    check_output,
    give_to_invoking_user,
    require_privileges,
)


def run(cmd: list[str], output: Path, *, pids: list[int], duration: float | None,
        force: bool, stacks: bool, stack_budget: int,
        stack_copies: bool, python_frames: bool, python_stacks: str,
        python_allocators: bool, rss: bool,
        track_faults: bool, modules: bool,
        start_disabled: bool, control_fifo: Path | None, probe_placement: str, probe_scope: str,
        events_ring_pages: int | None, stacks_ring_pages: int | None, on_ring_full: str,
        fail_on_loss: bool,
        timeout: float | None, program_cache: str) -> int:
    import sys

    from memtrack.capture.cmdenv import own_environment

    require_privileges("capture", " -o OUT.memtrack -- CMD...")
    own_environment(sys.argv)
    from memtrack.capture.options import CaptureError, CaptureOptions
    from memtrack.capture.run import run_capture
    from memtrack.schema.artifact import ArtifactError

    for option, seconds in (("--timeout", timeout), ("--duration", duration)):
        if seconds is not None:
            bounded(option, seconds, 0.001, MAX_SECONDS)
    check_output(output, force)
    rings = {k: v for k, v in (("events_ring_pages", events_ring_pages),
                               ("stacks_ring_pages", stacks_ring_pages)) if v is not None}
    try:
        options = CaptureOptions(
            stacks=stacks, stack_budget=stack_budget, stack_copies=stack_copies,
            python_frames=python_frames, python_stacks=python_stacks,
            python_allocators=python_allocators, rss=rss, track_faults=track_faults,
            modules=modules, start_disabled=start_disabled,
            probe_placement=probe_placement, probe_scope=probe_scope,
            on_ring_full=on_ring_full, fail_on_loss=fail_on_loss,
            program_cache=program_cache, **rings)
        return run_capture(cmd, output, options, force=force, control=control_fifo,
                           timeout=timeout, pids=pids, duration=duration)
    except (CaptureError, ArtifactError, ValueError) as e:
        raise CommandError(str(e)) from None
    finally:
        give_to_invoking_user(output)
