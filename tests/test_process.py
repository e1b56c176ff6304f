"""`memtrack process` on synthetic artifacts: allocations one for one, leaks, peak,
temporary allocations, lifecycle bounds and the run-database format check."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from support.synth import (
    END_NS,
    LEAKS,
    PEAK,
    SIZES,
    TEMPORARY,
    UNMATCHED_FREES,
    VFORK,
    events_table,
    write_artifact,
)

from memtrack.process.pipeline import process
from memtrack.schema import EVENTS
from memtrack.schema import EventKind as K
from memtrack.schema.ddl import RunError, open_run
from memtrack.schema.enums import CLONE_VM


def no_stacks(events: pa.Table) -> pa.Table:
    zeros = pa.array(np.zeros(events.num_rows, np.uint64))
    return events.set_column(9, "stack_hash", zeros)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> duckdb.DuckDBPyConnection:
    d = tmp_path_factory.mktemp("proc")
    art = write_artifact(d / "a.memtrack", no_stacks(events_table()))
    summary = process(art, d / "run.duckdb", parquet_dir=d / "pq", progress=False)
    assert summary.events == 20 and summary.allocations == 9
    assert summary.counters["frees_unmatched"] == UNMATCHED_FREES
    assert summary.metadata == d / "run.memory_metadata.json"
    meta = json.loads(summary.metadata.read_text())
    assert sorted(p["pid"] for p in meta["processes"]) == [100, 200, 200]
    con = open_run(d / "run.duckdb")
    yield con
    con.close()


def q(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    return con.execute(sql).fetchall()


def test_allocations_one_for_one(run: duckdb.DuckDBPyConnection) -> None:
    rows = q(run, "SELECT alloc_id, size, kind, pid, tid, ts, free_ts, lifetime_ns, end_reason,"
                  " realloc_of FROM allocations ORDER BY alloc_id")
    assert [r[1] for r in rows] == SIZES
    assert [r[2] for r in rows] == ["malloc", "malloc", "malloc", "malloc", "realloc", "calloc",
                                    "malloc", "aligned_alloc", "malloc"]
    by_id = {r[0]: r for r in rows}
    assert by_id[0][6:9] == (1100, 100, "free")  # A freed after 100 ns
    assert by_id[1][6:9] == (1400, 200, "realloc")  # B realloc'd into D
    assert by_id[4][9] == 1  # D links to B
    assert by_id[2][4] == 101 and by_id[2][6] == 1700  # F: thread 101, freed by 100
    assert by_id[3][6:9] == (1500, 200, "free")
    assert by_id[7][6:9] == (2200, 100, "free")
    for aid, (reason, size) in LEAKS.items():
        assert by_id[aid][8] == reason and by_id[aid][1] == size and by_id[aid][6] is None
    ends = dict(q(run, "SELECT alloc_id, end_ts FROM allocations WHERE free_ts IS NULL"))
    assert ends == {4: END_NS, 5: END_NS, 6: 2000, 8: 2600}


def test_leaks_exact(run: duckdb.DuckDBPyConnection) -> None:
    rows = q(run, "SELECT alloc_id, size FROM leaks ORDER BY alloc_id")
    assert rows == [(k, LEAKS[k][1]) for k in sorted(LEAKS)]


def test_peak_exact(run: duckdb.DuckDBPyConnection) -> None:
    rows = q(run, "SELECT alloc_id, peak_ts, peak_bytes FROM peak WHERE pid = 100 "
                  "ORDER BY alloc_id")
    assert [r[0] for r in rows] == PEAK["alive"]
    assert {(r[1], r[2]) for r in rows} == {(PEAK["ts"], PEAK["bytes"])}
    assert sum(SIZES[i] for i in PEAK["alive"]) == PEAK["bytes"]
    final = q(run, "SELECT heap_bytes FROM heap_timeline WHERE pid = 100 "
                   "ORDER BY event_id DESC LIMIT 1")
    assert final == [(4096 + 1000,)]
    child = q(run, "SELECT pid, heap_bytes FROM heap_timeline WHERE pid = 200 ORDER BY event_id")
    assert child == [(200, 64), (200, 0), (200, 128), (200, 0)]


def test_temporary(run: duckdb.DuckDBPyConnection) -> None:
    assert [r[0] for r in q(run, "SELECT alloc_id FROM temporary ORDER BY 1")] == TEMPORARY


def test_lifecycle_tables(run: duckdb.DuckDBPyConnection) -> None:
    procs = q(run, "SELECT pid, ppid, name, cmdline, start_ts, exit_ts, exit_code, exit_signal "
                   "FROM processes ORDER BY pid")
    assert procs[0] == (100, 1, "parent", ["p", "-x"], 900, None, None, None)
    # pid 200 twice in the artifact: the latest instance's name, its last exit
    # killed by SIGKILL: a signal, no exit code (as memory_metadata.json says it)
    assert procs[1][:3] == (200, 100, "child2") and procs[1][5:] == (2600, None, 9)
    threads = q(run, "SELECT pid, tid, events FROM threads ORDER BY tid")
    assert threads == [(100, 100, 11), (100, 101, 1), (200, 200, 4)]
    # rss: pid 100's own updates; each pid 200 process seeded from its parent at the fork
    # (anon 64 KiB since 1400), reset at its exit
    assert q(run, "SELECT ts, bytes, cause::VARCHAR FROM rss WHERE member = 'anon' "
                  "AND pid = 100 ORDER BY ts") == [(1000, 4096, "update"), (1400, 65536, "update")]
    assert q(run, "SELECT ts, bytes, cause::VARCHAR FROM rss WHERE member = 'anon' "
                  "AND pid = 200 ORDER BY ts") == [
        (1800, 65536, "fork"), (2000, 0, "exit"), (2300, 65536, "fork"), (2600, 0, "exit")]
    assert q(run, "SELECT count(*), count(stack_id) FROM events") == [(20, 0)]


def test_parquet_dirs(run: duckdb.DuckDBPyConnection, tmp_path_factory) -> None:
    root = next(Path(tmp_path_factory.getbasetemp()).glob("proc*")) / "pq"
    assert (root / "allocations" / "data.parquet").is_file()
    n = duckdb.sql(f"SELECT count(*) FROM '{root}/allocations/*.parquet'").fetchone()[0]
    assert n == 9


def rows_table(rows: list[tuple]) -> pa.Table:
    """Events (ts, pid, tid, kind, flags, addr, old_addr, size, stack_hash) as a table."""
    cols = list(zip(*rows, strict=True))
    return pa.table({"ts": cols[0], "pid": cols[1], "tid": cols[2],
                     "kind": [int(k) for k in cols[3]], "allocator": [1] * len(rows),
                     "flags": cols[4], "addr": cols[5], "old_addr": cols[6], "size": cols[7],
                     "stack_hash": cols[8]}, schema=EVENTS)


def test_pid_reuse_and_exec_bound(tmp_path: Path) -> None:
    rows = [
        (10, 5, 5, K.MALLOC, 0, 0x10, 0, 8, 0),
        (20, 5, 5, K.EXEC, 0, 5, 0, 0, 0),
        (30, 5, 5, K.FREE, 0, 0x10, 0, 0, 0),  # the new image frees an old address
        (40, 5, 5, K.MALLOC, 0, 0x10, 0, 16, 0),
        (50, 5, 5, K.MALLOC, 0, 0x10, 0, 32, 0),  # same address again: a free was missed
    ]
    art = write_artifact(tmp_path / "b.memtrack", rows_table(rows))
    s = process(art, tmp_path / "b.duckdb", progress=False)
    assert s.counters["frees_unmatched"] == 1
    assert s.counters["allocations_reused_without_free"] == 1
    con = open_run(tmp_path / "b.duckdb")
    assert q(con, "SELECT size, end_reason::VARCHAR, end_ts FROM allocations ORDER BY 1") == [
        (8, "exec", 20), (16, "reused", 50), (32, "end", END_NS)]
    assert q(con, "SELECT size FROM leaks ORDER BY 1") == [(8,), (32,)]


def test_thread_exit_frees_apart(tmp_path: Path) -> None:
    """glibc frees its tcache's blocks (freed once already) and the tcache itself (never
    returned by malloc) when a thread exits: counted apart from unmatched frees, which
    stay what they were everywhere else."""
    from memtrack.schema import EventKind as K

    rows = [
        (20, 100, 101, K.MALLOC, 0, 0xA0, 0, 100, 0),
        (21, 100, 102, K.MALLOC, 0, 0xC0, 0, 100, 0),
        (30, 100, 101, K.FREE, 0, 0xA0, 0, 0, 0),
        (31, 100, 102, K.FREE, 0, 0xC0, 0, 0, 0),
        (40, 100, 101, K.FREE, 0, 0xA0, 0, 0, 0),  # 101's tcache entry, freed again
        (41, 100, 102, K.FREE, 0, 0xC0, 0, 0, 0),  # freed again, but 102 allocates after
        (45, 100, 102, K.MALLOC, 0, 0xD0, 0, 100, 0),
        (50, 100, 101, K.FREE, 0, 0xB0, 0, 0, 0),  # 101's tcache itself: its last free
        (51, 100, 102, K.FREE, 0, 0xE0, 0, 0, 0),  # never seen, not 102's last free
        (52, 100, 102, K.FREE, 0, 0xD0, 0, 0, 0),
        (60, 100, 101, K.EXIT, 0, 0, 0, 0, 0),
        (61, 100, 102, K.EXIT, 0, 0, 0, 0, 0),
        (70, 100, 100, K.FREE, 0, 0xF0, 0, 0, 0),  # the main thread's: unmatched
        (80, 100, 100, K.EXIT, 1, 0, 0, 0, 0),
    ]
    cols = list(zip(*rows, strict=True))
    ev = pa.table({"ts": cols[0], "pid": cols[1], "tid": cols[2], "kind": [int(k) for k in
                   cols[3]], "allocator": [1] * len(rows), "flags": cols[4], "addr": cols[5],
                   "old_addr": cols[6], "size": cols[7], "stack_hash": cols[8]}, schema=EVENTS)
    art = write_artifact(tmp_path / "t.memtrack", ev)
    s = process(art, tmp_path / "t.duckdb", progress=False)
    assert (s.counters["frees_at_thread_exit"], s.counters["frees_unmatched"]) == (2, 3)
    assert "process: frees_unmatched 3" in s.lines()
    assert any(ln.startswith("note: 2 frees at thread exit are glibc's") for ln in s.lines())


def test_older_database_refused(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE meta (key VARCHAR, value VARCHAR)")
    con.execute("INSERT INTO meta VALUES ('schema_version', '0')")
    con.close()
    with pytest.raises(RunError, match="format 0 is older") as e:
        open_run(db)
    assert "\n" not in str(e.value)
    plain = tmp_path / "plain.duckdb"
    duckdb.connect(str(plain)).close()
    with pytest.raises(RunError, match="not a memtrack run database"):
        open_run(plain)


# The synthetic run with plain forks: each pid 200 process (both allocate or free) gets a
# copy of the blocks alive in pid 100 at its fork, D and E both times; alloc_ids after
# the calls' (A B F C D E G H X): {alloc_id: (the block copied, fork ts, end, end ts)}
INHERITED = {9: (4, 1800, "exit", 2000), 10: (5, 1800, "free", 1950),
             11: (4, 2300, "exit", 2600), 12: (5, 2300, "exit", 2600)}


@pytest.fixture(scope="module")
def forked(tmp_path_factory: pytest.TempPathFactory) -> duckdb.DuckDBPyConnection:
    d = tmp_path_factory.mktemp("forked")
    ev = events_table()
    flags = ev.column("flags").to_numpy()
    ev = ev.set_column(ev.schema.get_field_index("flags"), "flags",
                       pa.array(np.where(flags == VFORK, 0, flags), pa.uint64()))
    art = write_artifact(d / "f.memtrack", no_stacks(ev))
    s = process(art, d / "f.duckdb", progress=False)
    assert s.allocations == len(SIZES)
    assert s.counters["allocations_inherited"] == len(INHERITED)
    # the child's free of E's address ends its copy; 0xDEAD and the second process's free
    # of G's address stay unmatched
    assert s.counters["frees_unmatched"] == UNMATCHED_FREES - 1
    con = open_run(d / "f.duckdb")
    yield con
    con.close()


def test_inherited_blocks(forked: duckdb.DuckDBPyConnection,
                          run: duckdb.DuckDBPyConnection) -> None:
    """The copies: the child's pid and first thread, the fork's time and event, the
    copied block's size, address and stack; the child's free of E's address ends its
    copy of E, its exits end the rest; the parent's D and E stay the parent's."""
    rows = q(forked, """
        SELECT c.alloc_id, c.inherited_from, c.pid, c.tid, c.ts, c.event_id, c.size, c.addr,
               c.stack_id IS NOT DISTINCT FROM o.stack_id, c.end_reason::VARCHAR, c.end_ts,
               c.temporary, c.lifetime_ns
        FROM allocations c JOIN allocations o ON o.alloc_id = c.inherited_from
        ORDER BY c.alloc_id""")
    forks = dict(q(forked, "SELECT ts, event_id FROM events WHERE kind = 'fork'"))
    sizes, addrs = {4: 4096, 5: 1000}, {4: 0xD0, 5: 0xE0}
    assert rows == [
        (aid, src, 200, 200, ts, forks[ts], sizes[src], addrs[src], True, reason, end, False,
         end - ts if reason == "free" else None)
        for aid, (src, ts, reason, end) in INHERITED.items()]
    calls = q(forked, "SELECT alloc_id, size, end_reason::VARCHAR FROM allocations "
                      "WHERE inherited_from IS NULL ORDER BY 1")
    assert calls == q(run, "SELECT alloc_id, size, end_reason::VARCHAR "
                                      "FROM allocations ORDER BY 1")
    # a copy is no call: stack_costs counts it in peak and leaked only
    assert q(forked, "SELECT sum(calls), sum(bytes) FROM stack_costs") == [
        (len(SIZES), sum(SIZES))]


def test_inherited_heap_peak_leaks(forked: duckdb.DuckDBPyConnection) -> None:
    child = q(forked, "SELECT ts, heap_bytes FROM heap_timeline WHERE pid = 200 "
                      "ORDER BY event_id")
    de = 4096 + 1000  # the copies of D and E at each fork
    assert child == [(1800, de), (1900, de + 64), (1950, 4096 + 64), (2000, 0), (2300, de),
                     (2500, de + 128), (2600, 0)]
    # the second process's peak after X's malloc: its copies of D and E, and X
    assert q(forked, "SELECT peak_ts, peak_bytes FROM heap_peak WHERE pid = 200") == [
        (2500, de + 128)]
    assert q(forked, "SELECT alloc_id FROM peak WHERE pid = 200 ORDER BY 1") == [
        (8,), (11,), (12,)]
    # pid 100's peak and heap are as in the vfork run
    assert q(forked, "SELECT peak_ts, peak_bytes FROM heap_peak WHERE pid = 100") == [
        (PEAK["ts"], PEAK["bytes"])]
    leaks = dict(q(forked, "SELECT alloc_id, end_reason::VARCHAR FROM leaks"))
    assert leaks == {**{k: v[0] for k, v in LEAKS.items()},
                     **{k: v[2] for k, v in INHERITED.items() if v[2] != "free"}}
    assert q(forked, "SELECT sum(leaked_bytes) FROM stack_costs WHERE pid = 200") == [
        (64 + 128 + 4096 + 4096 + 1000,)]


def test_inheritance_rules(tmp_path: Path) -> None:
    """A child's realloc of an inherited block ends its copy (and links the new block to
    it); a vfork child (CLONE_VM) and a child that execs before touching the heap
    inherit nothing; a grandchild inherits its parent's copies as they are at its fork."""
    rows = [
        (10, 5, 5, K.MALLOC, 0, 0x10, 0, 8, 0),
        (20, 5, 5, K.MALLOC, 0, 0x20, 0, 16, 0),
        (30, 5, 5, K.FORK, 0, 6, 0, 0, 0),  # 6 reallocs 0x10, forks 8, exits
        (31, 6, 6, K.REALLOC, 0, 0x30, 0x10, 24, 0),
        (32, 6, 6, K.FORK, 0, 8, 0, 0, 0),
        (33, 8, 8, K.FREE, 0, 0x30, 0, 0, 0),  # 8 frees 6's new block: a copy too
        (34, 8, 8, K.EXIT, 1, 0, 0, 0, 0),
        (35, 6, 6, K.EXIT, 1, 0, 0, 0, 0),
        (40, 5, 5, K.FORK, CLONE_VM, 7, 0, 0, 0),  # vfork: shares 5's memory
        (41, 7, 7, K.FREE, 0, 0x20, 0, 0, 0),  # unmatched: the shared block is 5's
        (42, 7, 7, K.EXIT, 1, 0, 0, 0, 0),
        (50, 5, 5, K.FORK, 0, 9, 0, 0, 0),  # fork + exec, no heap event between
        (51, 9, 9, K.EXEC, 0, 9, 0, 0, 0),
        (52, 9, 9, K.EXIT, 1, 0, 0, 0, 0),
    ]
    art = write_artifact(tmp_path / "i.memtrack", rows_table(rows))
    s = process(art, tmp_path / "i.duckdb", progress=False)
    assert s.counters["frees_unmatched"] == 1
    assert s.counters["allocations"] == 3 and s.counters["allocations_inherited"] == 4
    con = open_run(tmp_path / "i.duckdb")
    assert q(con, "SELECT alloc_id, pid, ts, size, end_reason::VARCHAR, end_ts, "
                  "inherited_from, realloc_of FROM allocations ORDER BY alloc_id") == [
        (0, 5, 10, 8, "end", END_NS, None, None),
        (1, 5, 20, 16, "end", END_NS, None, None),
        (2, 6, 31, 24, "exit", 35, None, 3),  # 6's realloc of its copy of 0x10
        (3, 6, 30, 8, "realloc", 31, 0, None),
        (4, 6, 30, 16, "exit", 35, 1, None),
        (5, 8, 32, 24, "free", 33, 2, None),  # 8: 6's new block, freed by 8 ...
        (6, 8, 32, 16, "exit", 34, 4, None),  # ... and 6's copy of 0x20
    ]


