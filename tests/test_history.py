"""`memtrack history --dataset`: 20 synthetic runs of two benchmarks (tests/support/runs.py)
where bench_step's first block grows at run 12: the history names that run, and only
it, for the figures that changed; the noisy figures step only beyond the tolerance; the
runs in label order or by start; text, JSON, markdown; --fail-on-step's status; the
HTML page in headless Chromium (charts, hover, a click to the run's diff, filter and
sort)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.chromium import screens_dir
from support.page import browsing, page_data
from support.runs import (
    BLOCK,
    RUNS,
    SMALL,
    STEADY,
    STEP_BYTES,
    STEP_RUN,
    add_run,
    rss_noise,
    run_id,
    write_bench_dataset,
)
from typer.testing import CliRunner

from memtrack.cli import app

BEFORE = BLOCK + SMALL  # bench_step's bytes (and peak heap) before the step
AFTER = BEFORE + STEP_BYTES


def invoke(*args: str | Path) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("history")
    return write_bench_dataset(d / "ds", d / "scratch")


PAGE_RUNS = 10  # the page's: the last 10 (a diff each but the first, computed)


@pytest.fixture(scope="module")
def page(ds: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The page and the JSON of one invocation, the last PAGE_RUNS runs in commit_time
    order."""
    out = tmp_path_factory.mktemp("page") / "history.html"
    code, text, err = invoke("history", "--dataset", ds, "--order-by", "commit_time",
                             "--format", "json", "--html", out, "--last", str(PAGE_RUNS))
    assert code == 0, err
    return out, json.loads(text)


def expected_steps(at: int, since: int, before: int, after: int) -> list[dict[str, Any]]:
    """The steps of bench_step and of its process as a whole when bench_step's bytes go
    from `before` to `after`, at run `at` since run `since` (1-based)."""
    steady = STEADY
    out = []
    for bench, extra in ((None, steady), ("bench_step", 0)):
        calls = 2 if bench else 3
        for fig, b, a in (("allocated_bytes", before + extra, after + extra),
                          ("average_bytes", (before + extra) / calls, (after + extra) / calls),
                          ("peak_heap_bytes", before, after)):
            out.append({"run": run_id(at), "previous": run_id(since), "process": "bench",
                        "benchmark": bench, "figure": fig, "before": b, "after": a})
    return out


