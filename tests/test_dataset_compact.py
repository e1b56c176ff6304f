"""`memtrack compact --dataset`: the 20 synthetic runs of tests/test_history.py merged
into one batch per table, and every reader gives what it gave before: every table row
for row (`query --dataset`), docs/dataset.md's queries, `history` in every format,
`diff --dataset`, DuckDB's and polars' reads as docs/dataset.md writes them. Then runs
appended to the compacted dataset (in its layout) and compacted again; a compaction
that fails part way (each table as it was or compacted, the same rows either way) and
is finished by the next; what compact refuses (a run being appended, replacing a
compacted run, object storage)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
from support.runs import RUNS, add_run, disk_full_at, run_id, write_bench_dataset
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.process import dataset as writer
from memtrack.schema.dataset import (
    BATCHED,
    RUNS_TABLE,
    DatasetError,
    Remote,
    list_table,
    run_ids,
)
from memtrack.schema.ddl import EXPORT_TABLES

pl = pytest.importorskip("polars", reason="polars missing: run scripts/setup")

TABLES = (RUNS_TABLE, *EXPORT_TABLES)
# docs/dataset.md's queries (`query --dataset`), with a function of these runs
DOC_QUERIES = [
    "SELECT run, count(*) AS calls, sum(size) AS bytes FROM allocations "
    "WHERE run IN (SELECT run FROM runs) GROUP BY run ORDER BY run",
    """SELECT r.labels['commit'] AS commit, r.start_time, h.peak_bytes
    FROM runs r JOIN processes p ON p.run = r.run AND p.pid = r.root_pid
    JOIN heap_peak h ON h.run = p.run AND h.pid = p.pid ORDER BY r.start_time""",
    """SELECT a.run, sum(a.size) AS bytes
    FROM allocations a JOIN stack_frames sf ON sf.run = a.run AND sf.stack_id = a.stack_id
        AND sf.depth = 1
    JOIN frames f ON f.run = sf.run AND f.frame_id = sf.frame_id AND f.inline_depth = 0
    WHERE f.name = 'make_big' GROUP BY a.run ORDER BY a.run""",
]


def invoke(*args: str | Path) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def query(ds: Path | str, sql: str) -> list[dict[str, Any]]:
    code, out, err = invoke("query", "--dataset", ds, "--format", "json", sql)
    assert code == 0, err
    return json.loads(out)


def everything(ds: Path | str, appended: bool = True) -> dict[str, Any]:
    """What the readers give: every table's rows (ordered), the documented queries,
    history in every format, a diff of two runs (the step's). `appended`: with when each run was
    (runs.processed_at)."""
    out: dict[str, Any] = {
        t: query(ds, f"SELECT * {'' if appended or t != RUNS_TABLE else 'EXCLUDE (processed_at)'}"
                     f" FROM {t} ORDER BY ALL") for t in TABLES}
    out["docs"] = [query(ds, sql) for sql in DOC_QUERIES]
    for fmt in ("json", "text", "markdown"):
        code, text, err = invoke("history", "--dataset", ds, "--order-by", "commit_time",
                                 "--format", fmt)
        assert code == 0, err
        out[f"history {fmt}"] = text.replace(str(ds), "DS")
    pair = [run_id(11), run_id(12)] if run_id(12) in run_ids(ds) else [run_id(1), run_id(2)]
    code, text, err = invoke("diff", "--dataset", ds, *pair)
    assert code == 0, err
    out["diff"] = text
    return out


def engines(ds: Path) -> dict[str, Any]:
    """Every table as DuckDB's read_parquet and polars read it (docs/dataset.md): the
    columns and types, and the rows; a table in batches has its `batch` too."""
    con = duckdb.connect()
    out: dict[str, Any] = {}
    for t in TABLES:
        cur = con.execute(f"SELECT * FROM read_parquet('{ds}/{t}/*/*.parquet', "
                          "hive_partitioning = true, hive_types_autocast = false)")
        cols = [(d[0], str(d[1])) for d in cur.description]
        keep = [i for i, (c, _) in enumerate(cols) if c != "batch"]
        out[f"duckdb {t}"] = [cols[i] for i in keep], sorted(
            str(tuple(r[i] for i in keep)) for r in cur.fetchall())
        frame = pl.scan_parquet(f"{ds}/{t}/*/*.parquet", hive_partitioning=True,
                                hive_schema={"run": pl.String, "batch": pl.String}).collect()
        frame = frame.drop("batch", strict=False)
        out[f"polars {t}"] = list(frame.schema.items()), sorted(map(str, frame.rows()))
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The dataset of 20 runs, read; then compacted."""
    d = tmp_path_factory.mktemp("compact")
    ds = write_bench_dataset(d / "ds", d / "scratch")
    before = everything(ds), engines(ds)
    files = sorted(str(p.relative_to(ds)) for p in ds.rglob("*.parquet"))
    code, out, err = invoke("compact", "--dataset", ds)
    assert code == 0, err
    return {"ds": ds, "dir": d, "before": before, "files": files, "said": out}


def test_compact_merges_every_table_into_one_batch(made: dict[str, Any]) -> None:
    ds = made["ds"]
    assert len(made["files"]) == RUNS * len(TABLES)
    n = len(TABLES)
    assert made["said"] == f"{ds}: {RUNS} runs compacted in {n} tables: {RUNS * n} files -> {n}\n"
    for t in TABLES:
        entries = sorted(p.name for p in (ds / t).iterdir())
        assert entries[0] == BATCHED and len(entries) == 2 and \
            entries[1].startswith("batch=_c"), (t, entries)
        (f,) = (ds / t / entries[1]).iterdir()
        assert f.name == "data_0.parquet"
        assert pq.read_schema(f).names[-1] == "run"  # in the file: no run= above it
    assert not [p for p in ds.iterdir() if p.name.startswith(".")]  # no staging left
    assert run_ids(ds) == sorted(run_id(i) for i in range(1, RUNS + 1))


def test_every_reader_reads_the_same_after(made: dict[str, Any]) -> None:
    ds = made["ds"]
    before, engines_before = made["before"]
    after = everything(ds)
    assert after.keys() == before.keys()
    for k in before:
        assert after[k] == before[k], k
    assert len(after["allocations"]) == 3 * RUNS and len(after["docs"][2]) == RUNS
    assert engines(ds) == engines_before


def test_appends_follow_the_compacted_layout(made: dict[str, Any], tmp_path: Path) -> None:
    """Runs appended after a compaction go into their own batch (`run` in the file, the
    others untouched), read as if appended to the dataset by run; compacted again."""
    ds, scratch = made["ds"], made["dir"] / "scratch"
    copy = tmp_path / "ds"
    shutil.copytree(ds, copy)
    plain = tmp_path / "plain"  # the same runs, never compacted
    for i in range(1, RUNS + 3):
        add_run(plain, scratch, i)
    kept = {p: p.stat().st_ino for p in copy.rglob("*.parquet")}
    for i in (RUNS + 1, RUNS + 2):
        add_run(copy, scratch, i)
    assert {p: p.stat().st_ino for p in kept} == kept
    new = copy / "allocations" / f"batch={run_id(RUNS + 1)}" / "data.parquet"
    assert pq.read_table(new)["run"].to_pylist() == [run_id(RUNS + 1)] * 3
    want = everything(plain, appended=False)
    assert everything(copy, appended=False) == want
    code, out, _ = invoke("compact", "--dataset", copy)
    assert code == 0 and " 2 runs compacted in " in out
    assert len(list((copy / "allocations").glob("batch=*"))) == 2  # the first batch kept
    assert everything(copy, appended=False) == want
    code, out, _ = invoke("compact", "--dataset", copy)
    assert code == 0 and out.endswith("nothing to compact (no run outside a compacted batch)\n")


def test_a_compacted_run_is_not_replaced(made: dict[str, Any], tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(made["ds"], ds)
    scratch = made["dir"] / "scratch"
    with pytest.raises(DatasetError, match="in a compacted batch: it cannot be replaced"):
        add_run(ds, scratch, 3)
    add_run(ds, scratch, RUNS + 1)
    db = scratch / "again.duckdb"
    shutil.copyfile(scratch / "block2048.duckdb", db)
    assert writer.append_run(ds, run_id(RUNS + 1), db, force=True) is True  # its own batch
    assert query(ds, f"SELECT count(*) AS n FROM runs WHERE run = '{run_id(RUNS + 1)}'") == \
        [{"n": 1}]


def test_a_compaction_that_fails_changes_no_result(made: dict[str, Any], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each table is exchanged whole: stopped after `runs` and three tables, the dataset
    mixes both layouts and every reader reads what it read before; the next compaction
    deletes what was left and finishes."""
    scratch = made["dir"] / "scratch"
    ds = tmp_path / "ds"
    for i in range(1, 6):
        add_run(ds, scratch, i)
    want = everything(ds)
    want_engines = engines(ds)
    exchange = writer.exchange
    done: list[Path] = []

    def failing(a: Path, b: Path) -> None:
        if len(done) == 4:
            raise OSError(5, "Input/output error")
        done.append(b)
        exchange(a, b)

    monkeypatch.setattr(writer, "exchange", failing)
    with pytest.raises(OSError):
        writer.compact(ds)
    assert [p.name for p in done] == list(TABLES[:4])
    batched = {t for t in TABLES if (ds / t / BATCHED).exists()}
    assert batched == set(TABLES[:4])
    assert [p.name.startswith(".compact-") for p in ds.iterdir()
            if p.name.startswith(".")] in ([], [True])
    assert everything(ds) == want
    assert engines(ds) == want_engines
    monkeypatch.setattr(writer, "exchange", exchange)
    code, out, _ = invoke("compact", "--dataset", ds)
    assert code == 0 and f" compacted in {len(TABLES) - 4} tables" in out
    assert not [p for p in ds.iterdir() if p.name.startswith(".")]
    assert everything(ds) == want
    assert engines(ds) == want_engines


def test_a_run_left_half_written_stays_as_it_was(made: dict[str, Any], tmp_path: Path) -> None:
    """The tables of an append that failed (no `runs` row) are no run: compact keeps
    them outside its batch, in the table's new layout, for engines that read them."""
    scratch = made["dir"] / "scratch"
    ds = tmp_path / "ds"
    for i in (1, 2):
        add_run(ds, scratch, i)
    with disk_full_at("stops"), pytest.raises(OSError):
        add_run(ds, scratch, 3)
    want, want_engines = everything(ds), engines(ds)
    assert len(want_engines["duckdb allocations"][1]) == 9  # run 3's rows, no run of it
    writer.compact(ds)
    orphan = ds / "allocations" / f"batch={run_id(3)}" / "data.parquet"
    assert pq.read_table(orphan)["run"].to_pylist() == [run_id(3)] * 3
    assert everything(ds) == want and engines(ds) == want_engines
    add_run(ds, scratch, 3)  # the run appended again replaces them
    assert len(query(ds, "SELECT * FROM allocations")) == 9


def test_compact_waits_for_no_append(made: dict[str, Any], tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    add_run(ds, made["dir"] / "scratch", 1)
    fd = writer._locked(ds, exclusive=False)  # as an append holds it
    try:
        code, _, err = invoke("compact", "--dataset", ds)
        assert code == 2 and err == f"memtrack: {ds}: a run is being appended: compact " \
            "once it is done\n"
    finally:
        os.close(fd)
    assert not list_table(ds, "allocations").batched  # type: ignore[union-attr]
    code, _, err = invoke("compact", "--dataset", ds.as_uri())
    assert code == 0, err
    assert list_table(ds, "allocations").batched  # type: ignore[union-attr]


def test_compact_refuses_object_storage(tmp_path: Path) -> None:
    import pyarrow.fs as pafs

    fs, _ = pafs.FileSystem.from_uri("mock:///")
    with pytest.raises(DatasetError, match="compact works on a local directory"):
        writer.compact(Remote(fs, "bucket/ds", "mock:///bucket/ds"))
    code, _, err = invoke("compact", "--dataset", tmp_path / "none")
    assert code == 2 and "not a memtrack dataset" in err and err.count("\n") == 1


def test_a_compacted_dataset_on_object_storage(made: dict[str, Any], tmp_path: Path) -> None:
    """A compacted dataset uploaded to object storage (pyarrow's `mock:`) reads as it
    did, and a run appended there goes into its own batch; a compacted run is refused."""
    import pyarrow.fs as pafs

    from memtrack.schema.dataset import open_dataset

    ds, scratch = made["ds"], made["dir"] / "scratch"
    fs, _ = pafs.FileSystem.from_uri("mock:///")
    pafs.copy_files(str(ds), "bucket/ds", pafs.LocalFileSystem(), fs)
    remote = Remote(fs, "bucket/ds", "mock:///bucket/ds")
    sql = "SELECT run, count(*), sum(size) FROM allocations GROUP BY run ORDER BY run"
    con = open_dataset(remote)
    want = con.execute(sql).fetchall()
    con.close()
    assert want == [(r, 3, n) for r, n in sorted(
        (run_id(i), 1792 + (1024 if i >= 12 else 0)) for i in range(1, RUNS + 1))]
    db = scratch / "remote.duckdb"
    shutil.copyfile(scratch / "block2048.duckdb", db)
    with pytest.raises(DatasetError, match="in a compacted batch"):
        writer.append_run(remote, run_id(1), db, force=True)
    assert writer.append_run(remote, "new", db) is False
    assert fs.get_file_info(f"bucket/ds/allocations/batch=new/{'data.parquet'}").is_file
    con = open_dataset(remote)
    assert con.execute(sql).fetchall() == sorted([*want, ("new", 3, 2816)])
    con.close()


def test_links_in_a_compacted_table_are_refused(made: dict[str, Any], tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(made["ds"], ds)
    (batch,) = (ds / "frames").glob("batch=_c*")
    outside = tmp_path / "outside"
    batch.rename(outside)
    os.symlink(outside, batch)
    code, _, err = invoke("query", "--dataset", ds, "SELECT count(*) FROM frames")
    assert code == 2 and err == f"memtrack: {batch}: not a directory of this dataset (a " \
        "symbolic link, or another kind of file)\n"
    batch.unlink()
    batch.mkdir()
    os.symlink(outside / "data_0.parquet", batch / "data_0.parquet")
    code, _, err = invoke("query", "--dataset", ds, "SELECT count(*) FROM frames")
    assert code == 2 and err.startswith(f"memtrack: {batch}/data_0.parquet: not a file of ")
