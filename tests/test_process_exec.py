"""A shell pipeline through the command line (capture, process, report): each command
a forked and exec'd child of bash. What a child holds before its exec (its copies of
bash's heap, what bash's code allocated in it) ends at the exec and is none of its
figures: each command's calls, bytes allocated, peak and leaks are valgrind's for it,
and the run's totals are the sums of its processes'. bash itself is left out of the
comparison: its heap depends on the environment, which valgrind's and memtrack's
differ in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import capture_and_process, cli
from support.valgrind import heap_figures

from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf

PIPELINE = ["bash", "-c", "seq 1 1000 | sort | head -3"]


def test_pipeline_commands_match_valgrind(tmp_path: Path) -> None:
    db, _ = capture_and_process(PIPELINE, tmp_path)
    con = open_run(db)
    commands = dict(con.execute(
        "SELECT pid, array_to_string(list_prepend(exe, cmdline[2:]), ' ') FROM processes "
        "WHERE name != 'bash'").fetchall())
    allocated = dict(con.execute(
        "SELECT pid, sum(bytes) FROM stack_costs GROUP BY pid").fetchall())
    con.close()
    data = json.loads(cli("report", str(db), "--format", "json"))
    got = {commands[p["pid"]]: {"calls": p["calls"], "allocated": allocated[p["pid"]],
                                "leaked": p["leaked_bytes"], "peak": p["peak_heap_bytes"]}
           for p in data["processes"] if p["pid"] in commands}
    want = heap_figures(PIPELINE, tmp_path / "valgrind")
    assert sorted(got) == ["/usr/bin/head -3", "/usr/bin/seq 1 1000", "/usr/bin/sort"]
    assert got == {c: {k: want[c][k] for k in got[c]} for c in got}
    t = data["totals"]
    assert t["calls"] == sum(p["calls"] for p in data["processes"])
    assert t["leaked_bytes"] == sum(p["leaked_bytes"] for p in data["processes"])