def steps_of(d: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("run", "previous", "process", "benchmark", "figure", "before", "after")
    return [{k: s[k] for k in keys} for s in d["steps"]]


def test_the_step_is_named_by_its_run_and_only_it(ds: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["history", "--dataset", ds, "--order-by", "commit_time", "--format", "json"]
    code, out, _ = invoke(*args)
    assert code == 0
    d = json.loads(out)
    # the figures computed 7 runs at a time are the same
    from memtrack.report import history

    monkeypatch.setattr(history, "RUNS_PER_SESSION", 7)
    assert invoke(*args) == (code, out, "")
    assert [r["run"] for r in d["runs"]] == [run_id(i) for i in range(1, RUNS + 1)]
    assert steps_of(d) == expected_steps(STEP_RUN, STEP_RUN - 1, BEFORE, AFTER)
    assert d["latest"] == {"run": run_id(RUNS), "steps": []}
    series = {(s["process"], s["benchmark"]): s for s in d["series"]}
    assert set(series) == {("bench", None), ("bench", "bench_steady"),
                           ("bench", "bench_step"), ("child", None)}
    step = series[("bench", "bench_step")]
    assert [p["allocated_bytes"] for p in step["points"]] == \
        [BEFORE] * (STEP_RUN - 1) + [AFTER] * (RUNS - STEP_RUN + 1)
    assert {p["calls"] for p in step["points"]} == {2}
    # the RSS of every run differs (by less than the tolerance): no step
    assert [p["peak_rss_bytes"] for p in series[("bench", "bench_steady")]["points"]] == \
        [40960 + rss_noise(i) for i in range(1, RUNS + 1)]
    assert [p["peak_rss_bytes"] for p in step["points"]] == \
        [65536 + rss_noise(i) for i in range(1, RUNS + 1)]
    assert [p["peak_rss_bytes"] for p in series[("child", None)]["points"]] == [None] * RUNS


def test_noisy_figures_step_beyond_the_tolerance(ds: Path) -> None:
    code, out, _ = invoke("history", "--dataset", ds, "--order-by", "commit_time",
                          "--format", "json", "--tolerance", "1")
    d = json.loads(out)
    extra = [s for s in steps_of(d) if s not in expected_steps(STEP_RUN, STEP_RUN - 1,
                                                               BEFORE, AFTER)]
    # bench_steady's RSS (40 KiB + noise) moves by more than 1% where the noise
    # changes by 512 bytes or more; the 64 KiB figures never do
    want = [i for i in range(2, RUNS + 1)
            if abs(rss_noise(i) - rss_noise(i - 1)) > 0.01 * (40960 + rss_noise(i - 1))]
    assert want and [s["run"] for s in extra] == [run_id(i) for i in want]
    assert {(s["benchmark"], s["figure"]) for s in extra} == {("bench_steady",
                                                               "peak_rss_bytes")}


def test_runs_by_start_time_and_the_last_ones(ds: Path) -> None:
    # the runs started in the reverse of their commit_time order: the step is the
    # other way round, at run 11 since run 12
    code, out, _ = invoke("history", "--dataset", ds, "--format", "json")
    d = json.loads(out)
    assert [r["run"] for r in d["runs"]] == [run_id(i) for i in range(RUNS, 0, -1)]
    assert steps_of(d) == expected_steps(STEP_RUN - 1, STEP_RUN, AFTER, BEFORE)
    code, out, _ = invoke("history", "--dataset", ds, "--format", "json", "--order-by",
                          "commit_time", "--last", "3")
    d = json.loads(out)
    assert [r["run"] for r in d["runs"]] == [run_id(i) for i in (18, 19, 20)]
    assert d["steps"] == []


def test_text_and_markdown(ds: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, text, _ = invoke("history", "--dataset", ds, "--order-by", "commit_time")
    assert code == 0
    lines = text.splitlines()
    assert lines[0] == (f"{ds}: 20 runs by label commit_time ({run_id(1)} ... {run_id(20)}), "
                        "4 series, 6 steps")
    i = lines.index("STEPS")
    at = f"{run_id(STEP_RUN)} (commit_time={900 + 10 * STEP_RUN})"
    assert lines[i + 1:i + 7] == [
        f"{at}: (whole process) [bench] bytes allocated 1.75 KiB -> 2.75 KiB (+1.00 KiB, "
        f"+57.1%) since {run_id(STEP_RUN - 1)}",
        f"{at}: (whole process) [bench] average size 597.3 B -> 938.7 B (+341.3 B, +57.1%) "
        f"since {run_id(STEP_RUN - 1)}",
        f"{at}: (whole process) [bench] peak heap 1.25 KiB -> 2.25 KiB (+1.00 KiB, +80.0%) "
        f"since {run_id(STEP_RUN - 1)}",
        f"{at}: bench_step [bench] bytes allocated 1.25 KiB -> 2.25 KiB (+1.00 KiB, +80.0%) "
        f"since {run_id(STEP_RUN - 1)}",
        f"{at}: bench_step [bench] average size 640 B -> 1.12 KiB (+512 B, +80.0%) "
        f"since {run_id(STEP_RUN - 1)}",
        f"{at}: bench_step [bench] peak heap 1.25 KiB -> 2.25 KiB (+1.00 KiB, +80.0%) "
        f"since {run_id(STEP_RUN - 1)}"]
    assert lines[-1] == f"latest run {run_id(20)} (commit_time=1100): no step"
    row = next(ln for ln in lines if ln.startswith("bench_step "))
    assert row.split() == ["bench_step", "bench", "20", "2", "2.25", "KiB", "1.12", "KiB",
                           "0", "B", "2.25", "KiB", "64.25", "KiB", "3"]
    code, md, _ = invoke("history", "--dataset", ds, "--order-by", "commit_time",
                         "--format", "markdown")
    assert code == 0
    assert f":white_check_mark: latest run `{run_id(20)} (commit_time=1100)`: no step" in md
    assert (f"| `{at}` | `bench_step` | `bench` | bytes allocated 1.25 KiB -> 2.25 KiB "
            f"(+1.00 KiB, +80.0%) | `{run_id(STEP_RUN - 1)}` |") in md.splitlines()
    assert sum(ln.startswith(f"| `{run_id(STEP_RUN)}") for ln in md.splitlines()) == 6
    # cut at a line to fit a comment
    from memtrack.report import history

    monkeypatch.setattr(history, "MD_LIMIT", 800)
    code, cut, _ = invoke("history", "--dataset", ds, "--order-by", "commit_time",
                          "--format", "markdown")
    body, note = cut.rsplit("\n\n", 1)
    assert note == "(cut to fit a comment: --format text has it all)\n"
    assert len(body) <= 800 and md.startswith(body + "\n")


def test_fail_on_step(ds: Path, tmp_path: Path) -> None:
    code, _, _ = invoke("history", "--dataset", ds, "--order-by", "commit_time",
                        "--last", "3", "--fail-on-step")
    assert code == 0
    # run 21 goes back to the old block: the latest run stepped
    grown = tmp_path / "ds"
    shutil.copytree(ds, grown)
    add_run(grown, tmp_path / "scratch", RUNS + 1, BLOCK)
    args = ["history", "--dataset", grown, "--order-by", "commit_time", "--last", "3"]
    code, out, _ = invoke(*args, "--format", "json")
    assert code == 0
    latest = json.loads(out)["latest"]
    assert latest["run"] == run_id(RUNS + 1)
    assert steps_of({"steps": latest["steps"]}) == expected_steps(RUNS + 1, RUNS, AFTER, BEFORE)
    code, out, _ = invoke(*args, "--fail-on-step")
    assert code == 1
    assert out.splitlines()[-1] == f"latest run {run_id(RUNS + 1)} (commit_time=1110): 6 steps"
    assert "LOST DATA" not in out
    # run 22 lost events: it and run 23 after it do not compare (3, as diff's gate)
    add_run(grown, tmp_path / "scratch", RUNS + 2, BLOCK, {"events_ring_full": 5,
                                                            "stack_copies_cut": 2})
    code, out, _ = invoke(*args, "--fail-on-step")
    assert code == 3
    lines = out.splitlines()
    i = lines.index("RUNS THAT LOST DATA (their figures fall short of what ran)")
    assert lines[i + 1:i + 3] == [f"{run_id(RUNS + 2)}: events_ring_full 5", ""]
    code, out, _ = invoke(*args, "--format", "json")
    assert [r["lost"] for r in json.loads(out)["runs"]] == [{}, {}, {"events_ring_full": 5}]
    add_run(grown, tmp_path / "scratch", RUNS + 3, BLOCK)
    assert invoke(*args, "--fail-on-step")[0] == 3
    add_run(grown, tmp_path / "scratch", RUNS + 4, BLOCK)
    assert invoke(*args, "--fail-on-step")[0] == 0


@pytest.mark.parametrize("extra,message", [
    (["--order-by", "branch"], "--order-by branch: 20 runs without that label ("),
    (["--tolerance", "-1"], "--tolerance: expected 0 to"),
    (["--last", "0"], "--last: expected 1 to"),
    (["--format", "csv"], "--format: expected text, json or markdown, got 'csv'"),
])
def test_errors_are_one_line(ds: Path, extra: list[str], message: str) -> None:
    code, _, err = invoke("history", "--dataset", ds, *extra)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_not_a_dataset(tmp_path: Path) -> None:
    code, _, err = invoke("history", "--dataset", tmp_path)
    assert code == 2 and "not a memtrack dataset" in err and err.count("\n") == 1


def recent_change(base: int) -> float:
    """The largest relative change of a figure of `base` bytes plus the RSS noise over
    the last five runs."""
    return max(abs(rss_noise(i) - rss_noise(i - 1)) / (base + rss_noise(i - 1))
               for i in range(RUNS - 4, RUNS + 1))


def test_page(page: tuple[Path, dict[str, Any]]) -> None:
    out, d = page
    first = RUNS - PAGE_RUNS + 1
    assert [r["run"] for r in d["runs"]] == [run_id(i) for i in range(first, RUNS + 1)]
    assert steps_of(d) == expected_steps(STEP_RUN, STEP_RUN - 1, BEFORE, AFTER)
    data = page_data(out)
    assert data["steps"] == d["steps"] and data["series"] == d["series"]
    # every run's diff against its predecessor is in the page, as `diff` prints it
    assert sorted(data["diffs"]) == sorted(run_id(i) for i in range(first + 1, RUNS + 1))
    diff = data["diffs"][run_id(STEP_RUN)]
    assert diff.startswith(f"base: run {run_id(STEP_RUN - 1)}  [commit={run_id(STEP_RUN - 1)}")
    code, text, _ = invoke("diff", "--dataset", Path(d["dataset"]), run_id(STEP_RUN - 1),
                           run_id(STEP_RUN))
    assert diff == text
    changes = {s["benchmark"]: s["recent_change"] for s in d["series"] if s["process"] == "bench"}
    assert changes == {"bench_steady": pytest.approx(recent_change(40960)),
                       "bench_step": pytest.approx(recent_change(65536)),
                       None: pytest.approx(recent_change(65536))}

    screens = screens_dir() / "history"
    with browsing(out) as b:
        cards = b.eval("[...document.querySelectorAll('.series')].map(c => c.dataset.name)")
        assert cards == ["(whole process) [bench]", "bench_steady [bench]",
                         "bench_step [bench]", "(whole process) [child]"]
        # four charts per series, a point per run, the steps marked on theirs
        charts = b.eval("""[...document.querySelectorAll('.series')].map(c =>
            [...c.querySelectorAll('svg.chart')].map(s => [s.dataset.figure,
                s.querySelectorAll('circle').length,
                [...s.querySelectorAll('circle.step')].map(e => e.dataset.run)]))""")
        stepped = [run_id(STEP_RUN)]
        n = PAGE_RUNS
        assert charts[2] == [["peak_heap_bytes", n, stepped], ["allocated_bytes", n, stepped],
                             ["calls", n, []], ["average_bytes", n, stepped]]
        assert charts[1] == [[f, n, []] for f in ("peak_heap_bytes", "allocated_bytes",
                                                      "calls", "average_bytes")]
        assert b.eval("document.querySelectorAll('polyline.line').length") == 16
        b.screenshot(screens / "page.png")
        # hover on the step: the run, its labels, the figure and the step
        sel = ".series:nth-of-type(3) svg[data-figure=allocated_bytes] circle.step"
        b.mouse(*b.point(sel))
        tip = b.eval("document.getElementById('tip').textContent")
        assert tip.splitlines() == [
            f"run {run_id(STEP_RUN)} ({STEP_RUN - first + 1} of {PAGE_RUNS})",
            f"commit={run_id(STEP_RUN)}",
            f"commit_time={900 + 10 * STEP_RUN}", tip.splitlines()[3],
            "bytes allocated: 2.25 KiB", f"STEP since run {run_id(STEP_RUN - 1)}",
            "(click: its diff)"]
        assert tip.splitlines()[3].startswith("started ")
        b.screenshot(screens / "hover.png", ".series:nth-of-type(3)")
        # a click opens that run's diff against its predecessor
        b.mouse(*b.point(sel), "click")
        assert b.eval("document.getElementById('diff').dataset.run") == run_id(STEP_RUN)
        assert b.eval("document.getElementById('diff-title').textContent") == \
            f"memtrack diff: run {run_id(STEP_RUN - 1)} -> run {run_id(STEP_RUN)}"
        assert b.eval("document.getElementById('diff-text').textContent") == diff
        b.screenshot(screens / "diff.png")
        b.mouse(*b.point("#diff-close"), "click")
        assert b.eval("document.getElementById('diff').classList.contains('open')") is False
        # filter by name, sort by the largest recent change
        b.mouse(*b.point("#filter"), "click")
        b.type("step")
        assert b.eval("document.getElementById('shown').textContent") == "1 of 4 series"
        b.eval("(() => { const f = document.getElementById('filter'); f.value = '';"
               " f.dispatchEvent(new Event('input'));"
               " const s = document.getElementById('sort'); s.value = 'change';"
               " s.dispatchEvent(new Event('change')); })()")
        shown = b.eval("[...document.querySelectorAll('.series')].filter(c => "
                       "c.style.display !== 'none').map(c => c.dataset.name)")
        assert shown == ["bench_steady [bench]", "(whole process) [bench]",
                         "bench_step [bench]", "(whole process) [child]"]
        b.screenshot(screens / "sorted.png")


def test_figures_are_the_reports(ds: Path, tmp_path: Path) -> None:
    """Each series' figures in a run are those the run reader gives that run (its
    processes of that name, its regions of that name): here for runs of the bench
    dataset and the synthetic run of forks, threads, reallocs and leaks."""
    from support.synth import write_run

    from memtrack.process.dataset import append_run
    from memtrack.report.history import FIGURES
    from memtrack.report.reader import RunReader
    from memtrack.report.regions import RegionReader
    from memtrack.schema.dataset import open_dataset_run

    mixed = tmp_path / "ds"
    shutil.copytree(ds, mixed)
    append_run(mixed, "synth", write_run(tmp_path / "synth.duckdb"))
    code, out, _ = invoke("history", "--dataset", mixed, "--format", "json")
    assert code == 0
    got = {(s["process"], s["benchmark"], p["run"]): {k: p[k] for k in FIGURES}
           for s in json.loads(out)["series"] for p in s["points"]}
    for run in (run_id(1), run_id(STEP_RUN), "synth"):
        con = open_dataset_run(mixed, run)
        whole = RunReader(con)
        want = {}
        for name in {p["name"] for p in whole.processes()}:
            pids = whole.pids_named(name)
            procs = [p for p in whole.processes() if p["name"] == name]
            totals = RunReader(con, pids).totals()
            calls, allocated = totals["calls"], totals["allocated_bytes"]
            rss = [p["peak_rss_bytes"] for p in procs if p["peak_rss_bytes"] is not None]
            want[(name, None, run)] = {
                "calls": calls, "allocated_bytes": allocated,
                "average_bytes": allocated / calls if calls else 0.0,
                "leaked_bytes": sum(p["leaked_bytes"] for p in procs),
                "peak_heap_bytes": max(p["peak_heap_bytes"] for p in procs),
                "peak_rss_bytes": max(rss) if rss else None}
            for bench, r in RegionReader(RunReader(con, pids)).by_name().items():
                want[(name, bench, run)] = {
                    "calls": r["calls"], "allocated_bytes": r["allocated_bytes"],
                    "average_bytes": r["allocated_bytes"] / r["calls"] if r["calls"] else 0.0,
                    "leaked_bytes": r["leaked_bytes"], "peak_heap_bytes": r["peak_heap_bytes"],
                    "peak_rss_bytes": r["peak_rss_bytes"]}
        con.close()
        assert {k: v for k, v in got.items() if k[2] == run} == want, run
    assert got[("parent", None, "synth")]["leaked_bytes"] > 0
