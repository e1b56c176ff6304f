"""`memtrack doctor`: what capture needs on this machine (memtrack.capture.doctor)."""

from __future__ import annotations

from memtrack.commands import require_privileges


def run() -> int:
    from memtrack.capture.doctor import run_doctor

    require_privileges("doctor")
    return run_doctor()
