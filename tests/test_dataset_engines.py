"""The run dataset read by the engines docs/dataset.md names, on a dataset of three
synthetic runs (one with a stack hash above 2^63): DuckDB (read_parquet with the hive
partition, not memtrack's session) and polars read every table with the documented
types and the `run` partition, row for row, and the documented queries give what
`memtrack query --dataset` gives. Spark is left out: see docs/dataset.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import pytest
from support.runs import add_run, run_id
from support.synth import write_run
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.process.dataset import append_run
from memtrack.schema.dataset import RUNS_TABLE
from memtrack.schema.ddl import EXPORT_TABLES, table_columns

pl = pytest.importorskip("polars", reason="polars missing: run scripts/setup")

BIG_HASH = 2**64 - 3  # takes all 64 bits: Spark and Trino must read DECIMAL(20,0)
RUNS_COLUMNS = {  # docs/dataset.md's runs table: DuckDB type
    "labels": "MAP(VARCHAR, VARCHAR)", "command": "VARCHAR[]", "hostname": "VARCHAR",
    "kernel": "VARCHAR", "arch": "VARCHAR", "start_time": "TIMESTAMP WITH TIME ZONE",
    "end_time": "TIMESTAMP WITH TIME ZONE", "exit_code": "INTEGER", "exit_signal": "INTEGER",
    "root_pid": "UINTEGER", "attached": "UINTEGER[]", "artifact": "VARCHAR",
    "memtrack_version": "VARCHAR",
    "schema_version": "INTEGER", "processed_at": "TIMESTAMP WITH TIME ZONE",
    "memory_metadata": "VARCHAR"}  # fmt: skip
# docs/dataset.md's types: DuckDB type -> polars type
POLARS = {
    "UBIGINT": pl.UInt64, "UINTEGER": pl.UInt32, "USMALLINT": pl.UInt16, "UTINYINT": pl.UInt8,
    "BIGINT": pl.Int64, "INTEGER": pl.Int32, "BOOLEAN": pl.Boolean, "VARCHAR": pl.String,
    "DOUBLE": pl.Float64, "VARCHAR[]": pl.List(pl.String), "UINTEGER[]": pl.List(pl.UInt32),
    "MAP(VARCHAR, VARCHAR)": pl.Map(pl.String, pl.String) if hasattr(pl, "Map")  # polars 2
    else pl.List(pl.Struct({"key": pl.String, "value": pl.String})),
    "TIMESTAMP WITH TIME ZONE": pl.Datetime("us", "UTC")}  # fmt: skip


def documented() -> dict[str, list[tuple[str, str]]]:
    """Every table's columns and DuckDB types as the files keep them: docs/tables.md's
    (an ENUM is a string), and runs."""
    out = {t: [(c, "VARCHAR" if k.startswith("ENUM") else k) for c, k in cols]
           for t, cols in table_columns().items()}
    return {**out, RUNS_TABLE: list(RUNS_COLUMNS.items())}


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("engines")
    ds = d / "ds"
    add_run(ds, d / "scratch", 1)
    add_run(ds, d / "scratch", 12)
    db = write_run(d / "synth.duckdb")
    with duckdb.connect(str(db)) as con:
        (h,) = con.execute("SELECT min(stack_hash) FROM stacks").fetchone()
        for t in ("stacks", "events"):
            con.execute(f"UPDATE {t} SET stack_hash = ? WHERE stack_hash = ?", [BIG_HASH, h])
    append_run(ds, "1234", db)  # a run id that looks like a number: typed as text
    return ds


RUNS = sorted([run_id(1), run_id(12), "1234"])


def query(ds: Path, sql: str) -> list[dict[str, Any]]:
    r = CliRunner().invoke(app, ["query", "--dataset", str(ds), "--format", "json", sql])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def counts(ds: Path) -> dict[str, list[tuple[str, int]]]:
    """Per table, its rows per run as `memtrack query --dataset` counts them."""
    sql = " UNION ALL ".join(f"SELECT '{t}' AS t, run, count(*) AS n FROM {t} GROUP BY run"
                             for t in (RUNS_TABLE, *EXPORT_TABLES))
    out: dict[str, list[tuple[str, int]]] = {}
    for r in sorted(query(ds, sql), key=lambda r: (r["t"], r["run"])):
        out.setdefault(r["t"], []).append((r["run"], r["n"]))
    return out


def duck(ds: Path, table: str) -> str:
    return (f"read_parquet('{ds}/{table}/*/*.parquet', hive_partitioning = true, "
            "hive_types = {'run': VARCHAR})")


def test_duckdb_reads_every_table(ds: Path, counts: dict[str, list[tuple[str, int]]]) -> None:
    con = duckdb.connect()
    for table, cols in documented().items():
        if table not in (RUNS_TABLE, *EXPORT_TABLES):
            continue
        got = con.execute(f"DESCRIBE SELECT * FROM {duck(ds, table)}").fetchall()
        assert [(c, k) for c, k, *_ in got] == [*cols, ("run", "VARCHAR")], table
        got = con.execute(f"SELECT run, count(*) FROM {duck(ds, table)} GROUP BY run "
                          "ORDER BY run").fetchall()
        assert got == counts.get(table, []), table
    assert sorted(r for (r,) in con.execute(
        f"SELECT run FROM {duck(ds, RUNS_TABLE)}").fetchall()) == RUNS


def test_polars_reads_every_table(ds: Path, counts: dict[str, list[tuple[str, int]]]) -> None:
    for table, cols in documented().items():
        if table not in (RUNS_TABLE, *EXPORT_TABLES):
            continue
        frame = pl.scan_parquet(f"{ds}/{table}/*/*.parquet", hive_partitioning=True,
                                hive_schema={"run": pl.String}).collect()
        assert dict(frame.schema) == {**{c: POLARS[k] for c, k in cols}, "run": pl.String}, \
            table
        got = frame.group_by("run").len().sort("run").rows()
        assert got == counts.get(table, []), table


# docs/dataset.md's queries, as each engine writes them
PER_RUN = ("SELECT run, count(*) AS calls, sum(size) AS bytes FROM allocations "
           "GROUP BY run ORDER BY run")


def test_the_same_queries_in_every_engine(ds: Path) -> None:
    want = sorted((r["run"], r["calls"], r["bytes"]) for r in query(ds, PER_RUN))
    assert [r for r, *_ in want] == RUNS
    con = duckdb.connect()
    assert sorted(con.execute(PER_RUN.replace("allocations", duck(ds, "allocations"))
                              ).fetchall()) == want
    alloc = pl.scan_parquet(f"{ds}/allocations/*/*.parquet", hive_partitioning=True,
                            hive_schema={"run": pl.String})
    got = alloc.group_by("run").agg(pl.len(), pl.col("size").sum()).sort("run").collect()
    assert got.rows() == want
    # the root process's peak heap per run, in time order (runs: their start)
    peak_sql = """SELECT r.run, r.start_time, h.peak_bytes
        FROM runs r JOIN processes p ON p.run = r.run AND p.pid = r.root_pid
        JOIN heap_peak h ON h.run = p.run AND h.pid = p.pid ORDER BY r.start_time, r.run"""
    want = [(r["run"], r["peak_bytes"]) for r in query(ds, peak_sql)]
    assert len(want) == 3
    sql = peak_sql
    for t in ("runs", "processes", "heap_peak"):
        sql = sql.replace(f" {t} ", f" {duck(ds, t)} ")
    assert [(r, b) for r, _, b in con.execute(sql).fetchall()] == want

    def scan(t: str) -> Any:
        return pl.scan_parquet(f"{ds}/{t}/*/*.parquet", hive_partitioning=True,
                               hive_schema={"run": pl.String})

    got = (scan("runs").join(scan("processes"), left_on=["run", "root_pid"],
                             right_on=["run", "pid"])
           .join(scan("heap_peak"), left_on=["run", "root_pid"], right_on=["run", "pid"])
           .sort(["start_time", "run"]).select("run", "peak_bytes").collect())
    assert got.rows() == want
    # a stack hash above 2^63, exact
    sql = "SELECT max(stack_hash)::VARCHAR AS h FROM stacks"
    assert query(ds, sql) == [{"h": str(BIG_HASH)}]
    assert con.execute(sql.replace("stacks", duck(ds, "stacks"))).fetchone()[0] == str(BIG_HASH)
    assert scan("stacks").select(pl.col("stack_hash").max()).collect().item() == BIG_HASH


def test_a_copy_of_the_dataset_is_the_dataset(ds: Path, tmp_path: Path) -> None:
    """Nothing in the files names where the dataset lies: moved, it reads the same."""
    moved = tmp_path / "moved"
    shutil.copytree(ds, moved)
    assert query(moved, PER_RUN) == query(ds, PER_RUN)
