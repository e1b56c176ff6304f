"""The report, the pprof export and the HTML page of a real capture (fixtures/report/sites.c)
agree with the program and with each other: sites at heaptrack's granularity (one per
line of `worker`), a stack cut at the copy ending in [truncated], `go tool pprof -top`
and `-traces` giving the report's figures, and the page in headless Chromium showing the
fixture's call tree (screenshots in /tmp/memtrack-screens/sites, or $MEMTRACK_SCREENS)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, build
from support import pprof
from support.chromium import CHROMIUM, Browser, screens_dir

pytestmark = pytest.mark.bpf

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
SOURCE = FIXTURES / "report" / "sites.c"
THREADS, LOOPS = 2, 1000


def marker_lines() -> dict[str, int]:
    return {m[1]: i for i, ln in enumerate(SOURCE.read_text().splitlines(), 1)
            if (m := re.search(r"/\* site: (\w+) \*/", ln))}


def memtrack(*args: str | Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*MEMTRACK, *map(str, args)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    exe = build(["report/sites.c"], flags=("-O1", "-g", "-fomit-frame-pointer"),
                libs=("-lpthread",))
    d = tmp_path_factory.mktemp("sites")
    memtrack("capture", "-o", d / "s.memtrack", "--rss", "off", "--", exe)
    memtrack("process", d / "s.memtrack", "-o", d / "s.duckdb", "-q")
    report = json.loads(memtrack("report", d / "s.duckdb", "--format", "json", "--top",
                                 "50").stdout)
    return {"dir": d, "db": d / "s.duckdb", "report": report}


def sites(report: dict[str, Any], section: str) -> dict[tuple[str, int], dict[str, Any]]:
    return {(e["location"], e["line"]): e for e in report["sections"][section]
            if e["file"] and Path(e["file"]).name == "sites.c"}


def test_sites_at_heaptrack_granularity(run: dict[str, Any]) -> None:
    line = marker_lines()
    calls = sites(run["report"], "calls")
    assert {k: e["value"] for k, e in calls.items()} == {
        ("worker", line["malloc"]): THREADS * LOOPS,
        ("worker", line["realloc"]): THREADS * LOOPS,
        ("worker", line["calloc"]): THREADS,
        ("deep", line["deep"]): 1,
    }
    for (fn, _), e in calls.items():  # each site's backtraces start at its own line
        for bt in e["backtraces"]:
            assert (bt["frames"][0]["function"], bt["frames"][0]["line"]) == (fn, _)
    leaks = sites(run["report"], "leaks")
    assert list(leaks) == [("deep", line["deep"])] and leaks[("deep", line["deep"])][
        "value"] == 777


def test_a_stack_cut_at_the_copy_ends_in_truncated(run: dict[str, Any]) -> None:
    line = marker_lines()
    (bt,) = sites(run["report"], "leaks")[("deep", line["deep"])]["backtraces"]
    names = [f["function"] for f in bt["frames"]]
    assert names[-1] == "[truncated]" and "main" not in names
    assert set(names[:-1]) == {"deep"} and len(names) > 20


@pytest.mark.skipif(pprof.GO is None, reason="golang-go missing: run scripts/setup")
def test_go_tool_pprof_top_and_traces_match_the_report(run: dict[str, Any]) -> None:
    out = run["dir"] / "s.pb.gz"
    memtrack("export", run["db"], "--format", "pprof", "-o", out)
    report = run["report"]
    head, _ = pprof.top(out, "alloc_space")
    assert head.startswith("File: sites-")
    assert f"of {report['totals']['allocated_bytes']}B total" in head
    for section, sample_type in (("calls", "alloc_objects"), ("leaks", "leaked_space"),
                                 ("temporary", "temporary_objects")):
        _, flat = pprof.top(out, sample_type, lines=True)
        want = {f"{e['location']} {os.path.normpath(e['file'])}:{e['line']}": e["value"]
                for e in report["sections"][section]}  # pprof shows paths cleaned
        got: dict[str, int] = {}
        for k, v in flat.items():  # a site inlined into its caller is marked so
            if v:
                key = k.removesuffix(" (inline)")
                got[key] = got.get(key, 0) + v
        assert got == want, section
    # -traces: the worker's calls under the thread's start, the cut stack ending in
    # [truncated], each with the report's value
    line = marker_lines()
    traces = pprof.traces(out, "alloc_objects")
    worker = {}
    for _, value, frames in traces:
        if frames[0].startswith("worker"):
            assert frames[1:] == ["start_thread", "clone3"], frames
            worker[frames[0]] = worker.get(frames[0], 0) + value
    assert worker == {"worker": THREADS * (2 * LOOPS + 1)}  # -traces shows functions
    (deep,) = [(v, f) for _, v, f in pprof.traces(out, "leaked_space") if f[0] == "deep"]
    assert deep[0] == 777 and deep[1][-1] == "[truncated]"
    _, flat = pprof.top(out, "alloc_objects", lines=True)
    assert flat[f"worker {SOURCE}:{line['realloc']}"] == THREADS * LOOPS


@pytest.mark.skipif(CHROMIUM is None, reason="chromium missing: run scripts/setup")
def test_html_views_show_the_call_tree(run: dict[str, Any]) -> None:
    page = run["dir"] / "s.html"
    memtrack("report", run["db"], "--html", page)
    screens = screens_dir() / "sites"
    b = Browser(1280, 900)
    try:
        b.open(page.as_uri() + "#metric=calls")
        assert b.eval("document.body.dataset.status") == "ok"
        rects = b.eval("""[...document.querySelectorAll('#flame rect.fg')].map(r =>
            [r.dataset.name, +r.dataset.depth, +r.dataset.value])""")
        proc = run["report"]["processes"][0]
        assert proc["name"].startswith("sites-")  # the built fixture's name
        assert rects[0] == ["all", 0, run["report"]["totals"]["calls"]]
        assert [f"{proc['name']} ({proc['pid']})", 1, run["report"]["totals"]["calls"]] in rects
        # the threads' tree: clone3 > start_thread > worker, all of worker's calls
        assert ["worker", 4, THREADS * (2 * LOOPS + 1)] in rects
        assert ["start_thread", 3, THREADS * (2 * LOOPS + 1)] in rects
        b.screenshot(screens / "flame-calls.png", "#flame")
        # the leak's backtrace, cut at the copy, ends in [truncated]
        rows = "table[data-section=leaks] tr"
        i = b.eval(f"""[...document.querySelectorAll('{rows}.site')]
            .findIndex(r => r.children[1].textContent === 'deep')""")
        b.mouse(*b.point(f"{rows}.site:nth-of-type({2 * i + 2}) .toggle"), "click")
        frames = b.eval(f"""[...document.querySelectorAll('{rows}.bt')][{i}]
            .querySelectorAll('li')""" + ".length")
        last = b.eval(f"""[...[...document.querySelectorAll('{rows}.bt')][{i}]
            .querySelectorAll('li')].pop().textContent""")
        assert frames > 20 and last == "[truncated]"
        b.screenshot(screens / "tables.png", "#tables")
        # search: the worker's sites, and the share of the calls they made
        b.mouse(*b.point("#search"), "click")
        b.type("worker")
        shown = b.eval("""[...document.querySelectorAll('table[data-section=calls] tr.site')]
            .filter(r => !r.classList.contains('hidden')).map(r => r.children[2].textContent)""")
        line = marker_lines()
        assert sorted(shown) == sorted(f"{SOURCE}:{line[k]}"
                                       for k in ("malloc", "realloc", "calloc"))
        share = 100 * THREADS * (2 * LOOPS + 1) / run["report"]["totals"]["calls"]
        assert b.eval("document.getElementById('matched').textContent") == (
            f"matched {share:.1f}% of calls")
        b.eval("window.scrollTo(0, 0)")
        b.screenshot(screens / "search.png")
        assert b.console == []
    finally:
        b.close()
