"""`memtrack process --dataset DIR --run-id ID`: a run database appended to a run
dataset, every table as one Parquet file of the run's partition and the run's row of
`runs` last (memtrack.schema.dataset: the layout and its readers).

The files are written by DuckDB's COPY from the run database, as `--parquet` writes
them (`write_parquet`), each to a hidden temporary name renamed into place: no engine
reads a file whose name starts with a dot, and a rename is atomic, so a reader sees a
run's table whole or not at all.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import duckdb
import pyarrow as pa

from memtrack.schema.dataset import (
    DATA_FILE,
    RUNS,
    RUNS_TABLE,
    DatasetError,
    check_run_id,
    partition,
)
from memtrack.schema.ddl import EXPORT_TABLES, RunError, open_run


def write_parquet(con: duckdb.DuckDBPyConnection, query: str, target: Path) -> None:
    """The rows of `query` as a zstd Parquet file at `target`, renamed into place."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    literal = "'" + str(tmp).replace("'", "''") + "'"
    try:
        con.execute(f"COPY ({query}) TO {literal} (FORMAT parquet, COMPRESSION zstd)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


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
        con = open_run(run_db)
    except RunError as e:
        raise DatasetError(str(e)) from None
    try:
        runs_file = partition(root, RUNS_TABLE, run_id) / DATA_FILE
        replaced = runs_file.exists()
        # the run leaves the dataset until every table of its new version is in place
        runs_file.unlink(missing_ok=True)
        for name in EXPORT_TABLES:
            d = partition(root, name, run_id)
            d.mkdir(parents=True, exist_ok=True)
            write_parquet(con, f"SELECT * FROM {name}", d / DATA_FILE)
        con.register("runs_row", runs_row(dict(con.execute(
            "SELECT key, value FROM meta").fetchall()), metadata))
        runs_file.parent.mkdir(parents=True, exist_ok=True)
        write_parquet(con, "SELECT * FROM runs_row", runs_file)
    finally:
        con.close()
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
        "artifact": [meta.get("artifact")],
        "memtrack_version": [meta.get("memtrack_version")],
        "schema_version": [num("schema_version")],
        "processed_at": [time.time_ns() // 1000],
        "memory_metadata": [text],
    }
    return pa.table(row, schema=RUNS)
