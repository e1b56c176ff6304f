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
reader). A dataset lies in a local directory (a path: every entry checked on the way,
no symbolic link followed) or behind a URI (`s3://bucket/dir`, `gs://`, `file:///dir`:
`Remote`, read and written through pyarrow's filesystems); `where` tells them apart.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from memtrack.schema.ddl import (
    EXPORT_TABLES,
    SCHEMA_VERSION,
    VIEWS,
    first_line,
    lock,
    reading_session,
)

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
    ("attached", pa.list_(pa.uint32())),  # capture --pid: the pids attached to; [] spawned
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


@dataclass(frozen=True)
class Remote:
    """A dataset behind a URI: a pyarrow filesystem (S3, GCS, local for `file://`...)
    and the dataset's directory in it."""

    fs: pafs.FileSystem
    path: str
    uri: str

    def __str__(self) -> str:
        return self.uri

    def join(self, *names: str) -> str:
        return "/".join([self.path.rstrip("/"), *names])


Location = Path | Remote


def where(dataset: str | Path | Remote) -> Location:
    """Where a dataset lies: a local directory (a path), or a URI (`scheme://...`)
    opened through pyarrow's filesystems (DatasetError when it cannot be)."""
    if isinstance(dataset, (Path, Remote)):
        return dataset
    if "://" not in dataset:
        return Path(dataset)
    try:
        fs, path = pafs.FileSystem.from_uri(dataset)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DatasetError(f"{dataset}: {first_line(e)}") from None
    return Remote(fs, path, dataset)


def partition(root: Location, table: str, run_id: str) -> Path | str:
    """The directory of one run's file of one table."""
    if isinstance(root, Remote):
        return root.join(table, f"{PARTITION}={run_id}")
    return Path(root) / table / f"{PARTITION}={run_id}"


def data_file(root: Location | str, table: str, run_id: str) -> Path | str | None:
    """One run's file of one table, or None where there is none. A dataset is hostile
    input as an artifact is: every entry below `root` on the way must be a directory or,
    the last, a regular file, never a symbolic link (DatasetError)."""
    root = where(root)
    if isinstance(root, Remote):
        if isinstance(root.fs, pafs.LocalFileSystem):  # file://: the local rules
            found = data_file(Path(root.path), table, run_id)
            return None if found is None else str(found)
        path = root.join(table, f"{PARTITION}={run_id}", DATA_FILE)
        kind = _info(root, path).type
        if kind == pafs.FileType.NotFound:
            return None
        if kind != pafs.FileType.File:
            raise DatasetError(f"{root.uri}: {path} is not a file")
        return path
    path = Path(root)
    names = (table, f"{PARTITION}={run_id}", DATA_FILE)
    for i, name in enumerate(names):
        path = path / name
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DatasetError(f"{path}: {e.strerror or e}") from None
        want = stat.S_ISREG if i == len(names) - 1 else stat.S_ISDIR
        if not want(mode):
            raise DatasetError(f"{path}: not a {'file' if want is stat.S_ISREG else 'directory'}"
                               " of this dataset (a symbolic link, or another kind of file)")
    return path


