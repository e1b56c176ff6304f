"""`memtrack process --dataset DIR --run-id ID`: a run database appended to a run
dataset, every table as one Parquet file of the run's partition and the run's row of
`runs` last (memtrack.schema.dataset: the layout and its readers).

The files are written by DuckDB's COPY from the run database, as `--parquet` writes
them, each into a hidden staging directory of the dataset (its own, new) and renamed
into place: no engine reads a file whose name starts with a dot, and a rename is
atomic, so a reader sees a run's table whole or not at all. A dataset lives on shared
storage: its directories are opened one component at a time without following a
symbolic link, and the rename replaces a link, never what it points to.

A dataset behind a URI (memtrack.schema.dataset.Remote: object storage through
pyarrow's filesystems) is written the same way: each file written locally, uploaded
under a hidden staging directory of the dataset, then moved into place (a rename on a
local filesystem; on object storage a copy, which creates the object whole), the
`runs` file last, and removed first when a run is replaced.

Each table is written in its directory's layout: by run (`run=ID/`, `run` in the path)
or, once `compact` turned it into batches, as the run's own batch (`batch=ID/`, `run`
the file's last column). `compact` merges a local dataset's runs table by table (a new
directory built hidden, exchanged with the table's in one rename); appends hold the
dataset directory's lock shared, compact alone.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from memtrack.schema.dataset import (
    BATCH,
    BATCHED,
    COMPACTED,
    DATA_FILE,
    PARTITION,
    RUNS,
    RUNS_TABLE,
    DatasetError,
    Listing,
    Location,
    Remote,
    TableFiles,
    check_run_id,
    file_schema,
    list_table,
    local,
    partition,
    table_dataset,
    where,
)
from memtrack.schema.ddl import (
    EXPORT_TABLES,
    RunError,
    connect,
    first_line,
    open_run,
    sql_literal,
)


def copy_parquet(con: duckdb.DuckDBPyConnection, query: str, path: Path) -> None:
    """The rows of `query` as a zstd Parquet file at `path`."""
    con.execute(f"COPY ({query}) TO {sql_literal(path)} (FORMAT parquet, COMPRESSION zstd)")


def write_parquet(con: duckdb.DuckDBPyConnection, query: str, target: Path) -> None:
    """The rows of `query` as a zstd Parquet file at `target`, renamed into place."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        copy_parquet(con, query, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def open_directory(root_fd: int, root: Path, *names: str) -> int:
    """The directory `root/names...` (each created if missing) opened, one component at
    a time, never through a symbolic link (DatasetError)."""
    fd = os.dup(root_fd)
    path = root
    try:
        for name in names:
            path = path / name
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise DatasetError(f"{path}: not a directory of this dataset (a symbolic "
                                       "link, or another kind of file): nothing written "
                                       "through it") from None
                raise
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _compacted_runs(tf: TableFiles | None, fs: pafs.FileSystem | None) -> set[str]:
    """The runs in the compacted batches of the `runs` table (their `run` column)."""
    out: set[str] = set()
    for f in tf.compacted if tf is not None else ():
        try:
            out.update(pq.read_table(f, columns=[PARTITION], filesystem=fs)[PARTITION]
                       .to_pylist())
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{f}: {first_line(e)}") from None
    return out


def check_target(root: Location | str, run_id: str, force: bool) -> None:
    """Refuse (DatasetError) a run id, a directory or an existing run `append_run`
    would not write: checked before `process` does its work, and again when it writes
    (under the dataset's lock). A run merged by `compact` is never replaced."""
    check_run_id(run_id)
    root = local(where(root))
    if isinstance(root, Path):
        if root.exists() and not root.is_dir():
            raise DatasetError(f"{root}: not a directory")
        if root.is_dir() and not (root / RUNS_TABLE).is_dir() and any(
                p for p in root.iterdir() if not p.name.startswith(".")):
            raise DatasetError(f"{root}: not a memtrack dataset (no {RUNS_TABLE}/ directory) "
                               "and not empty")
    if isinstance(root, Remote) and not _batched(root, (RUNS_TABLE,))[RUNS_TABLE]:
        # by run on object storage: one request, not a listing of every run
        runs_file = f"{partition(root, RUNS_TABLE, run_id)}/{DATA_FILE}"
        info = _remote(root, root.fs.get_file_info, runs_file)
        exists = info.type != pafs.FileType.NotFound  # type: ignore[attr-defined]
    else:
        runs = list_table(root, RUNS_TABLE)
        if run_id in _compacted_runs(runs, root.fs if isinstance(root, Remote) else None):
            raise DatasetError(f"{root}: run {run_id!r} is already in the dataset, in a "
                               "compacted batch: it cannot be replaced")
        exists = runs is not None and runs.file(run_id) is not None
    if exists and not force:
        raise DatasetError(f"{root}: run {run_id!r} is already in the dataset "
                           "(--force replaces it)")


