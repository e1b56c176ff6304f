"""The run dataset: many runs of `memtrack process` as one Parquet dataset, partitioned
by run in the hive layout, which Spark, Trino, DuckDB, pyarrow and polars read as is:

    DIR/TABLE/run=RUN_ID/data.parquet

one directory per table of the run database (ddl.EXPORT_TABLES, as `--parquet` writes
them) and `runs` (one row per run: RUNS). The partition column `run` is in the paths
only, never in the files. A run belongs to the dataset once its `runs` file exists:
the writer (memtrack.process.dataset) renames every table's file into place first and
the `runs` file last, and removes the `runs` file first when it replaces a run, so a
reader that keeps to the runs listed in `runs` never sees half a run. docs/dataset.md
documents the layout for other engines.

Here are the readers: `open_dataset` (every run, one view per table with its `run`
column) and `open_dataset_run` (one run, with the run database's views, for the run
reader).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa

from memtrack.schema.ddl import EXPORT_TABLES, SCHEMA_VERSION, VIEWS, connect, first_line

PARTITION = "run"
RUNS_TABLE = "runs"
DATA_FILE = "data.parquet"
# A run id is a path segment and a hive partition value that needs no escaping.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# One row per run (and `run` from its path): what a fleet filters and orders runs by.
RUNS = pa.schema([
    ("labels", pa.map_(pa.string(), pa.string())),  # process --label key=value
    ("command", pa.list_(pa.string())),
    ("hostname", pa.string()),
    ("kernel", pa.string()),
    ("arch", pa.string()),
    ("start_time", pa.timestamp("us", tz="UTC")),  # wall clock of the capture's start
    ("end_time", pa.timestamp("us", tz="UTC")),
    ("exit_code", pa.int32()),
    ("exit_signal", pa.int32()),
    ("root_pid", pa.uint32()),
    ("artifact", pa.string()),  # the artifact processed, as `process` was given it
    ("memtrack_version", pa.string()),  # of the capture
    ("schema_version", pa.int32()),  # the run database format of the tables
    ("processed_at", pa.timestamp("us", tz="UTC")),
    ("memory_metadata", pa.string()),  # memory_metadata.json of the run
])


class DatasetError(Exception):
    """A dataset or run that cannot be used, worded for one line."""


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise DatasetError(
            f"run id {run_id!r}: use letters, digits, '.', '_' and '-' (at most 128, "
            "starting with a letter or digit)")
    return run_id


def partition(root: Path, table: str, run_id: str) -> Path:
    """The directory of one run's file of one table."""
    return Path(root) / table / f"{PARTITION}={run_id}"


def run_ids(root: Path) -> list[str]:
    """The runs of a dataset (those whose `runs` file exists), sorted."""
    runs = Path(root) / RUNS_TABLE
    if not runs.is_dir():
        raise DatasetError(f"{root}: not a memtrack dataset (no {RUNS_TABLE}/ directory)")
    prefix = f"{PARTITION}="
    return sorted(d.name[len(prefix):] for d in runs.iterdir()
                  if d.name.startswith(prefix) and (d / DATA_FILE).is_file())


def _literal(path: Path | str) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def open_dataset(root: Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB session with a view per table across every run of the
    dataset, each with its `run` column (VARCHAR), `runs` among them."""
    root = Path(root)
    if not run_ids(root):
        raise DatasetError(f"{root}: the dataset holds no run yet")
    con = connect()
    with _reading(con, root):
        con.execute(f"CREATE VIEW {RUNS_TABLE} AS SELECT * FROM {_scan(root, RUNS_TABLE)}")
        for name in EXPORT_TABLES:
            if any((root / name).glob(f"{PARTITION}=*/{DATA_FILE}")):
                con.execute(f"""
                    CREATE VIEW {name} AS SELECT * FROM {_scan(root, name)}
                    WHERE {PARTITION} IN (SELECT {PARTITION} FROM {RUNS_TABLE})""")
    return con


@contextmanager
def _reading(con: duckdb.DuckDBPyConnection, where: Path) -> Iterator[None]:
    """DuckDB's errors on the dataset's files (a damaged or foreign file) as one line."""
    try:
        yield
    except duckdb.Error as e:
        con.close()
        raise DatasetError(f"{where}: {first_line(e)}") from None


def _scan(root: Path, table: str) -> str:
    files = _literal(root / table / f"{PARTITION}=*" / DATA_FILE)
    return (f"read_parquet({files}, hive_partitioning = true, union_by_name = true, "
            f"hive_types = {{'{PARTITION}': VARCHAR}})")


def open_dataset_run(root: Path, run_id: str) -> duckdb.DuckDBPyConnection:
    """One run of the dataset as a run database: an in-memory DuckDB session with its
    tables (views over its files) and the run database's views (memtrack.schema.ddl),
    for the run reader."""
    root = Path(root)
    if run_id not in run_ids(root):
        raise DatasetError(f"{root}: no run {run_id!r} in this dataset")
    con = connect()
    for name in EXPORT_TABLES:
        f = partition(root, name, run_id) / DATA_FILE
        if not f.is_file():
            con.close()
            raise DatasetError(f"{f}: missing (the run's {name} table)")
        scan = f"read_parquet({_literal(f)}, hive_partitioning = false)"
        # rss_timeline orders a process's updates by (ts, rowid): a table keeps the
        # file's order as its rowid; the others are read where they lie
        kind = "TABLE" if name == "rss" else "VIEW"
        with _reading(con, f):
            con.execute(f"CREATE {kind} {name} AS SELECT * FROM {scan}")
    with _reading(con, partition(root, "meta", run_id) / DATA_FILE):
        version = con.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if not version or version[0] != str(SCHEMA_VERSION):
        con.close()
        raise DatasetError(
            f"{root}: run {run_id!r} is in run database format "
            f"{version[0] if version else '?'}, this memtrack reads {SCHEMA_VERSION}; "
            "re-run `memtrack process --dataset` on its artifact")
    with _reading(con, root):
        con.execute(VIEWS)
    return con
