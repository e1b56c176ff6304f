"""Every heap figure `report` and `diff` print, against valgrind (tests/support/valgrind.py):
calls, bytes allocated, peak and leaked bytes and blocks, per process and in total, for
fixtures captured, processed, reported and compared through the command line: the demo
(one process) and both builds of fixtures/diff/sites.c (a parent and the worker it forks
and execs; the parent holds no block while the worker runs, so the run's peak is the
larger of the two). Temporary allocations and RSS have no valgrind figure: not here."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import pytest
from conftest import build
from support.cli import capture_and_process, cli
from support.valgrind import heap_figures

from memtrack.report.text import exact_bytes, human_bytes, plural

pytestmark = pytest.mark.bpf

FLAGS = ("-O1", "-g")
# process figure -> the report's key (per process, in the totals)
PROCESS_KEYS = {"calls": "calls", "peak": "peak_heap_bytes", "leaked": "leaked_bytes"}
TOTAL_KEYS = {"calls": "calls", "allocated": "allocated_bytes", "leaked": "leaked_bytes",
              "leaked_blocks": "leaked_allocations"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per fixture: its run database and valgrind's figures per command."""
    tmp = tmp_path_factory.mktemp("audit")
    programs = {"demo": build(["demo/demo.c"], flags=FLAGS)}
    for name, flags in (("base", FLAGS), ("head", (*FLAGS, "-DREGRESSION"))):
        d = tmp / f"{name}-bin"
        d.mkdir()
        exe = build(["diff/sites.c"], name=f"sites-{name}", flags=flags)
        for copy in ("sites", "sites-worker"):
            shutil.copy2(exe, d / copy)
        programs[name] = d / "sites"
    out = {}
    for name, exe in programs.items():
        d = tmp / name
        d.mkdir()
        db, _ = capture_and_process([str(exe)], d)
        out[name] = {"db": db, "oracle": heap_figures([str(exe)], d / "vg")}
    return out


def by_process(run: dict[str, Any]) -> dict[int, dict[str, int]]:
    """valgrind's figures for each pid of the run, by its program and arguments."""
    con_out = cli("query", str(run["db"]), "SELECT pid, exe, cmdline FROM processes",
                  "--format", "json")
    out = {}
    for p in json.loads(con_out):
        out[p["pid"]] = run["oracle"][" ".join([p["exe"], *p["cmdline"][1:]])]
    assert len(out) == len(run["oracle"])
    return out


def oracle_totals(run: dict[str, Any]) -> dict[str, int]:
    figures = run["oracle"].values()
    return {**{k: sum(f[k] for f in figures) for k in TOTAL_KEYS},
            "peak": max(f["peak"] for f in figures)}


@pytest.mark.parametrize("name", ["demo", "base", "head"])
def test_report_figures(runs: dict[str, dict[str, Any]], name: str) -> None:
    run = runs[name]
    want = by_process(run)
    data = json.loads(cli("report", str(run["db"]), "--format", "json"))
    got = {p["pid"]: {k: p[key] for k, key in PROCESS_KEYS.items()} for p in data["processes"]}
    assert got == {pid: {k: w[k] for k in PROCESS_KEYS} for pid, w in want.items()}
    total = oracle_totals(run)
    t = data["totals"]
    assert {k: t[key] for k, key in TOTAL_KEYS.items()} == {k: total[k] for k in TOTAL_KEYS}
    assert t["peak_heap_bytes"] == total["peak"]
    # the text report prints the same figures
    text = cli("report", str(run["db"]))
    for line in (f"calls to allocation functions: {total['calls']} (",
                 f"bytes allocated in total: {exact_bytes(total['allocated'])}\n",
                 f"peak heap memory consumption: {exact_bytes(total['peak'])} at ",
                 f"total memory leaked: {exact_bytes(total['leaked'])} in "
                 f"{plural(total['leaked_blocks'], 'allocation')}\n"):
        assert line in text
    if len(want) > 1:
        for pid, w in want.items():
            assert re.search(rf"^ +{pid} .*: {w['calls']} calls, peak heap "
                             rf"{re.escape(human_bytes(w['peak']))}, leaked "
                             rf"{re.escape(human_bytes(w['leaked']))}$", text, re.M), pid


def test_diff_figures(runs: dict[str, dict[str, Any]]) -> None:
    base, head = runs["base"], runs["head"]
    d = json.loads(cli("diff", str(base["db"]), str(head["db"]), "--format", "json"))
    rows = {r["key"]: r for r in d["sections"]["totals"]["rows"]}
    b, h = oracle_totals(base), oracle_totals(head)
    for k, key in {**TOTAL_KEYS, "peak": "peak_heap_bytes"}.items():
        assert (rows[key]["base"], rows[key]["head"], rows[key]["delta"]) == (
            b[k], h[k], h[k] - b[k]), k
    # per process name: each build's figures for that program
    names = {"sites": "", "sites-worker": " worker"}
    procs = {r["name"]: r for r in d["sections"]["processes"]["rows"]}
    assert sorted(procs) == sorted(names)
    for name, args in names.items():
        for side, run in (("base", base), ("head", head)):
            (want,) = [f for c, f in run["oracle"].items() if c.endswith(f"/{name}{args}")]
            got = {k: procs[name][key][side] for k, key in PROCESS_KEYS.items()}
            assert got == {k: want[k] for k in PROCESS_KEYS}, (name, side)
    text = cli("diff", str(base["db"]), str(head["db"]))
    calls = re.search(r"^calls to allocation functions +(\d+) +(\d+) ", text, re.M)
    assert calls and (int(calls[1]), int(calls[2])) == (b["calls"], h["calls"])
    for label, k in (("bytes allocated in total", "allocated"),
                     ("peak heap memory consumption", "peak"),
                     ("total memory leaked", "leaked")):
        line = re.search(rf"^{label} +(.+?) {{2,}}(.+?) {{2,}}", text, re.M)
        assert line and (line[1], line[2]) == (human_bytes(b[k]), human_bytes(h[k])), label
