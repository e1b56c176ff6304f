"""Variables meant for the traced command only, kept out of memtrack's own process.

memtrack is Python: PYTHONMALLOC=malloc (as in `PYTHONMALLOC=malloc memtrack capture
-- python3 ...`) would make every object of its own interpreter a malloc, and so a
trap into the very probes it placed on malloc (its drain thread then read ~40x slower
and the traced program spent half its run paused). The command line re-executes
itself without them, before anything else (this module imports nothing heavy), and
gives them back to CMD.
"""

from __future__ import annotations

import os
import sys

CMD_ONLY_ENV = ("PYTHONMALLOC",)
SET_ASIDE = "MEMTRACK_CMD_"  # MEMTRACK_CMD_PYTHONMALLOC holds CMD's PYTHONMALLOC


def own_environment(argv: list[str]) -> None:
    """Re-execute `memtrack ARGV[1:]` without CMD_ONLY_ENV, set aside for CMD."""
    moved = {k: v for k, v in os.environ.items() if k in CMD_ONLY_ENV}
    if not moved:
        return
    env = {k: v for k, v in os.environ.items() if k not in moved}
    env.update({SET_ASIDE + k: v for k, v in moved.items()})
    os.execve(sys.executable, [sys.executable, "-m", "memtrack.cli", *argv[1:]], env)


def command_environment() -> dict[str, str]:
    """The environment CMD runs in: memtrack's, with what own_environment() set aside."""
    env = dict(os.environ)
    for k in CMD_ONLY_ENV:
        if SET_ASIDE + k in env:
            env[k] = env.pop(SET_ASIDE + k)
    return env
