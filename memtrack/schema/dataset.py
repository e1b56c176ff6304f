"""The run dataset: many runs of `memtrack process` as one Parquet dataset, partitioned
in the hive layout, which Spark, Trino, DuckDB, pyarrow and polars read as is. A table's
directory has one of two layouts:

    DIR/TABLE/run=RUN_ID/data.parquet           by run: `run` in the paths only
    DIR/TABLE/_batched                          in batches: `run` in the files only
    DIR/TABLE/batch=RUN_ID/data.parquet           a run appended after a compaction
    DIR/TABLE/batch=_cSTAMP/data_N.parquet        the runs one compaction merged

one directory per table of the run database (ddl.EXPORT_TABLES, as `--parquet` writes
them) and `runs` (one row per run: RUNS). Every table starts by run; `memtrack compact`
(memtrack.process.dataset) turns a table into batches, whole (its directory exchanged
for the new one in one rename), and appends follow the table's layout. A run belongs to
the dataset once its `runs` row exists: the writer renames every table's file into
place first and the `runs` file last, and removes the `runs` file first when it replaces
a run, so a reader that keeps to the runs listed in `runs` never sees half a run.
docs/dataset.md documents the layout for other engines.

Here are the readers: `open_dataset` (every run, one view per table with its `run`
column) and `open_dataset_run` (one run, with the run database's views, for the run
reader). Each lists a table's directory once and reads one file's schema per run
database format (`runs.schema_version`) and per compacted file, not every file's. A
dataset lies in a local directory (a path: every entry checked on the way, no symbolic
link followed) or behind a URI (`s3://bucket/dir`, `gs://`, `file:///dir`: `Remote`,
read and written through pyarrow's filesystems); `where` tells them apart.
"""
from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from memtrack.schema.ddl import (
    EXPORT_TABLES,
    PYTHON_FOLDED,
    PYTHON_ONLY,
    SCHEMA_VERSION,
    VIEWS,
    derive,
    first_line,
    lock,
    reading_session,
    sql_literal,
)

PARTITION = "run"
BATCH = "batch"  # a batched table's partition: one run appended, or the runs of a compaction
BATCHED = "_batched"  # in a table's directory: the table is in batches (engines skip `_` names)
COMPACTED = "_c"  # a compacted batch's name starts so (a run id cannot)
COMPACTED_NAME = re.compile(r"_c[0-9A-Za-z-]{1,64}")
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



def local(root: Location) -> Location:
    """A `file://` dataset as its path (the local rules: no symbolic link followed)."""
    if isinstance(root, Remote) and isinstance(root.fs, pafs.LocalFileSystem):
        return Path(root.path)
    return root


def partition(root: Location, table: str, run_id: str, batched: bool = False) -> Path | str:
    """The directory of one run's own file of one table (by run, or in batches)."""
    name = f"{BATCH if batched else PARTITION}={run_id}"
    if isinstance(root, Remote):
        return root.join(table, name)
    return Path(root) / table / name


def _not_ours(path: Path | str, kind: str) -> DatasetError:
    return DatasetError(f"{path}: not a {kind} of this dataset (a symbolic link, or another "
                        "kind of file)")


def _exists_as(path: Path | str, kind: str) -> bool:
    """Whether `path` is a `kind` ("file" or "directory", not through a link): False
    where nothing is; DatasetError where it cannot be read or is anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:
        raise DatasetError(f"{path}: {e.strerror or e}") from None
    if not (stat.S_ISREG(mode) if kind == "file" else stat.S_ISDIR(mode)):
        raise _not_ours(path, kind)
    return True


def _partition_name(name: str) -> tuple[str, str] | None:
    """`run=ID` or `batch=ID|_cSTAMP` as (key, value); None for any other name."""
    key, sep, value = name.partition("=")
    if sep and (key in (PARTITION, BATCH) and RUN_ID.fullmatch(value)
                or key == BATCH and COMPACTED_NAME.fullmatch(value)):
        return key, value
    return None


@dataclass
class TableFiles:
    """One table's directory of a dataset as listed once: its layout, each run's own
    partition (run=ID or batch=ID) and the files of its compacted batches."""

    where: Path | str
    remote: bool = False
    batched: bool = False
    own: dict[str, str] = field(default_factory=dict)  # the file (remote), the directory
    not_dirs: set[str] = field(default_factory=set)  # local: own entries that are no directory
    compacted: list[str] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)

    def file(self, run: str) -> str | None:
        """The run's own file, or None. Locally every entry on the way must be a
        directory or, the last, a regular file, never a symbolic link (DatasetError)."""
        part = self.own.get(run)
        if part is None or self.remote:  # object storage: the file as listed
            return part
        if run in self.not_dirs:
            raise _not_ours(part, "directory")
        f = os.path.join(part, DATA_FILE)
        return f if _exists_as(f, "file") else None

    def check(self) -> TableFiles:
        other = PARTITION if self.batched else BATCH
        if other in self.keys:
            raise DatasetError(f"{self.where}: holds {other}= partitions in a table "
                               f"{'in batches' if self.batched else 'by run'}")
        self.compacted.sort(key=lambda f: (os.path.dirname(f), len(f), f))
        return self


def list_table(root: Location, table: str) -> TableFiles | None:
    """A table's directory listed (one listing), or None where there is none."""
    root = local(root)
    if isinstance(root, Remote):
        return _list_remote(root, table)
    d = Path(root) / table
    if not _exists_as(d, "directory"):
        return None
    tf = TableFiles(d)
    with os.scandir(d) as entries:
        for e in entries:
            if e.name == BATCHED:
                tf.batched = True
                continue
            kv = _partition_name(e.name)
            if kv is None:
                continue
            tf.keys.add(kv[0])
            if kv[1].startswith(COMPACTED):
                if not e.is_dir(follow_symlinks=False):
                    raise _not_ours(e.path, "directory")
                with os.scandir(e.path) as files:
                    for f in files:
                        if f.name.endswith(".parquet") and not f.name.startswith("."):
                            if not f.is_file(follow_symlinks=False):
                                raise _not_ours(f.path, "file")
                            tf.compacted.append(f.path)
            else:
                tf.own[kv[1]] = e.path
                if not e.is_dir(follow_symlinks=False):
                    tf.not_dirs.add(kv[1])
    return tf.check()


