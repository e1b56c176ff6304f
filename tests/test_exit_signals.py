"""How each traced process ended, through the command line (capture, process, report):
children killed by a signal, sent by another process, by themselves (SIGPIPE from a
write, SIGSEGV from a fault, abort) or to a process with a second thread, are reported
killed by that signal in `processes`, the text report and RUN.memory_metadata.json; a
process with two threads that exits with a status reports that status. A fatal
signal that dumps no core reaches every thread as SIGKILL: signal_deliver alone said 9
for all of them."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from conftest import build
from support.cli import capture_and_process, cli

from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf

# two runs: the text report lists at most 20 processes (report.text.MAX_PROCESSES)
SIGNALS = ((1, 2, 9, 13), (15, 6, 11))


def report_status(db: Path) -> dict[int, str]:
    """Each process's status as the text report's PROCESSES lines say it."""
    return {int(p): s for p, s in re.findall(r"^ +(\d+) .* parent \d+, ([^:]+):",
                                             cli("report", str(db)), re.M)}


def statuses(db: Path) -> tuple[dict[int, tuple], dict[int, tuple], dict[int, str]]:
    """Per pid: (exit_code, exit_signal) of `processes`, (code, signal) of the metadata,
    the report's words."""
    con = open_run(db)
    table = {p: (c, s) for p, c, s in con.execute(
        "SELECT pid, exit_code, exit_signal FROM processes").fetchall()}
    con.close()
    meta = json.loads(db.with_name("r.memory_metadata.json").read_text())
    metadata = {p["pid"]: (p["exit_status"]["code"], p["exit_status"]["signal"])
                for p in meta["processes"] if p["exit_status"]}
    return table, metadata, report_status(db)


@pytest.mark.parametrize("signals", SIGNALS, ids=str)
def test_children_killed_by_signals(signals: tuple[int, ...], tmp_path: Path) -> None:
    exe = build(["exit/signals.c"], flags=("-O1", "-g", "-pthread"))
    db, out = capture_and_process([str(exe), *map(str, signals)], tmp_path)
    children = {int(p): (way, int(s)) for way, p, s in re.findall(r"^(\w+) (\d+) (\d+)$", out,
                                                                  re.M)}
    assert len(children) == 3 * len(signals) + 1
    table, metadata, words = statuses(db)
    for pid, (way, sig) in children.items():
        want = (None, sig) if sig else (3, None)
        said = f"signal {sig} ({signal.Signals(sig).name})" if sig else "exit 3"
        assert (table[pid], metadata[pid], words[pid]) == (want, want, said), way


def test_pipeline_sigpipe(tmp_path: Path) -> None:
    """head exits after its first line; sort, writing on, dies of SIGPIPE."""
    db, out = capture_and_process(["bash", "-c", "seq 1 100000 | sort | head -1"], tmp_path)
    assert out == "1\n"
    table, metadata, words = statuses(db)
    con = open_run(db)
    (sort,), = con.execute("SELECT pid FROM processes WHERE name = 'sort'").fetchall()
    con.close()
    assert (table[sort], metadata[sort], words[sort]) == (
        (None, 13), (None, 13), "signal 13 (SIGPIPE)")
