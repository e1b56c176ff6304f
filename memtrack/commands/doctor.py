"""`memtrack doctor`: what capture needs on this machine (memtrack.capture.doctor)."""

from __future__ import annotations


def run() -> int:
    from memtrack.capture.doctor import run_doctor

    return run_doctor()
