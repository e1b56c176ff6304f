"""The run dataset read by the engines docs/dataset.md names, on a dataset of three
synthetic runs (one with a stack hash above 2^63), as appended (tables by run) and
compacted (tables in batches): DuckDB (read_parquet with the hive partition, not
memtrack's session), polars and Apache Spark (pyspark, local mode) read every table
with the documented types and its `run`, row for row, and the documented queries give
what `memtrack query --dataset` gives."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest
from support.runs import add_run, run_id
from support.synth import write_run
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.process.dataset import append_run, compact
from memtrack.schema.dataset import BATCH, RUNS_TABLE
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
# docs/dataset.md's types: DuckDB type -> Spark type
SPARK = {
    "UBIGINT": "decimal(20,0)", "UINTEGER": "bigint", "USMALLINT": "int", "UTINYINT": "smallint",
    "BIGINT": "bigint", "INTEGER": "int", "BOOLEAN": "boolean", "VARCHAR": "string",
    "DOUBLE": "double", "VARCHAR[]": "array<string>", "UINTEGER[]": "array<bigint>",
    "MAP(VARCHAR, VARCHAR)": "map<string,string>", "TIMESTAMP WITH TIME ZONE": "timestamp"}
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


@pytest.fixture(scope="module", params=["by run", "compacted"])
def ds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
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
    if request.param == "compacted":
        compact(ds)
    return ds


def batches(ds: Path) -> list[tuple[str, str]]:
    """The partition a table in batches has beside `run` (docs/dataset.md)."""
    return [(BATCH, "VARCHAR")] if (ds / "processes" / "_batched").exists() else []


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
            "hive_types_autocast = false)")


def test_duckdb_reads_every_table(ds: Path, counts: dict[str, list[tuple[str, int]]]) -> None:
    con = duckdb.connect()
    for table, cols in documented().items():
        if table not in (RUNS_TABLE, *EXPORT_TABLES):
            continue
        got = con.execute(f"DESCRIBE SELECT * FROM {duck(ds, table)}").fetchall()
        assert [(c, k) for c, k, *_ in got] == [*cols, ("run", "VARCHAR"), *batches(ds)], table
        got = con.execute(f"SELECT run, count(*) FROM {duck(ds, table)} GROUP BY run "
                          "ORDER BY run").fetchall()
        assert got == counts.get(table, []), table
    assert sorted(r for (r,) in con.execute(
        f"SELECT run FROM {duck(ds, RUNS_TABLE)}").fetchall()) == RUNS


def test_polars_reads_every_table(ds: Path, counts: dict[str, list[tuple[str, int]]]) -> None:
    for table, cols in documented().items():
        if table not in (RUNS_TABLE, *EXPORT_TABLES):
            continue
        frame = scan(ds, table).collect()
        assert dict(frame.schema) == {**{c: POLARS[k] for c, k in cols}, "run": pl.String}, \
            table
        got = frame.group_by("run").len().sort("run").rows()
        assert got == counts.get(table, []), table


def scan(ds: Path, table: str) -> Any:
    """A table as polars reads it (docs/dataset.md): without a batch's name."""
    return pl.scan_parquet(f"{ds}/{table}/*/*.parquet", hive_partitioning=True,
                           hive_schema={"run": pl.String, BATCH: pl.String}
                           ).drop(BATCH, strict=False)


# docs/dataset.md's queries, as each engine writes them
PER_RUN = ("SELECT run, count(*) AS calls, sum(size) AS bytes FROM allocations "
           "GROUP BY run ORDER BY run")