def test_exec_ends_a_forked_childs_prelude(tmp_path: Path) -> None:
    """A child forked then exec'd (a shell's pipeline command): what its prelude (fork to
    exec, the parent's program) holds, the copies it inherited and the blocks it
    allocated, ends at its exec and is in no process's calls, heap, peak or leaks; its
    frees there still end its copies. A child forked without exec keeps its copies."""
    rows = [
        (10, 5, 5, K.MALLOC, 0, 0x10, 0, 1000, 0),  # the parent's heap: 1000 + 2000
        (20, 5, 5, K.MALLOC, 0, 0x20, 0, 2000, 0),
        (30, 5, 5, K.FORK, 0, 6, 0, 0, 0),  # 6: fork + exec
        (31, 6, 6, K.MALLOC, 0, 0x30, 0, 40, 0),  # prelude: its own block ...
        (32, 6, 6, K.FREE, 0, 0x10, 0, 0, 0),  # ... and the free of a copy
        (33, 6, 6, K.MALLOC, 0, 0x40, 0, 50, 0),  # freed in the prelude
        (34, 6, 6, K.FREE, 0, 0x40, 0, 0, 0),
        (40, 6, 6, K.EXEC, 0, 6, 0, 0, 0),
        (41, 6, 6, K.MALLOC, 0, 0x50, 0, 300, 0),  # the exec'd program's: leaked
        (42, 6, 6, K.MALLOC, 0, 0x60, 0, 100, 0),
        (43, 6, 6, K.FREE, 0, 0x60, 0, 0, 0),
        (44, 6, 6, K.EXIT, 1, 0, 0, 0, 0),
        (50, 5, 5, K.FORK, 0, 7, 0, 0, 0),  # 7: fork, no exec
        (51, 7, 7, K.FREE, 0, 0x20, 0, 0, 0),  # ends its copy of 0x20
        (52, 7, 7, K.EXIT, 1, 0, 0, 0, 0),
    ]
    art = write_artifact(tmp_path / "x.memtrack", rows_table(rows))
    s = process(art, tmp_path / "x.duckdb", progress=False)
    con = open_run(tmp_path / "x.duckdb")
    assert q(con, "SELECT pid, ts, size, end_reason::VARCHAR, inherited_from IS NOT NULL "
                  "FROM allocations WHERE pid = 6 ORDER BY ts") == [
        (6, 41, 300, "exit", False), (6, 42, 100, "free", False)]
    assert q(con, "SELECT ts, heap_bytes FROM heap_timeline WHERE pid = 6 ORDER BY 1") == [
        (41, 300), (42, 400), (43, 300), (44, 0)]
    assert q(con, "SELECT pid, sum(calls), sum(bytes), sum(leaked_bytes) FROM stack_costs "
                  "GROUP BY 1 ORDER BY 1") == [(5, 2, 3000, 3000), (6, 2, 400, 300),
                                                (7, 0, 0, 1000)]
    assert q(con, "SELECT pid, peak_bytes FROM heap_peak ORDER BY 1") == [
        (5, 3000), (6, 400), (7, 3000)]
    assert q(con, "SELECT ts, heap_bytes FROM heap_timeline WHERE pid = 7 ORDER BY 1") == [
        (50, 3000), (51, 1000), (52, 0)]
    con.close()
    assert s.counters["frees_unmatched"] == 0
    assert s.counters["allocations_before_exec"] == 2
    # 7's copies of 0x10 and 0x20 (6's copies were in its prelude)
    assert s.counters["allocations_inherited"] == 2
