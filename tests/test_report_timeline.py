"""The page's heap and RSS timelines, on the data `report --html` embeds: a process
whose heap rises, falls to nothing, rises again and is freed down before it exits, with
more samples than the page keeps. Downsampled, each series keeps its peaks, its trough
and its last value (the heap at exit), and the RSS is one value per time: it drops to 0
once, at the exit, never to jump back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from support import synth
from support.page import page_data
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.report.html import TIMELINE_POINTS
from memtrack.schema import RSS, EventKind

K = EventKind
N = 2000  # blocks
SIZE = 64
KEPT = 300  # blocks still allocated at the exit (which ends them)
PAGE = 4096
SAMPLES = TIMELINE_POINTS // 2  # of anon RSS (all on the page)
FILE = 8 * PAGE


def heap_rows() -> list[tuple]:
    """N blocks allocated, all freed (the trough), N again, all but KEPT freed, exit."""
    ops = [(K.MALLOC, N), (K.FREE, N), (K.MALLOC, N), (K.FREE, N - KEPT)]
    heap = [(kind, 0x1000 + 16 * i) for kind, n in ops for i in range(n)]
    rows = [(1000 + k, 100, 100, kind, 0, addr, 0, SIZE if kind == K.MALLOC else 0,
             11 if kind == K.MALLOC else 0) for k, (kind, addr) in enumerate(heap)]
    return [*rows, (1000 + len(rows), 100, 100, K.EXIT, 1, 0, 0, 0, 0)]


ROWS = heap_rows()
EXIT = ROWS[-1][0]
END = EXIT + 100


def write_timeline_run(path: Path) -> Path:
    # FILE bytes mapped, then anon RSS rising a page a sample; then the exit (the RSS
    # stage resets every member: file first)
    n = SAMPLES
    raw = pa.table({"ts": [1000 + i for i in range(n + 1)], "pid": [100] * (n + 1),
                    "member": [0] + [1] * n, "bytes": [FILE] + [PAGE * (i + 1) for i in range(n)],
                    "external": [False] * (n + 1)}, schema=RSS)
    synth.write_run(path, synth.events_table(ROWS), end_ns=END, rss=raw, command=("p",),
                    allocators=[])
    return path


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_timeline_run(tmp_path_factory.mktemp("timeline") / "run.duckdb")


def timelines(run_db: Path, tmp: Path) -> dict[int, dict[str, Any]]:
    """The page's timelines, by pid."""
    page = tmp / "run.html"
    r = CliRunner().invoke(app, ["report", str(run_db), "--html", str(page)])
    assert r.exit_code == 0, r.output
    return {t["pid"]: t for t in page_data(page)["timelines"]}


def seconds(ts: int) -> float:
    return round((ts - 900) / 1e9, 9)


def test_heap_keeps_peaks_trough_and_the_heap_at_exit(run_db: Path, tmp_path: Path) -> None:
    with duckdb.connect(str(run_db), read_only=True) as con:
        heap = con.execute("SELECT ts, heap_bytes FROM heap_timeline WHERE pid = 100 "
                           "ORDER BY event_id").fetchall()
    assert len(heap) > TIMELINE_POINTS
    p = timelines(run_db, tmp_path)[100]
    s = p["heap"]
    assert len(s) <= TIMELINE_POINTS
    assert s[-1] == [seconds(heap[-1][0]), heap[-1][1]] == [seconds(EXIT), 0]
    values = [v for _, v in s]
    assert max(values) == N * SIZE
    # the trough between the two rises is kept, at its time
    trough = heap[2 * N - 1]
    assert trough[1] == 0 and [seconds(trough[0]), 0] in s
    # every point is the heap at its time, in order
    assert {(t, v) for t, v in s} <= {(seconds(t), v) for t, v in heap}
    assert [t for t, _ in s] == sorted(t for t, _ in s)


def test_rss_is_one_value_a_time_and_ends_at_the_exit(run_db: Path, tmp_path: Path) -> None:
    p = timelines(run_db, tmp_path)[100]
    s = p["rss"]
    assert len(s) == 1 + SAMPLES + 1  # the file sample, the anon ones, the exit
    times = [t for t, _ in s]
    assert times == sorted(set(times))  # one point a time: no member's change alone
    assert max(v for _, v in s) == FILE + PAGE * SAMPLES
    # 0 once, at the exit, and nothing after it
    assert [q for q in s if q[1] == 0] == [[seconds(EXIT), 0]] == s[-1:]