def _batched(root: Location, tables: tuple[str, ...]) -> dict[str, bool]:
    """Each table's layout: in batches (BATCHED in its directory) or by run."""
    if isinstance(root, Remote):
        infos = _remote(root, root.fs.get_file_info, [root.join(t, BATCHED) for t in tables])
        return {t: i.type != pafs.FileType.NotFound  # type: ignore[attr-defined]
                for t, i in zip(tables, infos, strict=True)}  # type: ignore[call-overload]
    return {t: os.path.lexists(root / t / BATCHED) for t in tables}


def _locked(path: Path | str, exclusive: bool) -> int:
    """The dataset's directory opened and locked (flock): appends share it, `compact`
    holds it alone. DatasetError when `compact` cannot have it now."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except BlockingIOError:
        os.close(fd)
        raise DatasetError(f"{path}: a run is being appended: compact once it is done") \
            from None
    except BaseException:
        os.close(fd)
        raise
    return fd


TABLES = (RUNS_TABLE, *EXPORT_TABLES)


def append_run(root: Location | str, run_id: str, run_db: Path, *,
               metadata: Path | None = None, force: bool = False) -> bool:
    """Append the run database `run_db` to the dataset at `root` (a directory, or a
    URI: memtrack.schema.dataset.where) as run `run_id` (created if need be);
    `metadata`: its memory_metadata.json. Returns whether a run of that id was
    replaced (`force`)."""
    root = where(root)
    check_target(root, run_id, force)
    try:
        con = open_run(run_db, files=True)  # the database process just wrote
    except RunError as e:
        raise DatasetError(str(e)) from None
    if isinstance(root, Remote):
        try:
            return _append_remote(root, run_id, con, metadata, force)
        finally:
            con.close()
    root.mkdir(parents=True, exist_ok=True)
    fds: list[int] = []
    staging = None
    try:
        fds.append(_locked(root, exclusive=False))
        check_target(root, run_id, force)  # under the lock: no compaction since
        batched = _batched(root, TABLES)
        staging = Path(tempfile.mkdtemp(prefix=".append-", dir=root))

        def directory(table: str) -> int:
            name = str(partition(root, table, run_id, batched[table]).name)
            fds.append(open_directory(fds[0], root, table, name))
            return fds[-1]

        def place(table: str) -> None:  # staging/table -> table/run=ID/data.parquet
            os.replace(table, DATA_FILE, src_dir_fd=fds[1], dst_dir_fd=directory(table))

        fds.insert(1, os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
        runs_dir = directory(RUNS_TABLE)
        try:
            os.stat(DATA_FILE, dir_fd=runs_dir, follow_symlinks=False)
            replaced = True
        except FileNotFoundError:
            replaced = False
        # the run leaves the dataset until every table of its new version is in place
        if replaced:
            os.unlink(DATA_FILE, dir_fd=runs_dir)
        _write_tables(con, metadata, staging, place, batched, run_id)
    finally:
        con.close()
        for fd in fds:
            os.close(fd)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return replaced


def _write_tables(con: duckdb.DuckDBPyConnection, metadata: Path | None, scratch: Path,
                  place: Callable[[str], None], batched: dict[str, bool], run_id: str) -> None:
    """Every table of the run as scratch/TABLE, each `place`d as soon as written, and its
    `runs` row last: the run is in the dataset once that is placed. A table in batches
    has the run's id in its files (`run`, the last column)."""
    def rows(name: str, source: str | None = None) -> str:
        extra = f", {sql_literal(run_id)} AS {PARTITION}" if batched[name] else ""
        return f"SELECT *{extra} FROM {source or name}"

    for name in EXPORT_TABLES:
        copy_parquet(con, rows(name), scratch / name)
        place(name)
    con.register("runs_row", runs_row(dict(con.execute(
        "SELECT key, value FROM meta").fetchall()), metadata))
    copy_parquet(con, rows(RUNS_TABLE, "runs_row"), scratch / RUNS_TABLE)
    place(RUNS_TABLE)


