"""The run dataset (`process --dataset`, `query --dataset`, `diff --dataset`) and `memtrack
diff` on synthetic runs: the layout other engines read, runs appended, refused and
replaced, a dataset run read back as its database, sites that moved or were renamed,
the gate's edges, the markdown cut, one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from support.synth import EVENT_ROWS, SIZES, events_table, write_artifact, write_run
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.process.dataset import append_run
from memtrack.report import diff as diff_mod
from memtrack.report.reader import RunReader
from memtrack.report.text import ReportOptions, report_data
from memtrack.schema.dataset import open_dataset_run
from memtrack.schema.ddl import EXPORT_TABLES, SCHEMA_VERSION, open_run

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def head_events() -> pa.Table:
    """The synthetic run with make_big's second block (C) 1024 bytes larger: alive at the
    heap peak, freed later."""
    rows = [list(r) for r in EVENT_ROWS]
    (c,) = [r for r in rows if r[5] == 0xC0 and r[3] == 1]
    c[7] += 1024
    return events_table([tuple(r) for r in rows])


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ds")
    base = write_run(d / "base.duckdb")
    head = write_run(d / "head.duckdb", head_events())
    # head2: as head, with make_small renamed (a site one run has and the other not)
    renamed = d / "renamed.duckdb"
    renamed.write_bytes(head.read_bytes())
    with duckdb.connect(str(renamed)) as con:
        con.execute("UPDATE frames SET name = 'make_tiny', function = 'make_tiny' "
                    "WHERE name = 'make_small'")
    return {"base": base, "head": head, "renamed": renamed, "dir": d}


def test_dataset_layout_for_other_engines(dbs: dict[str, Path], tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    assert append_run(ds, "r1", dbs["base"]) is False
    assert append_run(ds, "r2", dbs["head"]) is False
    for table in (*EXPORT_TABLES, "runs"):
        for run in ("r1", "r2"):
            files = sorted(p.name for p in (ds / table / f"run={run}").iterdir())
            assert files == ["data.parquet"], (table, files)  # no temporary left
            # the partition column is in the path only (Spark refuses it in both)
            assert "run" not in pq.read_schema(ds / table / f"run={run}/data.parquet").names
    # pyarrow reads each table with its run column from the paths, row for row
    for table in ("allocations", "stack_frames", "heap_peak"):
        got = pads.dataset(ds / table, format="parquet", partitioning="hive").to_table()
        for run, db in (("r1", dbs["base"]), ("r2", dbs["head"])):
            n = open_run(db).execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            assert got.filter(pa.compute.equal(got["run"], run)).num_rows == n > 0
    runs = pads.dataset(ds / "runs", format="parquet", partitioning="hive").to_table()
    assert sorted(runs["run"].to_pylist()) == ["r1", "r2"]
    assert runs.schema.field("labels").type == pa.map_(pa.string(), pa.string())


def test_dataset_run_reads_as_its_database(dbs: dict[str, Path], tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    append_run(ds, "base", dbs["base"])
    from_files = report_data(open_run(dbs["base"]), ReportOptions())
    from_dataset = report_data(open_dataset_run(ds, "base"), ReportOptions())
    assert from_dataset == from_files
    for pid in (100, 200):
        assert RunReader(open_dataset_run(ds, "base"), pid).totals() == \
            RunReader(open_run(dbs["base"]), pid).totals()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files away")
def test_a_dataset_run_under_sudo_is_the_users(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Under sudo the run's files in the dataset belong to the invoking user."""
    import pwd

    pw = pwd.getpwnam("nobody")
    monkeypatch.setenv("SUDO_UID", str(pw.pw_uid))
    monkeypatch.setenv("SUDO_GID", str(pw.pw_gid))
    art = write_artifact(tmp_path / "a.memtrack")
    ds = tmp_path / "ds"
    code, _, err = invoke("process", str(art), "--dataset", str(ds), "--run-id", "r1", "-q")
    assert code == 0, err
    parts = sorted(ds.glob("*/run=r1"))
    assert {p.parent.name for p in parts} >= {"runs", "events", "allocations"}
    for p in [*parts, *(f for d in parts for f in d.rglob("*"))]:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (pw.pw_uid, pw.pw_gid), p