def _info(root: Remote, path: str) -> pafs.FileInfo:
    try:
        return root.fs.get_file_info(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{root.uri}: {first_line(e)}") from None


def run_ids(root: Location | str) -> list[str]:
    """The runs of a dataset (those whose `runs` file exists), sorted."""
    root = where(root)
    if isinstance(root, Remote) and isinstance(root.fs, pafs.LocalFileSystem):
        root = Path(root.path)  # file://: the local rules
    if isinstance(root, Remote):
        if _info(root, root.join(RUNS_TABLE)).type != pafs.FileType.Directory:
            raise DatasetError(f"{root}: not a memtrack dataset (no {RUNS_TABLE}/ directory)")
        return sorted(_remote_files(root, RUNS_TABLE))
    runs = Path(root) / RUNS_TABLE
    if runs.is_symlink() or not runs.is_dir():
        raise DatasetError(f"{root}: not a memtrack dataset (no {RUNS_TABLE}/ directory)")
    prefix = f"{PARTITION}="
    ids = (d.name[len(prefix):] for d in runs.iterdir() if d.name.startswith(prefix))
    return sorted(i for i in ids if RUN_ID.fullmatch(i) and data_file(root, RUNS_TABLE, i))


def _remote_files(root: Remote, table: str) -> dict[str, str]:
    """A table's files in a dataset on object storage, by run: one listing (not a
    request per run)."""
    try:
        entries = root.fs.get_file_info(pafs.FileSelector(root.join(table), recursive=True,
                                                          allow_not_found=True))
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{root}: {first_line(e)}") from None
    out = {}
    for e in entries:
        parts = e.path.rsplit("/", 2)
        if e.type == pafs.FileType.File and len(parts) == 3 and parts[2] == DATA_FILE \
                and parts[1].startswith(f"{PARTITION}="):
            run = parts[1][len(PARTITION) + 1:]
            if RUN_ID.fullmatch(run):
                out[run] = e.path
    return out


def _fs(root: Location) -> pafs.FileSystem | None:
    return root.fs if isinstance(root, Remote) else None


def _table_dir(root: Location, table: str) -> Path | str:
    return root.join(table) if isinstance(root, Remote) else root / table


def _arrow(files: list[Path | str], partitioned: Path | str | None = None,
           fs: pafs.FileSystem | None = None) -> ds.Dataset:
    """The Parquet files of one table as one pyarrow dataset: DuckDB reads it through
    pyarrow, never a file itself. `partitioned`: the table's directory, whose hive
    partition `run` becomes a column; a file that lacks a column another has reads as
    nulls there. `fs`: the files' filesystem (a Remote dataset's)."""
    schemas = []
    for f in files:
        try:
            schemas.append(pq.read_schema(str(f), filesystem=fs))
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{f}: {first_line(e)}") from None
    try:
        schema = pa.unify_schemas(schemas)
        if partitioned is None:
            return ds.dataset(list(map(str, files)), schema=schema, format="parquet",
                              filesystem=fs)
        hive = ds.partitioning(pa.schema([(PARTITION, pa.string())]), flavor="hive")
        return ds.dataset(list(map(str, files)), format="parquet", partitioning=hive,
                          partition_base_dir=str(partitioned), filesystem=fs,
                          schema=pa.unify_schemas([schema, hive.schema]))
    except (OSError, pa.ArrowException) as e:  # a column of two types in two runs
        raise DatasetError(f"{partitioned or files[0]}: {first_line(e)}") from None


def open_dataset(root: Location | str, *, files: bool = False,
                 tables: tuple[str, ...] = (RUNS_TABLE, *EXPORT_TABLES),
                 runs: list[str] | None = None) -> duckdb.DuckDBPyConnection:
    """A locked reading session (memtrack.schema.ddl: no file access unless `files`)
    with a view per table across every run of the dataset (or of `tables`, over `runs`
    of it), each with its `run` column (VARCHAR), `runs` among them."""
    root = where(root)
    ids = run_ids(root)
    if runs is not None:
        ids = sorted(set(ids) & set(runs))
    if not ids:
        raise DatasetError(f"{root}: the dataset holds no run yet")
    con = reading_session()
    try:
        for name in tables:
            if isinstance(root, Remote) and not isinstance(root.fs, pafs.LocalFileSystem):
                listed = _remote_files(root, name)
                found = [listed[i] for i in ids if i in listed]
            else:
                found = [f for i in ids if (f := data_file(root, name, i)) is not None]
            if found:
                con.register(name, _arrow(found, _table_dir(root, name), _fs(root)))
        lock(con, files=files)
    except BaseException:
        con.close()
        raise
    return con


def open_dataset_run(root: Location | str, run_id: str) -> duckdb.DuckDBPyConnection:
    """One run of the dataset as a run database: a locked reading session without file
    access, with its tables and the run database's views (memtrack.schema.ddl), for
    the run reader."""
    root = where(root)
    if run_id not in run_ids(root):
        raise DatasetError(f"{root}: no run {run_id!r} in this dataset")
    con = reading_session()
    try:
        for name in EXPORT_TABLES:
            f = data_file(root, name, run_id)
            if f is None:
                raise DatasetError(f"{partition(root, name, run_id)}/{DATA_FILE}: missing "
                                   f"(the run's {name} table)")
            # rss_timeline orders a process's updates by (ts, rowid): rss is a table in
            # the file's order; the others are read where they lie
            con.register(f"{name}_file" if name == "rss" else name, _arrow([f], fs=_fs(root)))
            if name == "rss":
                with _reading(f):
                    con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_file")
                con.unregister(f"{name}_file")
            if name == "meta":  # first: a run of another format may lack a table
                with _reading(f):
                    version = con.execute(
                        "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if not version or version[0] != str(SCHEMA_VERSION):
                    raise DatasetError(
                        f"{root}: run {run_id!r} is in run database format "
                        f"{version[0] if version else '?'}, this memtrack reads "
                        f"{SCHEMA_VERSION}; re-run `memtrack process --dataset` on its "
                        "artifact")
        with _reading(root):
            con.execute(VIEWS)
        lock(con)
    except BaseException:
        con.close()
        raise
    return con


@contextmanager
def _reading(place: Location | str) -> Iterator[None]:
    """DuckDB's errors on the dataset's files (a damaged or foreign file) as one line."""
    try:
        yield
    except duckdb.Error as e:
        raise DatasetError(f"{place}: {first_line(e)}") from None
