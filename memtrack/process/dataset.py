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
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs

from memtrack.schema.dataset import (
    DATA_FILE,
    PARTITION,
    RUNS,
    RUNS_TABLE,
    DatasetError,
    Location,
    Remote,
    check_run_id,
    partition,
    where,
)
from memtrack.schema.ddl import EXPORT_TABLES, RunError, first_line, open_run, sql_literal


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


def check_target(root: Location | str, run_id: str, force: bool) -> None:
    """Refuse (DatasetError) a run id, a directory or an existing run `append_run`
    would not write: checked before `process` does its work, and again when it writes."""
    check_run_id(run_id)
    root = where(root)
    if isinstance(root, Remote):
        runs_file = f"{partition(root, RUNS_TABLE, run_id)}/{DATA_FILE}"
        if _remote(root, root.fs.get_file_info, runs_file).type != pafs.FileType.NotFound \
                and not force:
            raise DatasetError(f"{root}: run {run_id!r} is already in the dataset "
                               "(--force replaces it)")
        return
    if root.exists() and not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    if root.is_dir() and not (root / RUNS_TABLE).is_dir() and any(
            p for p in root.iterdir() if not p.name.startswith(".")):
        raise DatasetError(f"{root}: not a memtrack dataset (no {RUNS_TABLE}/ directory) "
                           "and not empty")
    if (partition(root, RUNS_TABLE, run_id) / DATA_FILE).exists() and not force:
        raise DatasetError(f"{root}: run {run_id!r} is already in the dataset "
                           "(--force replaces it)")


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
            return _append_remote(root, run_id, con, metadata)
        finally:
            con.close()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".append-", dir=root))
    fds: list[int] = []

    def directory(table: str) -> int:
        fds.append(open_directory(fds[0], root, table, f"{PARTITION}={run_id}"))
        return fds[-1]

    def place(table: str) -> None:  # staging/table -> table/run=ID/data.parquet
        os.replace(table, DATA_FILE, src_dir_fd=fds[1], dst_dir_fd=directory(table))

    try:
        fds.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY))
        fds.append(os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
        runs_dir = directory(RUNS_TABLE)
        try:
            os.stat(DATA_FILE, dir_fd=runs_dir, follow_symlinks=False)
            replaced = True
        except FileNotFoundError:
            replaced = False
        # the run leaves the dataset until every table of its new version is in place
        if replaced:
            os.unlink(DATA_FILE, dir_fd=runs_dir)
        _write_tables(con, metadata, staging, place)
    finally:
        con.close()
        for fd in fds:
            os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
    return replaced


def _write_tables(con: duckdb.DuckDBPyConnection, metadata: Path | None, scratch: Path,
                  place: Callable[[str], None]) -> None:
    """Every table of the run as scratch/TABLE, each `place`d as soon as written, and its
    `runs` row last: the run is in the dataset once that is placed."""
    for name in EXPORT_TABLES:
        copy_parquet(con, f"SELECT * FROM {name}", scratch / name)
        place(name)
    con.register("runs_row", runs_row(dict(con.execute(
        "SELECT key, value FROM meta").fetchall()), metadata))
    copy_parquet(con, "SELECT * FROM runs_row", scratch / RUNS_TABLE)
    place(RUNS_TABLE)


def _remote(root: Remote, call: object, *args: object) -> object:
    """A call on the dataset's filesystem, its errors as one line (DatasetError)."""
    try:
        return call(*args)  # type: ignore[operator]
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{root}: {first_line(e)}") from None


def _append_remote(root: Remote, run_id: str, con: duckdb.DuckDBPyConnection,
                   metadata: Path | None) -> bool:
    """append_run into a dataset behind a URI: each table written locally by DuckDB,
    uploaded to a hidden staging directory of the dataset, moved into place; the
    `runs` file removed first (replacing a run) and placed last."""
    fs = root.fs
    local = Path(tempfile.mkdtemp(prefix="memtrack-append-"))
    staging = root.join(f".append-{uuid.uuid4().hex}")
    runs_file = f"{partition(root, RUNS_TABLE, run_id)}/{DATA_FILE}"
    info = _remote(root, fs.get_file_info, runs_file)
    replaced = info.type != pafs.FileType.NotFound  # type: ignore[attr-defined]

    def place(table: str) -> None:  # local/table -> staging/table -> TABLE/run=ID/data.parquet
        staged = f"{staging}/{table}"
        _remote(root, pafs.copy_files, str(local / table), staged, pafs.LocalFileSystem(), fs)
        (local / table).unlink()
        target = str(partition(root, table, run_id))
        if isinstance(fs, pafs.LocalFileSystem):  # file://: no directory is a link
            os.close(open_directory(fds[0], Path(root.path), table, f"{PARTITION}={run_id}"))
        else:
            _remote(root, fs.create_dir, target)
        _remote(root, fs.move, staged, f"{target}/{DATA_FILE}")

    fds: list[int] = []
    try:
        _remote(root, fs.create_dir, staging)
        if isinstance(fs, pafs.LocalFileSystem):
            fds.append(os.open(root.path, os.O_RDONLY | os.O_DIRECTORY))
        if replaced:  # the run leaves the dataset until every table is in place again
            _remote(root, fs.delete_file, runs_file)
        _write_tables(con, metadata, local, place)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(local, ignore_errors=True)
        try:
            fs.delete_dir(staging)
        except (pa.ArrowException, OSError):
            pass
    return replaced


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