def test_process_into_a_dataset(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    ds = tmp_path / "ds"
    args = ["process", str(art), "--dataset", str(ds), "--run-id", "build-1.2_x"]
    code, _, err = invoke(*args, "--label", "commit=abc", "--label", "branch=main")
    assert code == 0, err
    assert err.splitlines()[0].startswith(f"{ds} run build-1.2_x: 20 events")
    assert err.splitlines()[-1] == f"{ds}: run build-1.2_x appended"
    assert sorted(p.name for p in ds.iterdir() if p.name.startswith(".")) == []
    assert not list(tmp_path.rglob("*memory_metadata.json"))
    code, out, _ = invoke("query", "--dataset", str(ds), "--format", "json",
                          "SELECT run, labels['commit'] AS c, command, exit_code, root_pid, "
                          "attached, schema_version, memory_metadata IS NOT NULL AS md "
                          "FROM runs")
    assert code == 0
    (row,) = json.loads(out)
    assert row == {"run": "build-1.2_x", "c": "abc", "command": ["p", "-x"], "exit_code": None,
                   "root_pid": 100, "attached": [], "schema_version": SCHEMA_VERSION,
                   "md": True}
    # again: refused, then replaced with --force
    code, _, err = invoke(*args)
    assert code == 2 and "already in the dataset (--force replaces it)" in err
    assert err.count("\n") == 1
    code, _, err = invoke(*args, "--force", "-q", "-o", str(tmp_path / "r.duckdb"),
                          "--label", "commit=def")
    assert code == 0 and err == ""
    assert (tmp_path / "r.duckdb").is_file() and (tmp_path / "r.memory_metadata.json").is_file()
    code, out, _ = invoke("query", "--dataset", str(ds), "--format", "csv",
                          "SELECT a.run, count(*), any_value(r.labels['commit']) FROM "
                          "allocations a JOIN runs r USING (run) GROUP BY a.run")
    assert out.splitlines()[1:] == ["build-1.2_x,9,def"]
    # the labels are the run database's too
    assert RunReader(open_run(tmp_path / "r.duckdb")).labels == {"commit": "def"}


def test_runs_mark_an_attached_run(tmp_path: Path) -> None:
    """A run of `capture --pid` (the manifest's `attached`) lists the pids attached to
    in `runs`; a spawned command's run an empty list; a `runs` file written before the
    column existed reads as null beside them."""
    spawned = write_artifact(tmp_path / "s.memtrack")
    attached = write_artifact(tmp_path / "a.memtrack")
    m = json.loads((attached / "manifest.json").read_text())
    m["attached"] = [{"pid": 100, "ts": 900, "rss": {"anon": 4096}},
                     {"pid": 200, "ts": 950, "rss": {}}]
    (attached / "manifest.json").write_text(json.dumps(m))
    ds = tmp_path / "ds"
    for art, run in ((spawned, "s"), (attached, "a")):
        code, _, err = invoke("process", str(art), "--dataset", str(ds), "--run-id", run, "-q")
        assert code == 0, err
    old = ds / "runs" / "run=old" / "data.parquet"
    old.parent.mkdir()
    row = pq.ParquetFile(ds / "runs" / "run=s" / "data.parquet").read()
    pq.write_table(row.drop_columns(["attached"]), old)
    code, out, err = invoke("query", "--dataset", str(ds), "--format", "json",
                            "SELECT run, attached FROM runs ORDER BY run")
    assert code == 0, err
    assert json.loads(out) == [{"run": "a", "attached": [100, 200]},
                               {"run": "old", "attached": None},
                               {"run": "s", "attached": []}]


@pytest.mark.parametrize("extra,message", [
    (["--run-id", "../x"], "run id '../x': use letters"),
    (["--run-id", ""], "run id '': use letters"),
    (["--label", "nokey"], "--label: expected key=value"),
    (["--label", "a=1", "--label", "a=2"], "--label: a given twice"),
])
def test_process_dataset_errors(tmp_path: Path, extra: list[str], message: str) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    args = ["process", str(art), "--dataset", str(tmp_path / "ds"), *extra]
    if "--run-id" not in extra:
        args += ["--run-id", "x"]
    code, _, err = invoke(*args)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "ds" / "runs").exists()