def _list_remote(root: Remote, table: str) -> TableFiles | None:
    """A table's files on object storage: one listing (not a request per run)."""
    base = root.join(table)
    try:
        entries = root.fs.get_file_info(pafs.FileSelector(base, recursive=True,
                                                          allow_not_found=True))
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{root}: {first_line(e)}") from None
    if not entries:
        return None
    tf = TableFiles(base, remote=True)
    for e in entries:
        rel = e.path[len(base) + 1:].split("/")
        if rel == [BATCHED]:
            tf.batched = True
            continue
        kv = _partition_name(rel[0]) if len(rel) == 2 else None
        if kv is None:
            continue
        tf.keys.add(kv[0])
        ours = rel[1].endswith(".parquet") and not rel[1].startswith(".") \
            if kv[1].startswith(COMPACTED) else rel[1] == DATA_FILE
        if not ours:
            continue
        if e.type != pafs.FileType.File:
            raise DatasetError(f"{root.uri}: {e.path} is not a file")
        if kv[1].startswith(COMPACTED):
            tf.compacted.append(e.path)
        else:
            tf.own[kv[1]] = e.path
    return tf.check()


def _fs(root: Location) -> pafs.FileSystem | None:
    root = local(root)
    return root.fs if isinstance(root, Remote) else None


