"""The memtrack command line as the tests run it: a subprocess of this interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]


def cli(*args: str) -> str:
    """`memtrack ARGS`, which must succeed: what it printed."""
    r = subprocess.run([*MEMTRACK, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


def capture_and_process(cmd: list[str], d: Path) -> tuple[Path, str]:
    """`cmd` captured and processed in `d` (r.memtrack, r.duckdb): the run database, and
    what the command printed."""
    out = cli("capture", "-o", str(d / "r.memtrack"), "--", *cmd)
    cli("process", str(d / "r.memtrack"), "-o", str(d / "r.duckdb"), "-q")
    return d / "r.duckdb", out
