"""Every table and view of the run database, through `process` as users run it: a
synthetic artifact (tests/support/synth.py) whose input fills each of them, and the
exact rows each holds. A write left out of the pipeline (a table, the derived tables,
meta) empties or changes one of them, and this test fails without BPF."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pytest
from support import synth

from memtrack.schema import EVENTS, REGION_LABELS, REGION_NAMES, STOPS, EventKind
from memtrack.schema.ddl import open_run
from memtrack.schema.enums import StopReason

K = EventKind
ROOT = Path(__file__).resolve().parent.parent
# on top of synth.EVENT_ROWS: regions of thread 100 (outer holds inner) and of thread 101
REGION_ROWS = [
    (1150, 100, 100, K.REGION, 1, 1),
    (1240, 100, 101, K.REGION, 1, 3),
    (1350, 100, 100, K.REGION, 1, 2),
    (1450, 100, 100, K.REGION, 0, 2),
    (1650, 100, 100, K.REGION, 0, 1),
]
NAMES = {1: "outer", 2: "inner", 3: "t101"}
# labels said of them: a key said twice keeps its last value
LABELS = [(1, "limit.peak", "1"), (2, "note", "x"), (1, "limit.peak", "6144")]
# stack 11 runs make_small from Python: two `work` frames of one evaluation loop call
STACKS = {**synth.STACKS, 11: ["malloc", "make_small", "work", "work", "main"]}

# Rows per table and view, by hand from synth's events (9 allocations; stacks 12 to 15,
# stack 11's native record and stack 11: its native frames with the evaluation frame
# replaced by the two Python frames it ran; 2 processes, threads 100, 101 and 200).
ROWS = {
    "meta": None,  # checked by key below
    "processes": 2, "threads": 3, "modules": 1, "mappings": 1,
    "events": 20 + len(REGION_ROWS), "allocations": 9, "stacks": 6,
    "stack_frames": 4 + 4 + 2 + 3 + 4 + 5,
    # MODULE's 9 locations (make_big's two lines) and EVAL's, the Python `work`
    "frames": 11,
    "rss": 15, "regions": 3, "region_labels": 2, "stops": 2,
    "heap_timeline": 15, "heap_peak": 2, "backtraces": 6,
    # outer: B C D E made, B (by D's realloc) and C freed; inner: D made, B freed; t101: F
    "region_allocations": 6, "region_frees": 3, "region_heap_timeline": 5 + 1 + 1,
    "region_peak": 3, "region_stack_costs": 4 + 1 + 1,
    "stack_lines": 22, "stack_location": 6, "backtrace_lines": 22,
    "backtrace_frames": 3 + 3 + 1 + 2 + 3 + 4,  # from the site (depth 1) outward
    "allocation_sites": 9, "peak": 4, "rss_timeline": 7, "leaks": 4, "temporary": 2,
    "stack_costs": 7, "hotspots": 7, "region_metrics": 3,
}  # fmt: skip


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = synth.events_table().to_pylist()
    extra = [dict(zip(EVENTS.names, (ts, pid, tid, int(kind), 0, flags, rid, 0, 0, 0),
                      strict=True)) for ts, pid, tid, kind, flags, rid in REGION_ROWS]
    events = pa.Table.from_pylist(sorted(base + extra, key=lambda r: r["ts"]), schema=EVENTS)
    names = pa.table({"region_id": list(NAMES), "name": list(NAMES.values())},
                     schema=REGION_NAMES)
    stops = pa.table({"pid": [100, 200], "reason": [StopReason.ATTACH, StopReason.PAUSE],
                      "begin_ts": [900, 1850], "end_ts": [950, 1860]}, schema=STOPS)
    labels = pa.table({k: [row[i] for row in LABELS]
                       for i, k in enumerate(("region_id", "key", "value"))},
                      schema=REGION_LABELS)
    return synth.write_run(tmp_path_factory.mktemp("tables") / "run.duckdb", events, STACKS,
                           python={11: "work"}, region_names=names, region_labels=labels,
                           stops=stops)


def documented() -> set[str]:
    """The tables and views docs/tables.md describes (its bold names)."""
    return set(re.findall(r"\*\*([a-z_]+)\*\*", (ROOT / "docs" / "tables.md").read_text()))


def test_every_table_and_view_holds_its_rows(run_db: Path) -> None:
    con = open_run(run_db)
    names = {r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'"
    ).fetchall()}
    assert names == set(ROWS) == documented()
    got = {n: con.execute(f"SELECT count(*) FROM {n}").fetchone()[0]  # type: ignore[index]
           for n in ROWS if ROWS[n] is not None}
    assert got == {n: v for n, v in ROWS.items() if v is not None}
    meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    assert (meta["root_pid"], meta["start_ns"], meta["end_ns"]) == ("100", "900", "3000")
    assert json.loads(meta["command"]) == ["p", "-x"]
    assert json.loads(meta["allocator_functions"]) == synth.ALLOCATORS
    counters = json.loads(meta["counters"])
    assert (counters["allocations"], counters["frees_unmatched"]) == (9, synth.UNMATCHED_FREES)
    assert counters["python_frames"] == 2


def test_the_rows_themselves(run_db: Path) -> None:
    """The small tables row by row, and the figures the views derive."""
    con = open_run(run_db)
    assert con.execute("SELECT pid, ppid, name FROM processes ORDER BY pid").fetchall() == [
        (100, 1, "parent"), (200, 100, "child")]
    assert con.execute("SELECT pid, tid, events FROM threads ORDER BY tid").fetchall() == [
        (100, 100, 11), (100, 101, 1), (200, 200, 4)]
    assert con.execute("SELECT build_id, path FROM modules").fetchall() == [
        (synth.BUILD_ID, "/bin/p")]
    assert con.execute("SELECT start, \"end\", path FROM mappings").fetchall() == [
        (*synth.MAPPED, "/bin/p")]
    assert con.execute("SELECT name, begin_ts, end_ts FROM regions ORDER BY region_id"
                       ).fetchall() == [("outer", 1150, 1650), ("inner", 1350, 1450),
                                        ("t101", 1240, synth.END_NS)]
    assert con.execute("SELECT pid, reason, begin_ts, end_ts FROM stops ORDER BY pid"
                       ).fetchall() == [(100, "attach", 900, 950), (200, "pause", 1850, 1860)]
    assert con.execute("SELECT list(size ORDER BY alloc_id) FROM allocations").fetchone() == (
        synth.SIZES,)
    assert con.execute("SELECT pid, peak_ts, peak_bytes FROM heap_peak ORDER BY pid"
                       ).fetchall() == [(100, synth.PEAK["ts"], synth.PEAK["bytes"]),
                                        (200, 2500, 128)]
    lines = con.execute("""SELECT list(name ORDER BY position) FROM stack_lines
        GROUP BY stack_id ORDER BY 1""").fetchall()
    assert sorted(fr for (fr,) in lines) == sorted(
        [[n.partition(":")[0] for n in fr] for fr in STACKS.values()]
        + [synth.native_frames(STACKS[11], "work")])
    assert con.execute("""SELECT method, count(*) FROM stack_frames GROUP BY 1 ORDER BY 1"""
                       ).fetchall() == [("cfi", 14), ("python", 2), ("regs", 6)]
    assert con.execute("SELECT count(*) FROM events WHERE stack_id IS NULL AND stack_hash <> 0"
                       ).fetchone() == (0,)
    assert con.execute("SELECT name, calls, bytes FROM region_metrics ORDER BY region_id"
                       ).fetchall() == [("outer", 4, 8168), ("inner", 1, 4096), ("t101", 1, 300)]