def test_the_same_queries_in_every_engine(ds: Path) -> None:
    want = sorted((r["run"], r["calls"], r["bytes"]) for r in query(ds, PER_RUN))
    assert [r for r, *_ in want] == RUNS
    con = duckdb.connect()
    assert sorted(con.execute(PER_RUN.replace("allocations", duck(ds, "allocations"))
                              ).fetchall()) == want
    got = (scan(ds, "allocations").group_by("run").agg(pl.len(), pl.col("size").sum())
           .sort("run").collect())
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

    got = (scan(ds, "runs").join(scan(ds, "processes"), left_on=["run", "root_pid"],
                                 right_on=["run", "pid"])
           .join(scan(ds, "heap_peak"), left_on=["run", "root_pid"], right_on=["run", "pid"])
           .sort(["start_time", "run"]).select("run", "peak_bytes").collect())
    assert got.rows() == want
    # a stack hash above 2^63, exact
    sql = "SELECT max(stack_hash)::VARCHAR AS h FROM stacks"
    assert query(ds, sql) == [{"h": str(BIG_HASH)}]
    assert con.execute(sql.replace("stacks", duck(ds, "stacks"))).fetchone()[0] == str(BIG_HASH)
    assert scan(ds, "stacks").select(pl.col("stack_hash").max()).collect().item() == BIG_HASH


def test_a_copy_of_the_dataset_is_the_dataset(ds: Path, tmp_path: Path) -> None:
    """Nothing in the files names where the dataset lies: moved, it reads the same."""
    moved = tmp_path / "moved"
    shutil.copytree(ds, moved)
    assert query(moved, PER_RUN) == query(ds, PER_RUN)


@pytest.fixture(scope="module")
def spark() -> Any:
    """One local Spark session for the module (2 threads, 2 shuffle partitions), set as
    docs/dataset.md says. pyspark and Java come from scripts/setup: missing, the tests
    skip, or fail under MEMTRACK_REQUIRE_BPF=1 (CI), as the BPF tests do."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        missing = "pyspark is not installed (scripts/setup installs the dev extras)"
    else:
        missing = None if shutil.which("java") else "no java (scripts/setup installs a JRE)"
    if missing:
        if os.environ.get("MEMTRACK_REQUIRE_BPF") == "1":
            pytest.fail(f"MEMTRACK_REQUIRE_BPF=1 but {missing}")
        pytest.skip(missing)
    session = (SparkSession.builder.master("local[2]").appName("memtrack-tests")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.codegen.wholeStage", "false")  # tiny data: no compiling
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def spark_views(spark: Any, ds: Path) -> None:
    for t in (RUNS_TABLE, *EXPORT_TABLES):
        spark.read.parquet(str(ds / t)).createOrReplaceTempView(t)


def test_spark_reads_every_table(spark: Any, ds: Path,
                                 counts: dict[str, list[tuple[str, int]]]) -> None:
    spark_views(spark, ds)
    for table, cols in documented().items():
        if table not in (RUNS_TABLE, *EXPORT_TABLES):
            continue
        frame = spark.table(table)
        got = [(f.name, f.dataType.simpleString()) for f in frame.schema.fields]
        assert got == [*((c, SPARK[k]) for c, k in cols), ("run", "string"),
                       *((c, "string") for c, _ in batches(ds))], table
    # one job: every table's run column (no shuffle), counted here
    sql = " UNION ALL ".join(f"SELECT '{t}' AS t, run FROM {t}"
                             for t in (RUNS_TABLE, *EXPORT_TABLES))
    got: dict[str, list[tuple[str, int]]] = {}
    for (t, run), n in sorted(Counter(tuple(r) for r in spark.sql(sql).collect()).items()):
        got.setdefault(t, []).append((run, n))
    assert got == counts


def test_spark_gives_what_query_gives(spark: Any, ds: Path) -> None:
    spark_views(spark, ds)
    want = sorted((r["run"], r["calls"], r["bytes"]) for r in query(ds, PER_RUN))
    got = [(r.run, r.calls, int(r.bytes)) for r in spark.sql(PER_RUN).collect()]
    assert got == want and [r for r, *_ in got] == RUNS
    peak_sql = """SELECT r.run, h.peak_bytes
        FROM runs r JOIN processes p ON p.run = r.run AND p.pid = r.root_pid
        JOIN heap_peak h ON h.run = p.run AND h.pid = p.pid ORDER BY r.start_time, r.run"""
    want_peak = [(r["run"], r["peak_bytes"]) for r in query(ds, peak_sql)]
    assert [tuple(r) for r in spark.sql(peak_sql).collect()] == want_peak
    (row,) = spark.sql("SELECT max(stack_hash) AS h FROM stacks").collect()
    assert int(row.h) == BIG_HASH  # DECIMAL(20,0): all 64 bits
