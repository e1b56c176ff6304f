"""`memtrack process --dataset DIR --run-id ID`: a run database appended to a run
dataset, every table as one Parquet file of the run's partition and the run's row of
`runs` last (memtrack.schema.dataset: the layout and its readers).

The files are written by DuckDB's COPY from the run database, as `--parquet` writes
them, each into a hidden staging directory of the dataset (its own, new) and renamed
into place: no engine reads a file whose name starts with a dot, and a rename is
atomic, so a reader sees a run's table whole or not at all. A dataset lives on shared
storage: its directories are opened one component at a time without following a
symbolic link, and the rename replaces a link, never what it points to.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import duckdb
import pyarrow as pa

from memtrack.schema.dataset import (
    DATA_FILE,
    PARTITION,
    RUNS,
    RUNS_TABLE,
    DatasetError,
    check_run_id,
    partition,
)
from memtrack.schema.ddl import EXPORT_TABLES, RunError, open_run, sql_literal


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


def check_target(root: Path, run_id: str, force: bool) -> None:
    """Refuse (DatasetError) a run id, a directory or an existing run `append_run`
    would not write: checked before `process` does its work, and again when it writes."""
    check_run_id(run_id)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    if root.is_dir() and not (root / RUNS_TABLE).is_dir() and any(
            p for p in root.iterdir() if not p.name.startswith(".")):
        raise DatasetError(f"{root}: not a memtrack dataset (no {RUNS_TABLE}/ directory) "
                           "and not empty")
    if (partition(root, RUNS_TABLE, run_id) / DATA_FILE).exists() and not force:
        raise DatasetError(f"{root}: run {run_id!r} is already in the dataset "
                           "(--force replaces it)")


def append_run(root: Path, run_id: str, run_db: Path, *, metadata: Path | None = None,
               force: bool = False) -> bool:
    """Append the run database `run_db` to the dataset at `root` as run `run_id`
    (created if need be); `metadata`: its memory_metadata.json. Returns whether a run
    of that id was replaced (`force`)."""
    root = Path(root)
    check_target(root, run_id, force)
    try:
        con = open_run(run_db, files=True)  # the database process just wrote
    except RunError as e:
        raise DatasetError(str(e)) from None
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
        for name in EXPORT_TABLES:
            copy_parquet(con, f"SELECT * FROM {name}", staging / name)
            place(name)
        con.register("runs_row", runs_row(dict(con.execute(
            "SELECT key, value FROM meta").fetchall()), metadata))
        copy_parquet(con, "SELECT * FROM runs_row", staging / RUNS_TABLE)
        place(RUNS_TABLE)
    finally:
        con.close()
        for fd in fds:
            os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
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