def test_process_dataset_refusals(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    for args, message in (
        (["--run-id", "x"], "--dataset and --run-id go together"),
        (["--dataset", str(tmp_path)], "--dataset and --run-id go together"),
        ([], "give -o RUN.duckdb, --dataset DIR --run-id ID, or both"),
        (["--dataset", str(tmp_path), "--run-id", "x"], "not a memtrack dataset (no runs/ "
                                                        "directory) and not empty"),
        (["--dataset", str(art / "manifest.json"), "--run-id", "x"], "not a directory"),
    ):
        code, _, err = invoke("process", str(art), *args)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)


def test_query_dataset_keeps_to_complete_runs(dbs: dict[str, Path], tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    code, _, err = invoke("query", "--dataset", str(ds), "SELECT 1")
    assert code == 2 and "not a memtrack dataset" in err
    (ds / "runs").mkdir(parents=True)
    code, _, err = invoke("query", "--dataset", str(ds), "SELECT 1")
    assert code == 2 and "holds no run yet" in err
    append_run(ds, "a", dbs["base"])
    append_run(ds, "b", dbs["head"])
    sql = "SELECT run, sum(size)::BIGINT AS s FROM allocations GROUP BY run ORDER BY run"
    code, out, _ = invoke("query", "--dataset", str(ds), sql, "--format", "json")
    assert json.loads(out) == [{"run": "a", "s": sum(SIZES)}, {"run": "b", "s": sum(SIZES) + 1024}]
    # a run whose runs file is gone (being replaced, or cut short) is not in the views
    (ds / "runs" / "run=b" / "data.parquet").unlink()
    code, out, _ = invoke("query", "--dataset", str(ds), sql, "--format", "json")
    assert json.loads(out) == [{"run": "a", "s": sum(SIZES)}]
    code, _, err = invoke("diff", "--dataset", str(ds), "a", "b")
    assert code == 2 and "no run 'b' in this dataset" in err
    code, _, err = invoke("query", "--dataset", str(ds), str(dbs["base"]), "SELECT 1")
    assert code == 2 and "expected --dataset DIR SQL" in err


def test_diff_of_synthetic_runs(dbs: dict[str, Path]) -> None:
    code, out, _ = invoke("diff", str(dbs["base"]), str(dbs["head"]), "--format", "json")
    assert code == 0
    d = json.loads(out)
    rows = {r["key"]: r for r in d["sections"]["totals"]["rows"]}
    assert rows["allocated_bytes"]["delta"] == rows["peak_heap_bytes"]["delta"] == 1024
    assert rows["leaked_bytes"]["delta"] == 0
    sites = d["sections"]["sites"]
    for metric in ("allocated", "peak"):
        (s,) = sites["metrics"][metric]["matched"]["sites"]
        assert (s["location"], s["file"], s["delta"]) == ("make_big", "make_big.c", 1024)
        assert [f["function"] for f in s["backtraces"][0]["frames"]] == [
            "make_big", "work", "main"]
    assert sites["metrics"]["calls"]["matched"]["sites"] == []
    # a renamed site: in one run each, listed apart by the run it is in
    code, out, _ = invoke("diff", str(dbs["base"]), str(dbs["renamed"]), "--format", "json")
    sites = json.loads(out)["sections"]["sites"]
    assert (sites["matched"], sites["head_only"], sites["base_only"]) == (4, 1, 1)
    calls = sites["metrics"]["calls"]
    assert [(s["location"], s["base"], s["head"]) for s in calls["head_only"]["sites"]] == [
        ("make_tiny", 0, 2)]
    assert [(s["location"], s["base"], s["head"]) for s in calls["base_only"]["sites"]] == [
        ("make_small", 2, 0)]
    assert calls["head_only"]["sites"][0]["backtraces"][0]["frames"][0]["function"] == \
        "make_tiny"
    code, out, _ = invoke("diff", str(dbs["base"]), str(dbs["renamed"]), "--metric", "calls")
    lines = out.splitlines()
    i = lines.index("  only in head:")
    assert lines[i + 1] == "2 from make_tiny (make_small.c)"
    assert lines[lines.index("  only in base:") + 1] == "2 from make_small (make_small.c)"


def test_gate_edges(dbs: dict[str, Path]) -> None:
    base, head = str(dbs["base"]), str(dbs["head"])
    code, out, _ = invoke("diff", base, head, "--fail-above", "10.8", "--fail-on", "peak")
    assert code == 1  # 6444 -> 7468: +15.9 %
    assert out.splitlines()[-1] == ("gate: FAILED (more than 10.8%): peak heap memory "
                                    "consumption +1.00 KiB (+15.9%)")
    assert invoke("diff", base, head, "--fail-above", "16", "--fail-on", "peak")[0] == 0
    g = diff_mod.gate({"rows": [
        {"key": "leaked_bytes", "label": "leaked", "unit": "bytes", **diff_mod.change(0, 8)},
        {"key": "peak_rss_bytes", "label": "peak RSS", "unit": "bytes",
         **diff_mod.change(None, 8)},
    ]}, diff_mod.DiffOptions(fail_above=1000.0, fail_on=("leaked", "rss")))
    assert g is not None
    assert [(c["metric"], c["failed"], c["change"]) for c in g["checks"]] == [
        ("leaked", True, "+8 B (new)"), ("rss", True, "not recorded in base")]


@pytest.mark.parametrize("args,message", [
    (["--format", "html"], "--format: expected text, json or markdown"),
    (["--top", "0"], "--top: expected 1 to 1000000, got 0"),
    (["--fail-on", "peak"], "--fail-on goes with --fail-above PCT"),
    (["--fail-above", "5", "--fail-on", "nope"], "--fail-on: expected one of allocated"),
    (["--fail-above", "-1"], "--fail-above: expected a percentage from 0 to"),
    (["--fail-above", "inf"], "--fail-above: expected a percentage from 0 to"),
    (["--metric", "peak,bogus"], "--metric: expected one of allocated"),
    (["--pid", "1:2:3"], "--pid: expected PID or BASE_PID:HEAD_PID"),
    (["--pid", "100", "--process", "p"], "--pid and --process: give one"),
])
def test_diff_option_errors(dbs: dict[str, Path], args: list[str], message: str) -> None:
    code, out, err = invoke("diff", str(dbs["base"]), str(dbs["head"]), *args)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1, err


def test_diff_file_errors(dbs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = invoke("diff", str(dbs["base"]), str(tmp_path / "none.duckdb"))
    assert code == 2 and "no such run database" in err and err.count("\n") == 1
    code, _, err = invoke("diff", "--dataset", str(tmp_path), "a", "b")
    assert code == 2 and "not a memtrack dataset" in err and err.count("\n") == 1


def test_markdown_is_cut_to_fit_a_comment(dbs: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    code, full, _ = invoke("diff", str(dbs["base"]), str(dbs["renamed"]), "--format",
                           "markdown")
    assert code == 0 and full.count("<details>") == 5  # every metric changed
    cut_at = full.index("<details>") + 40  # inside the first backtrace block
    monkeypatch.setattr(diff_mod, "MD_LIMIT", cut_at)
    code, md, _ = invoke("diff", str(dbs["base"]), str(dbs["renamed"]), "--format",
                         "markdown")
    assert len(md) < cut_at + 100
    assert md.endswith("(cut to fit a comment: --format text has it all)\n")
    assert md.count("```") % 2 == 0 and md.count("<details>") == md.count("</details>") == 1


def test_damaged_dataset_files_are_one_line(dbs: dict[str, Path], tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    append_run(ds, "a", dbs["base"])
    append_run(ds, "b", dbs["head"])
    f = ds / "allocations" / "run=b" / "data.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # cut short
    for args in (["diff", "--dataset", str(ds), "a", "b"],
                 ["query", "--dataset", str(ds), "SELECT count(*) FROM allocations"]):
        code, out, err = invoke(*args)
        assert code == 2 and out == "" and err.count("\n") == 1, (args, err)
        assert err.startswith("memtrack: ") and "Traceback" not in err
    f.write_bytes(b"not parquet")
    code, _, err = invoke("diff", "--dataset", str(ds), "a", "b")
    assert code == 2 and str(f) in err and err.count("\n") == 1, err
