"""Where `process` is (memtrack.process.progress): on a synthetic artifact the stages
start and finish once each, in order, and the counts of those that know their work reach
their totals; through the CLI on a terminal the finished stages show their counts and
time."""

from __future__ import annotations

import os
import pty
import re
import sys
from pathlib import Path

from memtrack.process.pipeline import process
from memtrack.process.progress import STAGES


class Recorder:
    """A progress sink that keeps what it was told."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def start(self, stage: str) -> None:
        self.log.append(("start", stage))

    def advance(self, stage: str, done: int, total: int | None, counts: dict[str, int]
                ) -> None:
        self.log.append(("advance", stage, done, total, dict(counts)))

    def finish(self, stage: str, seconds: float) -> None:
        self.log.append(("finish", stage, seconds))


def test_stages_in_order_counts_to_their_totals(small_synth: Path, tmp_path: Path) -> None:
    rec = Recorder()
    # pieces of 256 KiB: 1,500 stacks of ~1 KiB are unwound in several
    summary = process(small_synth, tmp_path / "r.duckdb", progress=rec, jobs=2,
                      piece_bytes=256 << 10, cache_dir=None)
    bounds = [e[:2] for e in rec.log if e[0] != "advance"]
    assert bounds == [(what, s) for s in STAGES for what in ("start", "finish")]
    current = None
    steps: dict[str, list[tuple]] = {}
    for e in rec.log:
        if e[0] == "start":
            current = e[1]
        elif e[0] == "advance":
            assert e[1] == current  # only the stage running tells how far it is
            steps.setdefault(e[1], []).append(e[2:])
        else:
            assert e[2] >= 0
    for stage, seen in steps.items():
        done = [d for d, _, _ in seen]
        totals = {t for _, t, _ in seen}
        assert done == sorted(done), stage
        assert len(totals) == 1, stage
        total = totals.pop()
        if total is not None:
            pct = [100 * d / total for d in done]
            assert pct == sorted(pct) and pct[-1] == 100, (stage, pct)
    assert {"read", "unwind", "symbolize", "pair"} <= steps.keys()
    assert steps["read"][-1][2] == {"events": summary.events}
    unwind = steps["unwind"]
    assert len(unwind) > 1  # a piece at a time
    assert unwind[-1][2] == {"records": summary.counters["stack_records"],
                             "stacks": summary.stacks}
    assert steps["pair"][-1][2]["buckets"] >= 1


def terminal_run(*args: str) -> tuple[int, str]:
    """`memtrack ARGS` with a pseudo-terminal as its stdout and stderr: its exit status
    and what it wrote there."""
    env = dict(os.environ, COLUMNS="160", LINES="50", TERM="xterm")
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdio is the terminal
        os.execvpe(sys.executable, [sys.executable, "-m", "memtrack.cli", *args], env)
    out = b""
    while True:
        try:
            got = os.read(fd, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not got:
            break
        out += got
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "",
                                                     out.decode(errors="replace"))


def test_terminal_shows_stages_with_counts_and_times(small_synth: Path, tmp_path: Path) -> None:
    status, out = terminal_run("process", str(small_synth), "-o", str(tmp_path / "r.duckdb"),
                               "--cache", "off", "--jobs", "1")
    assert status == 0, out
    done = r"done in \d+\.\d\ds"
    assert re.search(rf"read .*events [\d,]+ {done}", out), out
    assert re.search(rf"unwind .*records [\d,]+ stacks [\d,]+ {done}", out), out
    assert re.search(rf"pair .*buckets \d+ ranges \d+ {done}", out), out
    for stage in STAGES:
        assert re.search(rf"(?:^|\r){stage} +[^\r]*{done}", out, re.M), (stage, out)
    status, quiet = terminal_run("process", str(small_synth), "-o", str(tmp_path / "q.duckdb"),
                                 "--cache", "off", "--jobs", "1", "-q")
    assert status == 0 and "done in" not in quiet, quiet


def test_symbolizer_problems_reach_the_summary(small_synth: Path, tmp_path: Path) -> None:
    """A cache `process` cannot write is a warning and a counter of the run, not lost
    inside the symbolizer."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    summary = process(small_synth, tmp_path / "r.duckdb", cache_dir=blocker / "cache")
    assert summary.counters["symbolize_cache_write_failed"] >= 1
    assert any("cannot write the symbolization cache" in w for w in summary.warnings)
