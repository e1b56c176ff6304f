"""Stacks of any depth: a synthetic run whose make_small is called 509 calls of `work`
deep (a 512-frame stack: the deepest the unwinder walks, `process` writing the run)
through `report` (text, JSON, HTML), the hotspots and backtrace views, and every export.
Frame positions and depths are never packed into a fixed width (a depth * 256 + inline
depth overflowed UINT16 from 256 frames on)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build
from support import pprof
from support.page import browsing, page_data
from support.synth import STACKS, write_run
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.process.unwind import MAX_DEPTH
from memtrack.report.text import MAX_FRAMES

runner = CliRunner()
WORK = 509  # the recursion's frames (with malloc, make_small and main: MAX_DEPTH)
DEEP = {**STACKS, 11: ["malloc", "make_small", *["work"] * WORK, "main"]}
SMALL = 512 + 1000  # what make_small allocates (A and E)
FOLDED = "parent;main;" + "work;" * WORK + "make_small"


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert len(DEEP[11]) == MAX_DEPTH
    return write_run(tmp_path_factory.mktemp("deep") / "run.duckdb", stacks=DEEP)


def invoke(*args: str | Path) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.stdout


def query(run_db: Path, sql: str) -> list[dict[str, Any]]:
    return json.loads(invoke("query", run_db, sql, "--format", "json"))


def test_report_text_and_json(run_db: Path) -> None:
    out = invoke("report", run_db)
    assert "2 calls from make_small (make_small.c:13) in 1 backtrace" in out
    assert f"... {WORK + 2 - MAX_FRAMES} outer frames (--format json has them all)" in out
    d = json.loads(invoke("report", run_db, "--format", "json"))
    (entry,) = [e for e in d["sections"]["calls"] if e["location"] == "make_small"]
    frames = [f["function"] for f in entry["backtraces"][0]["frames"]]
    assert frames == DEEP[11][1:]


def test_hotspots_and_backtrace_views(run_db: Path) -> None:
    rows = {r["function"]: r for r in query(run_db, "SELECT * FROM hotspots")}
    assert (rows["make_small"]["self_calls"], rows["make_small"]["self_bytes"]) == (2, SMALL)
    assert (rows["work"]["self_calls"], rows["work"]["incl_calls"]) == (0, 4)
    assert rows["main"]["incl_calls"] == 6
    (sid,) = {r["stack_id"] for r in query(
        run_db, "SELECT stack_id FROM allocation_sites WHERE location = 'make_small'")}
    lines = query(run_db, f"SELECT position, depth, name FROM stack_lines WHERE stack_id = {sid}"
                          " ORDER BY position")
    assert [(r["position"], r["depth"], r["name"]) for r in lines] == [
        (i, i, n) for i, n in enumerate(DEEP[11])]
    frames = query(run_db, "SELECT depth FROM backtrace_frames WHERE stack_id = "
                           f"{sid} ORDER BY depth")
    assert [r["depth"] for r in frames] == list(range(1, WORK + 3))
    (bt,) = query(run_db, f"SELECT backtrace_id FROM backtraces WHERE stack_id = {sid}")
    assert bt["backtrace_id"] == sid



def test_report_html(run_db: Path, tmp_path: Path) -> None:
    page = tmp_path / "deep.html"
    invoke("report", run_db, "--html", page)
    data = page_data(page)
    nodes = data["flame"]["allocated"]
    assert nodes[0][:2] == ["all", 9684]
    # the deepest node: make_small, under main and every work
    assert max(nodes, key=lambda n: n[2]) == ["make_small", SMALL, WORK + 3]
    assert {h["function"] for h in data["hotspots"]} >= {"make_small", "work", "main"}
    with browsing(page) as b:
        deepest = b.eval("""[...document.querySelectorAll('#flame rect.fg')]
            .map(r => [r.dataset.name, +r.dataset.depth, +r.dataset.value])
            .reduce((a, r) => r[1] > a[1] ? r : a)""")
        assert deepest == ["make_small", WORK + 3, SMALL]


def export(run_db: Path, tmp: Path, fmt: str) -> Path:
    out = tmp / f"deep.{fmt}"
    invoke("export", run_db, "--format", fmt, "-o", out)
    return out


def test_exports(run_db: Path, tmp_path: Path) -> None:
    lines = dict(ln.rsplit(" ", 1) for ln in export(run_db, tmp_path, "folded")
                 .read_text().splitlines())
    assert lines[FOLDED] == str(SMALL)
    prof = pprof.decode(export(run_db, tmp_path, "pprof").read_bytes())
    deep = [(prof.names(locs), values[1]) for locs, values, _ in prof.samples
            if len(locs) > 100]
    assert deep == [(DEEP[11][1:], SMALL)]
    doc = json.loads(export(run_db, tmp_path, "speedscope").read_text())
    names = [f["name"] for f in doc["shared"]["frames"]]
    allocated = doc["profiles"][0]
    stacks = [([names[i] for i in s], w) for s, w in
              zip(allocated["samples"], allocated["weights"], strict=True) if len(s) > 100]
    assert stacks == [(FOLDED.split(";"), SMALL)]


@pytest.mark.bpf
def test_a_capture_300_calls_deep(tmp_path: Path) -> None:
    """fixtures/deep/recurse.c allocates 300 calls deep: through the real command line
    (capture, process, report --html, the hotspots view), its backtrace holds every
    call."""
    exe = build(["deep/recurse.c"], flags=("-O1", "-g"))
    art, db, page = tmp_path / "r.memtrack", tmp_path / "r.duckdb", tmp_path / "r.html"
    for args in (("capture", "-o", art, "--", exe, "300"), ("process", art, "-o", db, "-q"),
                 ("report", db, "--html", page)):
        r = subprocess.run([sys.executable, "-m", "memtrack.cli", *map(str, args)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    d = json.loads(invoke("report", db, "--format", "json"))
    (entry,) = [e for e in d["sections"]["calls"] if e["location"] == "recurse"]
    frames = [f["function"] for f in entry["backtraces"][0]["frames"]]
    assert frames[:301] == ["recurse"] * 301 and "main" in frames
    hot = {r["function"]: r for r in query(db, "SELECT * FROM hotspots")}
    assert hot["recurse"]["self_bytes"] == 4321 and hot["main"]["incl_bytes"] >= 4321
    nodes = page_data(page)["flame"]["allocated"]
    assert sum(n[0] == "recurse" for n in nodes) == 301
