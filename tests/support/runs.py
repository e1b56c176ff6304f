"""A dataset of synthetic benchmark runs (no BPF): each run is process 100 (`bench`)
running two regions, `bench_steady` and `bench_step`; from STEP_RUN on, bench_step's
first block is STEP_BYTES larger. Every run's RSS differs a little (below the default
tolerance). Runs are ordered by the label `commit_time` (numbers of 3 and 4 digits:
numeric order is not text order); their start times run the other way."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa

from memtrack.process import dataset as writer
from memtrack.process.dataset import append_run
from memtrack.schema import REGION_NAMES, RSS, EventKind
from support import synth

K = EventKind
RUNS = 20
STEP_RUN = 12  # 1-based: the run whose bench_step grew
BLOCK, STEP_BYTES, SMALL, STEADY = 1024, 1024, 256, 512
RSS_BASE = [40960, 65536, 49152]  # anon bytes at 1000, 1011, 1013
END = 3000


def run_id(i: int) -> str:
    """Run i's id (1-based): a commit hash."""
    return hashlib.sha1(f"run{i}".encode()).hexdigest()[:10]


def commit_time(i: int) -> int:
    return 900 + 10 * i  # 910 ... 1100


def step_bytes(i: int) -> int:
    """bench_step's first block in run i."""
    return BLOCK + (STEP_BYTES if i >= STEP_RUN else 0)


def write_bench_run(path: Path, block: int) -> Path:
    rows = [
        (1000, 100, 100, K.REGION, 1, 1, 0, 0, 0),
        (1001, 100, 100, K.MALLOC, 0, 0x1000, 0, STEADY, 11),
        (1002, 100, 100, K.FREE, 0, 0x1000, 0, 0, 0),
        (1003, 100, 100, K.REGION, 0, 1, 0, 0, 0),
        (1010, 100, 100, K.REGION, 1, 2, 0, 0, 0),
        (1011, 100, 100, K.MALLOC, 0, 0x2000, 0, block, 12),
        (1012, 100, 100, K.MALLOC, 0, 0x3000, 0, SMALL, 11),
        (1013, 100, 100, K.FREE, 0, 0x2000, 0, 0, 0),
        (1014, 100, 100, K.FREE, 0, 0x3000, 0, 0, 0),
        (1015, 100, 100, K.REGION, 0, 2, 0, 0, 0),
    ]
    names = pa.table({"region_id": [1, 2], "name": ["bench_steady", "bench_step"]},
                     schema=REGION_NAMES)
    raw = pa.table({"ts": [1000, 1011, 1013], "pid": [100] * 3, "member": [1] * 3,
                    "bytes": RSS_BASE, "external": [False] * 3}, schema=RSS)
    synth.write_run(path, synth.events_table(rows), end_ns=END, rss=raw, region_names=names,
                    command=("bench",))
    with duckdb.connect(str(path)) as con:
        con.execute("UPDATE processes SET name = 'bench' WHERE pid = 100")
    return path


def rss_noise(i: int) -> int:
    """Bytes added to every RSS sample of run i (under 1%)."""
    return 128 * ((i * 5) % 7)


def add_run(ds: Path, scratch: Path, i: int, block: int | None = None,
            losses: dict[str, int] | None = None) -> str:
    """Append run i (1-based) to the dataset `ds`, from the run database of its block
    size (written once in `scratch`); `losses`: its capture's loss counters."""
    block = step_bytes(i) if block is None else block
    scratch.mkdir(parents=True, exist_ok=True)
    base = scratch / f"block{block}.duckdb"
    if not base.exists():
        write_bench_run(base, block)
    db = scratch / f"run{i}.duckdb"
    shutil.copyfile(base, db)
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE rss SET bytes = bytes + ? WHERE member = 'anon'", [rss_noise(i)])
        labels = {"commit": run_id(i), "commit_time": str(commit_time(i))}
        con.execute("INSERT OR REPLACE INTO meta VALUES ('labels', ?), ('wall_offset_ns', ?)",
                    [json.dumps(labels), str((10_000 - i) * 10**9)])
        if losses:
            con.execute("UPDATE meta SET value = ? WHERE key = 'losses'", [json.dumps(losses)])
    append_run(ds, run_id(i), db)
    db.unlink()
    return run_id(i)


def write_bench_dataset(ds: Path, scratch: Path, runs: int = RUNS) -> Path:
    scratch.mkdir(parents=True, exist_ok=True)
    for i in range(1, runs + 1):
        add_run(ds, scratch, i)
    return ds


@contextmanager
def disk_full_at(table: str) -> Iterator[None]:
    """Within the block, the dataset writer's copy of `table` fails as on a full disk
    (the tables before it are written)."""
    copy = writer.copy_parquet

    def failing(con: object, query: str, path: Path) -> None:
        if path.name == table:
            raise OSError(28, "No space left on device")
        copy(con, query, path)  # type: ignore[arg-type]

    writer.copy_parquet = failing  # type: ignore[assignment]
    try:
        yield
    finally:
        writer.copy_parquet = copy