def _remote(root: Remote, call: object, *args: object) -> object:
    """A call on the dataset's filesystem, its errors as one line (DatasetError)."""
    try:
        return call(*args)  # type: ignore[operator]
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{root}: {first_line(e)}") from None


def _append_remote(root: Remote, run_id: str, con: duckdb.DuckDBPyConnection,
                   metadata: Path | None, force: bool) -> bool:
    """append_run into a dataset behind a URI: each table written locally by DuckDB,
    uploaded to a hidden staging directory of the dataset, moved into place; the
    `runs` file removed first (replacing a run) and placed last."""
    fs = root.fs
    fds: list[int] = []
    if isinstance(fs, pafs.LocalFileSystem):  # file://: the local lock
        _remote(root, fs.create_dir, root.path)
        fds.append(_locked(root.path, exclusive=False))
    local_dir = Path(tempfile.mkdtemp(prefix="memtrack-append-"))
    staging = root.join(f".append-{uuid.uuid4().hex}")
    try:
        check_target(root, run_id, force)  # under the lock (file://): no compaction since
        batched = _batched(root, TABLES)
        runs_file = f"{partition(root, RUNS_TABLE, run_id, batched[RUNS_TABLE])}/{DATA_FILE}"
        info = _remote(root, fs.get_file_info, runs_file)
        replaced = info.type != pafs.FileType.NotFound  # type: ignore[attr-defined]

        def place(table: str) -> None:  # local/table -> staging/table -> TABLE/run=ID/data.parquet
            staged = f"{staging}/{table}"
            _remote(root, pafs.copy_files, str(local_dir / table), staged,
                    pafs.LocalFileSystem(), fs)
            (local_dir / table).unlink()
            target = str(partition(root, table, run_id, batched[table]))
            if isinstance(fs, pafs.LocalFileSystem):  # file://: no directory is a link
                os.close(open_directory(fds[0], Path(root.path), table,
                                        target.rsplit("/", 1)[1]))
            else:
                _remote(root, fs.create_dir, target)
            _remote(root, fs.move, staged, f"{target}/{DATA_FILE}")

        _remote(root, fs.create_dir, staging)
        if replaced:  # the run leaves the dataset until every table is in place again
            _remote(root, fs.delete_file, runs_file)
        _write_tables(con, metadata, local_dir, place, batched, run_id)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(local_dir, ignore_errors=True)
        try:
            fs.delete_dir(staging)
        except (pa.ArrowException, OSError):
            pass
    return replaced


# ---- compaction -----------------------------------------------------------------------
FILE_SIZE = "256MB"  # a compacted batch's files: DuckDB starts another beyond this
RENAME_EXCHANGE = 2  # renameat2(2)
AT_FDCWD = -100


def exchange(a: Path, b: Path) -> None:
    """Swap two directories in one step (renameat2 RENAME_EXCHANGE): a reader finds
    either the one or the other at each path, never neither."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, bytes(a), AT_FDCWD, bytes(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise DatasetError(f"{b}: cannot exchange directories here ({os.strerror(err)}): "
                           "compact needs renameat2 (Linux 3.15, a local filesystem)")


@dataclass
class Compaction:
    tables: int = 0  # the tables compacted
    runs: int = 0  # the runs merged (the largest number of any table)
    files_before: int = 0  # the files of the tables compacted, before and after
    files_after: int = 0


def compact(root: Location | str) -> Compaction:
    """Merge the runs' own files of every table of the local dataset at `root` into one
    compacted batch per table (memtrack.schema.dataset: the layout), without changing
    what any query reads. Per table: the new directory is built beside the dataset
    (hidden), with the table's compacted files kept (hard links) and the batch of the
    merged runs written, then exchanged with the table's directory in one rename, then
    the old one deleted; `runs` first, so a run of a compacted row in any table is a
    compacted run (never replaced). A crash leaves each table either as it was or
    compacted (the same rows), and a hidden directory the next compaction deletes.
    Appends wait for it (they share the dataset's lock; compact holds it alone)."""
    root = local(where(root))
    if isinstance(root, Remote):
        raise DatasetError(f"{root}: compact works on a local directory (object storage "
                           "has no step that replaces many objects at once)")
    Listing(root).runs()  # a dataset (DatasetError)
    fd = _locked(root, exclusive=True)
    stage: Path | None = None
    con = connect()
    out = Compaction()
    try:
        for stale in root.glob(".compact-*"):  # what a compaction that stopped left
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)
        listing = Listing(root)
        runs = listing.runs()
        stage = Path(tempfile.mkdtemp(prefix=".compact-", dir=root))
        stamp = f"{COMPACTED}{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-" \
                f"{uuid.uuid4().hex[:8]}"
        for table in TABLES:
            tf = listing.table(table)
            if tf is None:
                continue
            merge = [r for r in sorted(tf.own) if r in runs and tf.file(r) is not None]
            if not merge:
                continue
            new = stage / table
            new.mkdir()
            (new / BATCHED).write_text("this table is in batches: `run` is in the files "
                                       "(memtrack compact; docs/dataset.md)\n")
            files, schemas = listing.files(tf, merge, compacted=False)
            _write_batch(con, table_dataset(tf, files, schemas, None),
                         new / f"{BATCH}={stamp}", directory=True)
            for f in tf.compacted:  # the batches of earlier compactions, as they are
                batch = new / Path(f).parent.name
                batch.mkdir(exist_ok=True)
                os.link(f, batch / Path(f).name)
            for r in sorted(set(tf.own) - set(merge)):  # no run (an append that failed):
                f = tf.file(r)  # kept, in the layout of the table
                if f is None:
                    continue
                (new / f"{BATCH}={r}").mkdir()
                target = new / f"{BATCH}={r}" / DATA_FILE
                if tf.batched:
                    os.link(f, target)
                else:
                    _write_batch(con, table_dataset(tf, [f], [file_schema(f, None)], None),
                                 target)
            before = sum(1 for _ in (root / table).glob("*/*.parquet"))
            exchange(new, root / table)
            shutil.rmtree(new)  # the table's directory as it was
            after = sum(1 for p in (root / table).glob("*/*.parquet"))
            out = Compaction(out.tables + 1, max(out.runs, len(merge)),
                             out.files_before + before, out.files_after + after)
    finally:
        con.close()
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        os.close(fd)
    return out


