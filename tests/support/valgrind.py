"""valgrind as the oracle of a command's heap figures, per exec'd program: memcheck
(calls, bytes allocated, blocks in use at exit without glibc's freeres, which memtrack
does not run either) and dhat (the peak, at t-gmax). `--trace-children=yes` reports
each program a process runs once it exec'd it, and nothing of a forked child before its
exec."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

NUM = r"([\d,]+)"


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def _logs(tool: list[str], cmd: list[str], d: Path) -> dict[int, str]:
    d.mkdir(parents=True)
    r = subprocess.run(["valgrind", "--trace-children=yes", *tool,
                        f"--log-file={d}/log.%p", *cmd],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return {int(p.name[4:]): p.read_text() for p in d.glob("log.*")}


def heap_figures(cmd: list[str], d: Path) -> dict[str, dict[str, int]]:
    """{command line as valgrind prints it: {calls, allocated, leaked, leaked_blocks,
    peak}}, one entry per program run (the commands of one run must differ)."""
    assert shutil.which("valgrind"), "valgrind missing: run scripts/setup"
    out: dict[str, dict[str, int]] = {}
    for text in _logs(["--tool=memcheck", "--run-libc-freeres=no"], cmd, d / "memcheck"
                      ).values():
        command = re.search(r"== Command: (.*)", text)[1]
        use = re.search(rf"in use at exit: {NUM} bytes in {NUM} blocks", text)
        heap = re.search(rf"total heap usage: {NUM} allocs, {NUM} frees, {NUM} bytes", text)
        assert command not in out and use and heap, text
        out[command] = {"calls": _num(heap[1]), "allocated": _num(heap[3]),
                        "leaked": _num(use[1]), "leaked_blocks": _num(use[2])}
    for text in _logs(["--tool=dhat", "--dhat-out-file=/dev/null"], cmd, d / "dhat"
                      ).values():
        command = re.search(r"== Command: (.*)", text)[1]
        gmax = re.search(rf"At t-gmax: {NUM} bytes", text)
        assert gmax, text
        out[command]["peak"] = _num(gmax[1])
    return out