def file_schema(f: str, fs: pafs.FileSystem | None) -> pa.Schema:
    try:
        return pq.read_schema(f, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{f}: {first_line(e)}") from None


def table_dataset(tf: TableFiles, files: list[str], schemas: list[pa.Schema],
           fs: pafs.FileSystem | None, partitioned: bool = True) -> ds.Dataset:
    """The Parquet files of one table as one pyarrow dataset of the union of `schemas`
    (a file that lacks a column another has reads as nulls there): DuckDB reads it
    through pyarrow, never a file itself. A table by run gets its `run` column from the
    paths (`partitioned`); a batched table has it in the files."""
    try:
        schema = pa.unify_schemas(schemas)
        if tf.batched or not partitioned:
            return ds.dataset(files, schema=schema, format="parquet",
                              filesystem=fs)
        hive = ds.partitioning(pa.schema([(PARTITION, pa.string())]), flavor="hive")
        return ds.dataset(files, format="parquet", partitioning=hive,
                          partition_base_dir=str(tf.where), filesystem=fs,
                          schema=pa.unify_schemas([schema, hive.schema]))
    except (OSError, pa.ArrowException) as e:  # a column of two types in two runs
        raise DatasetError(f"{tf.where}: {first_line(e)}") from None


class Listing:
    """A dataset's tables, each listed once when first asked for, and its runs (those
    with a `runs` row) with their run database format."""

    def __init__(self, root: Location | str) -> None:
        self.root = local(where(root))
        self.fs = _fs(self.root)
        self._tables: dict[str, TableFiles | None] = {}
        self._runs: dict[str, int] | None = None

    def table(self, name: str) -> TableFiles | None:
        if name not in self._tables:
            self._tables[name] = list_table(self.root, name)
        return self._tables[name]

    def runs(self) -> dict[str, int]:
        """Run id -> its `runs.schema_version`, for every run of the dataset: the `runs`
        files read (two columns), not their schemas."""
        if self._runs is not None:
            return self._runs
        tf = self.table(RUNS_TABLE)
        if tf is None:
            raise DatasetError(f"{self.root}: not a memtrack dataset (no {RUNS_TABLE}/ "
                               "directory)")
        files = [f for r in sorted(tf.own) if (f := tf.file(r)) is not None] + tf.compacted
        self._runs = {}
        if files:
            known = RUNS.append(pa.field(PARTITION, pa.string())) if tf.batched else RUNS
            rows = _read(table_dataset(tf, files, [known], self.fs),
                         [PARTITION, "schema_version"], tf.where)
            self._runs = dict(zip(rows[PARTITION].to_pylist(),
                                  rows["schema_version"].to_pylist(), strict=True))
        return self._runs

    def files(self, tf: TableFiles, ids: list[str], compacted: bool = True
              ) -> tuple[list[str], list[pa.Schema]]:
        """The files of the runs `ids` of a table (and its compacted files whole) and the
        schemas they have: one read per run database format, and each compacted file's."""
        versions = self.runs()
        files, schemas, seen = [], [], set()
        for r in ids:
            f = tf.file(r)
            if f is None:
                continue
            files.append(f)
            if versions.get(r) not in seen:
                seen.add(versions.get(r))
                schemas.append(file_schema(f, self.fs))
        for f in tf.compacted if compacted else ():
            files.append(f)
            schemas.append(file_schema(f, self.fs))
        return files, schemas


def _read(dataset: ds.Dataset, columns: list[str], place: Path | str) -> pa.Table:
    try:
        return dataset.to_table(columns=columns)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{place}: {first_line(e)}") from None


def run_ids(root: Location | str) -> list[str]:
    """The runs of a dataset (those with a `runs` row), sorted."""
    return sorted(Listing(root).runs())


def open_dataset(root: Location | str, *, files: bool = False,
                 tables: tuple[str, ...] = (RUNS_TABLE, *EXPORT_TABLES),
                 runs: list[str] | None = None) -> duckdb.DuckDBPyConnection:
    """A locked reading session (memtrack.schema.ddl: no file access unless `files`)
    with a view per table across every run of the dataset (or of `tables`, over `runs`
    of it), each with its `run` column (VARCHAR), `runs` among them."""
    listing = Listing(root)
    ids = sorted(listing.runs())
    if runs is not None:
        ids = sorted(set(ids) & set(runs))
    if not ids:
        raise DatasetError(f"{listing.root}: the dataset holds no run yet")
    con = reading_session()
    try:
        for name in tables:
            tf = listing.table(name)
            if tf is None:
                continue
            found, schemas = listing.files(tf, ids)
            if not found:
                continue
            dataset = table_dataset(tf, found, schemas, listing.fs)
            if tf.compacted:  # rows of every run compacted: only those of `ids`
                _expose(con, name, dataset, "run IN (" + ", ".join(map(sql_literal, ids)) + ")")
            else:
                con.register(name, dataset)
        lock(con, files=files)
    except BaseException:
        con.close()
        raise
    return con


def _expose(con: duckdb.DuckDBPyConnection, name: str, dataset: ds.Dataset, where_sql: str,
            exclude: str = "") -> None:
    """The table `name` as the rows of `dataset` that `where_sql` keeps."""
    con.register(f"{name}_files", dataset)
    con.execute(f"CREATE VIEW {name} AS SELECT * {exclude} FROM {name}_files "
                f"WHERE {where_sql}")


def open_dataset_run(root: Location | str, run_id: str,
                     python_only: bool = False) -> duckdb.DuckDBPyConnection:
    """One run of the dataset as a run database: a locked reading session without file
    access, with its tables and the run database's views (memtrack.schema.ddl), for
    the run reader; `python_only`: its stacks in the Python view (ddl.PYTHON_ONLY)."""
    listing = Listing(root)
    root = listing.root
    if run_id not in listing.runs():
        raise DatasetError(f"{root}: no run {run_id!r} in this dataset")
    con = reading_session()
    try:
        for name in EXPORT_TABLES:
            tf = listing.table(name)
            f = None if tf is None else tf.file(run_id)
            if tf is None or f is None and not tf.compacted:
                raise DatasetError(f"{partition(root, name, run_id)}/{DATA_FILE}: missing "
                                   f"(the run's {name} table)")
            found = [f] if f is not None else tf.compacted
            schemas = [file_schema(x, listing.fs) for x in found]
            dataset = table_dataset(tf, found, schemas, listing.fs, partitioned=False)
            # rss_timeline orders a process's updates by (ts, rowid): rss is a table in
            # the file's order; the others are read where they lie
            source = (f"{name}_file" if name == "rss" else
                      f"native_{name}" if python_only and name in PYTHON_FOLDED else name)
            if tf.batched:
                _expose(con, source, dataset, f"run = {sql_literal(run_id)}",
                        f"EXCLUDE ({PARTITION})")
            else:
                con.register(source, dataset)
            if name == "rss":
                with _reading(found[0]):
                    con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_file")
            if name == "meta":  # first: a run of another format may lack a table
                with _reading(found[0]):
                    version = con.execute(
                        "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if not version or version[0] != str(SCHEMA_VERSION):
                    raise DatasetError(
                        f"{root}: run {run_id!r} is in run database format "
                        f"{version[0] if version else '?'}, this memtrack reads "
                        f"{SCHEMA_VERSION}; re-run `memtrack process --dataset` on its "
                        "artifact")
        with _reading(root):
            if python_only:
                con.execute(PYTHON_ONLY.replace("{source}", "native_"))
            con.execute(VIEWS)
            if python_only:
                derive(con, "backtraces")
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
