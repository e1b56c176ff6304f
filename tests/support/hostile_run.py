"""Runs one memtrack command line under watch (tests/test_hostile.py): a Python audit
hook sees every file the interpreter opens, and each one read outside the allowed roots
or written outside the writable ones is appended to $HOSTILE_VIOLATIONS (the roots are
$HOSTILE_READ and $HOSTILE_WRITE, colon-separated). The address space is limited by the
parent (RLIMIT_AS), the time by its timeout.

    python hostile_run.py memtrack ARGS...
"""

from __future__ import annotations

import os
import sys

_READ = [os.path.realpath(p) for p in os.environ["HOSTILE_READ"].split(":") if p]
_WRITE = [os.path.realpath(p) for p in os.environ["HOSTILE_WRITE"].split(":") if p]
_OUT = os.environ["HOSTILE_VIOLATIONS"]
_busy = False


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _hook(event: str, args: tuple) -> None:
    global _busy
    if event != "open" or _busy:
        return
    path, mode, flags = args
    if isinstance(path, int) or path is None:
        return
    path = os.fsdecode(path)
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    real = os.path.realpath(os.path.abspath(path))
    ok = _inside(real, _WRITE) if writing else _inside(real, _READ + _WRITE)
    if not ok:
        _busy = True
        try:
            with open(_OUT, "a") as f:
                f.write(f"{'write' if writing else 'read'} {path} -> {real}\n")
        finally:
            _busy = False


sys.addaudithook(_hook)
sys.argv = sys.argv[1:]
from memtrack.cli import main  # noqa: E402

main()