def _write_batch(con: duckdb.DuckDBPyConnection, rows: object, target: Path,
                 directory: bool = False) -> None:
    """The rows of a pyarrow dataset as zstd Parquet at `target`, in their order: one
    file, or (`directory`) files data_0.parquet, data_1.parquet ... of FILE_SIZE."""
    con.register("batch_rows", rows)
    size = f", FILE_SIZE_BYTES '{FILE_SIZE}'" if directory else ""
    try:
        con.execute(f"COPY (SELECT * FROM batch_rows) TO {sql_literal(target)} "
                    f"(FORMAT parquet, COMPRESSION zstd{size})")
    except duckdb.Error as e:
        raise DatasetError(f"{target}: {first_line(e)}") from None
    finally:
        con.unregister("batch_rows")


def runs_row(meta: dict[str, str], metadata: Path | None) -> pa.Table:
    """A run's row of `runs` (schema RUNS) from its meta table."""

    def js(key: str, default: object) -> object:
        try:
            return json.loads(meta[key])
        except (KeyError, ValueError):
            return default

    def num(key: str) -> int:
        v = meta.get(key, "")
        return int(v) if v.lstrip("-").isdigit() else 0

    host = js("host", {})
    status = js("exit_status", {})
    labels = js("labels", {})
    host = host if isinstance(host, dict) else {}
    attached = js("attached", [])
    attached = [a["pid"] for a in attached if isinstance(a, dict)
                and isinstance(a.get("pid"), int)] if isinstance(attached, list) else []
    status = status if isinstance(status, dict) else {}
    labels = labels if isinstance(labels, dict) else {}
    offset = num("wall_offset_ns")

    def wall(key: str) -> int | None:
        return (num(key) + offset) // 1000 if num(key) else None

    text = metadata.read_text() if metadata is not None and metadata.is_file() else None
    row = {
        "labels": [[(str(k), str(v)) for k, v in labels.items()]],
        "command": [[str(c) for c in js("command", [])]],  # type: ignore[union-attr]
        "hostname": [host.get("hostname") or None],
        "kernel": [host.get("kernel") or None],
        "arch": [host.get("arch") or None],
        "start_time": [wall("start_ns")],
        "end_time": [wall("end_ns")],
        "exit_code": [status.get("code")],
        "exit_signal": [status.get("signal")],
        "root_pid": [num("root_pid")],
        "attached": [attached],
        "artifact": [meta.get("artifact")],
        "memtrack_version": [meta.get("memtrack_version")],
        "schema_version": [num("schema_version")],
        "processed_at": [time.time_ns() // 1000],
        "memory_metadata": [text],
    }
    return pa.table(row, schema=RUNS)
