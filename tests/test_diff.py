"""`memtrack diff` and the run dataset on real captures: two builds of fixtures/diff/sites.c
that differ in one function's allocations (-DREGRESSION), and a second capture of the
base build. The diff names that function first with its exact deltas in every metric,
matches the unchanged function across builds although its addresses and lines moved,
and the gate fails the regression and passes the rerun; three runs in one dataset
queried together (DuckDB, and pyarrow.dataset as a second engine) give each run's own
report totals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pytest
from conftest import build
from support.capture import spawn
from typer.testing import CliRunner

from memtrack.capture.options import CaptureOptions
from memtrack.cli import app
from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf

runner = CliRunner()
FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer")
# fixtures/diff/sites.c, by construction: base and -DREGRESSION
TOTALS = {
    "base": {"calls": 190, "allocated_bytes": 25600, "temporary": 30,
             "peak_heap_bytes": 14400, "leaked_bytes": 128, "leaked_allocations": 2},
    "head": {"calls": 240, "allocated_bytes": 33600, "temporary": 30,
             "peak_heap_bytes": 22400, "leaked_bytes": 480, "leaked_allocations": 5},
}
# index_items per metric, base -> head
INDEX_ITEMS = {"allocated": (6400, 14400), "calls": (100, 150), "peak": (6400, 14400),
               "leaked": (128, 480)}
STEADY = {"allocated": 30 * 32 + 40 * 200, "calls": 70, "peak": 8000, "temporary": 30}


def invoke(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """base, rerun (the base build captured again) and head, each processed into its own
    database and appended to one dataset (the rerun only there and in a database
    written apart, to check both ways)."""
    from memtrack.capture.tracker import Tracker

    tmp = tmp_path_factory.mktemp("diff")
    # each build under the same name, as a project's binary is from one commit to the
    # next (the process name is its comm), with the worker the program starts beside it
    programs = {}
    for build_name, flags in (("base", FLAGS), ("head", (*FLAGS, "-DREGRESSION"))):
        exe = build(["diff/sites.c"], name=f"sites-{build_name}", flags=flags)
        d = tmp / build_name
        d.mkdir()
        for name in ("sites", "sites-worker"):
            shutil.copy2(exe, d / name)
        programs[build_name] = d / "sites"
    dataset = tmp / "dataset"
    out: dict[str, Any] = {"dataset": dataset, "programs": programs}
    with Tracker(CaptureOptions(stacks=True, rss=True)) as t:
        for run_id, build_name, commit in (("base", "base", "c0ffee1"),
                                           ("rerun", "base", "c0ffee1"),
                                           ("head", "head", "d00d002")):
            art = tmp / f"{run_id}.memtrack"
            result = spawn(t, [str(programs[build_name])], art, tmp / "stdout", timeout=120)
            assert result.status == 0 and result.nonzero_losses() == {}
            db = tmp / f"{run_id}.duckdb"
            args = ["process", str(art), "-q", "--dataset", str(dataset), "--run-id", run_id,
                    "--label", f"commit={commit}", "--label", f"build={build_name}"]
            if run_id == "rerun":
                code, _, err = invoke(*args)  # the dataset only
                assert code == 0, err
                code, _, err = invoke("process", str(art), "-q", "-o", str(db))
            else:
                code, _, err = invoke(*args, "-o", str(db))
            assert code == 0, err
            out[run_id] = db
    return out


def diff_json(*args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = invoke("diff", *args, "--format", "json")
    assert code in (0, 1), err
    return code, json.loads(out)


def test_builds_differ_where_the_unchanged_function_is(runs: dict[str, Any]) -> None:
    """The premise of matching by call path: steady() has other addresses and lines in
    the two builds, and the executables other build ids."""
    def steady(db: Path) -> tuple:
        con = open_run(db)
        return con.execute("""
            SELECT DISTINCT l.line, sf.lookup_vaddr, m.build_id FROM stack_location l
            JOIN stack_frames sf USING (stack_id, frame_id)
            JOIN modules m ON m.module_id = l.module_id
            WHERE l.name = 'steady' AND sf.depth = 1 ORDER BY 1""").fetchall()

    base, head = steady(runs["base"]), steady(runs["head"])
    assert len(base) == len(head) == 2  # its two malloc calls
    assert {r[0] for r in base}.isdisjoint({r[0] for r in head})
    assert {r[1] for r in base}.isdisjoint({r[1] for r in head})
    assert {r[2] for r in base}.isdisjoint({r[2] for r in head})


def test_diff_names_the_changed_function_first(runs: dict[str, Any]) -> None:
    code, d = diff_json(str(runs["base"]), str(runs["head"]))
    assert code == 0  # no gate asked for
    totals = {r["key"]: r for r in d["sections"]["totals"]["rows"]}
    for key, base in TOTALS["base"].items():
        head = TOTALS["head"][key]
        assert (totals[key]["base"], totals[key]["head"], totals[key]["delta"]) == (
            base, head, head - base), key
    assert totals["peak_heap_bytes"]["relative"] == pytest.approx(8000 / 14400)
    sites = d["sections"]["sites"]
    # every site matched across the builds: none only in one run
    assert (sites["matched"], sites["head_only"], sites["base_only"]) == (3, 0, 0)
    for metric, (base, head) in INDEX_ITEMS.items():
        sec = sites["metrics"][metric]
        first = sec["matched"]["sites"][0]
        assert (first["location"], first["file"]) == ("index_items", "sites.c"), metric
        assert (first["base"], first["head"], first["delta"]) == (base, head, head - base)
        assert first["relative"] == pytest.approx((head - base) / base)
        # the only change; steady (and the worker's job) unchanged
        assert sec["matched"]["count"] == 1 and len(sec["matched"]["sites"]) == 1
        assert sec["head_only"]["count"] == sec["base_only"]["count"] == 0
        (bt,) = first["backtraces"]
        assert (bt["base"], bt["head"]) == (base, head)
        names = [f["function"] for f in bt["frames"]]
        assert names[:2] == ["index_items", "main"] and "_start" in names
        assert bt["frames"][0]["file"].endswith("sites.c")
    assert sites["metrics"]["allocated"]["unchanged"] == 2  # steady, worker_job
    assert sites["metrics"]["leaked"]["unchanged"] == 0  # index_items leaks in both
    temporary = sites["metrics"]["temporary"]
    assert temporary["matched"]["sites"] == [] and temporary["unchanged"] == 1  # steady
    # processes matched by name: the worker unchanged, the program's own figures moved
    procs = {r["name"]: r for r in d["sections"]["processes"]["rows"]}
    assert procs["sites-worker"]["calls"] == {"base": 20, "head": 20, "delta": 0,
                                              "relative": 0.0}
    assert procs["sites"]["calls"]["delta"] == 50
    assert d["base"]["labels"] == {"commit": "c0ffee1", "build": "base"}


def test_diff_text_and_markdown(runs: dict[str, Any]) -> None:
    code, out, _ = invoke("diff", str(runs["base"]), str(runs["head"]), "--metric", "allocated")
    assert code == 0
    lines = out.splitlines()
    total = next(line for line in lines if line.startswith("bytes allocated in total"))
    assert " ".join(total.split()[-7:]) == "25.00 KiB 32.81 KiB +7.81 KiB (+31.2%)"
    i = lines.index("BYTES ALLOCATED: 1 changed, 2 unchanged, 0 only in head, 0 only in base")
    assert lines[i + 1] == ("+7.81 KiB (+125.0%): 6.25 KiB -> 14.06 KiB from "
                            "index_items (sites.c)")
    assert lines[i + 2] == "    +7.81 KiB (+125.0%) from:"
    assert lines[i + 3].split()[0] == "index_items" and lines[i + 4].split()[0] == "main"
    assert "CALLS TO ALLOCATION FUNCTIONS" not in out  # --metric chose one section
    code, md, _ = invoke("diff", str(runs["base"]), str(runs["head"]), "--format", "markdown",
                         "--fail-above", "5")
    assert code == 1
    assert md.startswith("### memtrack diff\n")
    assert ("| bytes allocated in total | 25.00 KiB | 32.81 KiB | +7.81 KiB (+31.2%) |") in md
    assert "| +7.81 KiB (+125.0%) | 6.25 KiB | 14.06 KiB | `index_items` (sites.c) |" in md
    assert (":x: gate: FAILED (more than 5%): peak heap memory consumption +7.81 KiB "
            "(+55.6%)") in md
    assert md.count("```") % 2 == 0 and md.count("<details>") == md.count("</details>") == 4


def test_gate_fails_the_regression_and_passes_reruns(runs: dict[str, Any]) -> None:
    base, head, rerun = str(runs["base"]), str(runs["head"]), str(runs["rerun"])
    code, d = diff_json(base, head, "--fail-above", "10")
    assert code == 1 and d["gate"]["failed"]
    assert {c["metric"]: c["failed"] for c in d["gate"]["checks"]} == {
        "peak": True, "allocated": True, "leaked": True}
    # each gated total on its own: what did not grow, or grew less, passes
    assert diff_json(base, head, "--fail-above", "10", "--fail-on", "temporary")[0] == 0
    assert diff_json(base, head, "--fail-above", "40", "--fail-on", "allocated")[0] == 0
    assert diff_json(base, head, "--fail-above", "40", "--fail-on", "allocated,peak")[0] == 1
    assert diff_json(base, head, "--fail-above", "300", "--fail-on", "leaked")[0] == 0
    # the fix (head -> base) only shrinks
    assert diff_json(head, base, "--fail-above", "0")[0] == 0
    # an identical rerun and the run itself: no change anywhere on the heap, gate passes
    for other in (rerun, base):
        code, d = diff_json(base, other, "--fail-above", "0")
        assert code == 0 and not d["gate"]["failed"]
        rows = {r["key"]: r for r in d["sections"]["totals"]["rows"]}
        assert all(rows[k]["delta"] == 0 for k in TOTALS["base"]), rows
        sites = d["sections"]["sites"]
        assert (sites["matched"], sites["head_only"], sites["base_only"]) == (3, 0, 0)
        for sec in sites["metrics"].values():
            assert all(sec[k]["sites"] == [] for k in ("matched", "head_only", "base_only"))
    # through the installed command line, as a CI job runs it
    memtrack = Path(sys.executable).with_name("memtrack")
    r = subprocess.run([str(memtrack), "diff", base, head, "--fail-above", "10"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr == ""
    assert r.stdout.splitlines()[-1].startswith("gate: FAILED (more than 10%): peak heap")
    r = subprocess.run([str(memtrack), "diff", base, rerun, "--fail-above", "10"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert r.stdout.splitlines()[-1] == (
        "gate: passed (none of peak, allocated, leaked grew by more than 10%)")


def test_gate_refuses_to_compare_a_run_that_lost_data(runs: dict[str, Any],
                                                       tmp_path: Path) -> None:
    """A run whose capture lost events cannot be compared, whatever its figures say:
    the gate exits 3 (not 1: nothing is known to have grown) and says why, on either
    side; a note that is not a loss (a cut stack copy) changes nothing."""
    lossy = tmp_path / "lossy.duckdb"
    shutil.copy(runs["rerun"], lossy)
    con = duckdb.connect(str(lossy))
    con.execute("UPDATE meta SET value = ? WHERE key = 'losses'",
                [json.dumps({"events_ring_full": 4, "stack_copies_cut": 2})])
    con.close()
    base = str(runs["base"])
    for a, b, side in ((base, str(lossy), "head"), (str(lossy), base, "base")):
        code, out, _ = invoke("diff", a, b, "--fail-above", "10")
        assert code == 3, out
        assert f"NOT COMPARABLE: {side} lost data: events_ring_full 4" in out
        assert "stack_copies_cut" not in out.split("NOT COMPARABLE")[1].splitlines()[0]
        code, d = diff_json(a, b)  # no gate: the figures, and the warning in the data
        assert code == 0 and d["trust"]["trusted"] is False
    con = duckdb.connect(str(lossy))
    con.execute("UPDATE meta SET value = ? WHERE key = 'losses'",
                [json.dumps({"stack_copies_cut": 2})])
    con.close()
    assert invoke("diff", base, str(lossy), "--fail-above", "0")[0] == 0


def test_diff_selects_processes(runs: dict[str, Any]) -> None:
    base, head = str(runs["base"]), str(runs["head"])
    code, d = diff_json(base, head, "--process", "sites-worker", "--fail-above", "0")
    assert code == 0
    rows = {r["key"]: r for r in d["sections"]["totals"]["rows"]}
    assert (rows["calls"]["base"], rows["calls"]["head"]) == (20, 20)
    assert rows["allocated_bytes"]["base"] == 20 * 512 and rows["allocated_bytes"]["delta"] == 0
    assert "processes" not in d["sections"]  # one process on each side

    def pid(db: str, name: str) -> int:
        return open_run(Path(db)).execute(
            "SELECT pid FROM processes WHERE name = ?", [name]).fetchone()[0]

    pids = f"{pid(base, 'sites')}:{pid(head, 'sites')}"
    code, d = diff_json(base, head, "--pid", pids)
    rows = {r["key"]: r for r in d["sections"]["totals"]["rows"]}
    assert (rows["calls"]["base"], rows["calls"]["head"]) == (170, 220)
    assert d["sections"]["sites"]["metrics"]["calls"]["matched"]["sites"][0]["location"] == \
        "index_items"
    assert d["base"]["pids"] == [pid(base, "sites")]
    code, _, err = invoke("diff", base, head, "--process", "nope")
    assert code == 2 and "no process named 'nope'" in err and err.count("\n") == 1
    code, _, err = invoke("diff", base, head, "--pid", "1:2")
    assert code == 2 and "no process 1" in err


def test_diff_of_dataset_runs_is_the_diff_of_their_databases(runs: dict[str, Any]) -> None:
    ds = str(runs["dataset"])
    for base, head in (("base", "head"), ("base", "rerun")):
        _, from_files = diff_json(str(runs[base]), str(runs[head]), "--fail-above", "10")
        _, from_dataset = diff_json("--dataset", ds, base, head, "--fail-above", "10")
        assert from_dataset["sections"] == from_files["sections"]
        assert from_dataset["gate"] == from_files["gate"]
        assert from_dataset["base"]["name"] == f"run {base}"
    code, _, err = invoke("diff", "--dataset", ds, "base", "nope")
    assert code == 2 and "no run 'nope'" in err and err.count("\n") == 1


# Each run's totals in one query over the dataset; peak heap as the report counts it:
# the heap of all processes together, event by event.
TOTALS_SQL = """
    WITH a AS (
        SELECT run, count(*) AS calls, sum(size) AS allocated_bytes,
               count(*) FILTER (WHERE temporary) AS temporary,
               coalesce(sum(size) FILTER (WHERE end_reason IN ('exec', 'exit', 'end')), 0)
                   AS leaked_bytes,
               count(*) FILTER (WHERE end_reason IN ('exec', 'exit', 'end'))
                   AS leaked_allocations
        FROM allocations GROUP BY run),
    h AS (
        SELECT run, max(heap) AS peak_heap_bytes FROM (
            SELECT run, sum(sum(delta)) OVER (PARTITION BY run ORDER BY event_id) AS heap
            FROM heap_timeline GROUP BY run, event_id)
        GROUP BY run)
    SELECT r.run, r.labels['commit'] AS commit, a.* EXCLUDE (run), h.peak_heap_bytes
    FROM runs r JOIN a USING (run) JOIN h USING (run) ORDER BY r.run"""


def test_three_runs_queried_together(runs: dict[str, Any]) -> None:
    ds = runs["dataset"]
    code, out, err = invoke("query", "--dataset", str(ds), TOTALS_SQL, "--format", "json")
    assert code == 0, err
    rows = {r.pop("run"): r for r in json.loads(out)}
    assert sorted(rows) == ["base", "head", "rerun"]
    keys = list(TOTALS["base"])
    for run_id, row in rows.items():
        code, rep, _ = invoke("report", str(runs[run_id]), "--format", "json")
        report = json.loads(rep)["totals"]
        assert {k: row[k] for k in keys} == {k: report[k] for k in keys}, run_id
        assert {k: row[k] for k in keys} == TOTALS["head" if run_id == "head" else "base"]
    assert (rows["base"]["commit"], rows["head"]["commit"]) == ("c0ffee1", "d00d002")
    # a second engine reads the dataset as it lies: pyarrow's hive partitioning
    allocs = pads.dataset(ds / "allocations", format="parquet", partitioning="hive").to_table(
        columns=["run", "size", "end_reason"])
    per_run = allocs.group_by("run").aggregate([("size", "sum"), ("size", "count")])
    assert {r["run"]: (r["size_count"], r["size_sum"]) for r in per_run.to_pylist()} == {
        k: (v["calls"], v["allocated_bytes"]) for k, v in rows.items()}
    leaked = allocs.filter(pc.is_in(allocs["end_reason"],
                                    value_set=pa.array(["exec", "exit", "end"])))
    assert leaked.num_rows == sum(v["leaked_allocations"] for v in rows.values())
    meta = pads.dataset(ds / "runs", format="parquet", partitioning="hive").to_table()
    labels = {r["run"]: dict(r["labels"]) for r in meta.to_pylist()}
    assert labels == {"base": {"commit": "c0ffee1", "build": "base"},
                      "rerun": {"commit": "c0ffee1", "build": "base"},
                      "head": {"commit": "d00d002", "build": "head"}}
    assert {r["command"][0] for r in meta.to_pylist()} == {
        str(runs["programs"]["base"]), str(runs["programs"]["head"])}
    assert all(json.loads(r["memory_metadata"]) for r in meta.to_pylist())
