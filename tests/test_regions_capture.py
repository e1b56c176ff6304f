"""Regions end to end: real programs mark regions through the shipped helpers (the
pytest plugin, the C header, the Python module), captured, processed, reported; every
figure checked against what the program allocated."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest
from conftest import CONTROL, FIXTURES, ROOT, build
from support.capture import run

pytestmark = pytest.mark.bpf

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
sys.path.insert(0, str(FIXTURES / "regions"))
import suite  # noqa: E402  (fixtures/regions/suite.py: its sizes)


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*MEMTRACK, *args], capture_output=True, text=True, timeout=600,
                       cwd=cwd)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


def process(art: Path) -> duckdb.DuckDBPyConnection:
    db = art.with_suffix(".duckdb")
    cli("process", "-q", str(art), "-o", str(db))
    return duckdb.connect(str(db), read_only=True)


def rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None
         ) -> list[dict[str, Any]]:
    cur = con.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def capture_suite(tmp_path: Path, name: str, *pytest_args: str, options: tuple[str, ...] = (),
                  files: tuple[str, ...] = ("suite.py",)) -> Path:
    """`memtrack capture -- python -m pytest suite.py` from the shell, in a directory of
    its own (node ids: suite.py::test_...)."""
    work = tmp_path / name
    work.mkdir()
    for f in files:
        shutil.copy(FIXTURES / "regions" / f, work / f)
    art = tmp_path / f"{name}.memtrack"
    r = cli("capture", "-o", str(art), *options, "--", sys.executable, "-m", "pytest", "-q",
            "-p", "no:cacheprovider", *pytest_args, *files, cwd=work)
    assert f"{3 + len(files) - 1} passed" in r.stdout, r.stdout
    return art


def test_pytest_plugin_makes_each_test_a_region(tmp_path: Path) -> None:
    """The issue's suite: a 50 MB buffer allocated and freed, 1,000 blocks leaked, nothing
    allocated; each test's figures are exactly its body's, setup and teardown outside."""
    art = capture_suite(tmp_path, "plugin", "-p", "memtrack.pytest")
    con = process(art)
    m = {r["name"]: r for r in rows(con, "SELECT * FROM region_metrics ORDER BY begin_ts")}
    assert list(m) == ["suite.py::test_big_buffer", "suite.py::test_leak",
                       "suite.py::test_nothing"]
    big, leak, nothing = m.values()
    root = con.execute("SELECT value::UINTEGER FROM meta WHERE key = 'root_pid'").fetchone()
    assert {(r["pid"], r["tid"]) for r in m.values()} == {(root[0], root[0])}  # type: ignore[index]
    assert all(r["ended"] and r["depth"] == 0 for r in m.values())

    assert (big["calls"], big["bytes"], big["peak_heap_bytes"]) == (1, suite.BIG, suite.BIG)
    assert (big["frees"], big["freed_bytes"]) == (1, suite.BIG)
    assert (big["alive_calls"], big["leaked_calls"]) == (0, 0)
    # memset made the buffer resident: RSS rose by it, then fell (free: munmap)
    assert big["peak_rss_bytes"] - big["rss_at_begin_bytes"] >= suite.BIG

    sizes = [suite.LEAK_SIZE + i for i in range(suite.LEAKS)]
    assert (leak["calls"], leak["bytes"], leak["peak_heap_bytes"]) == (
        suite.LEAKS, sum(sizes), sum(sizes))
    assert (leak["alive_calls"], leak["alive_bytes"]) == (suite.LEAKS, sum(sizes))
    assert (leak["leaked_calls"], leak["leaked_bytes"]) == (suite.LEAKS, sum(sizes))
    assert leak["avg_size"] == sum(sizes) / suite.LEAKS
    assert leak["frees"] == 0
    got = sorted(r[0] for r in con.execute("""
        SELECT a.size FROM region_allocations ra JOIN allocations a USING (alloc_id)
        JOIN regions r USING (region_id) WHERE r.name = 'suite.py::test_leak'""").fetchall())
    assert got == sizes

    assert (nothing["calls"], nothing["bytes"], nothing["peak_heap_bytes"]) == (0, 0, 0)
    assert (nothing["frees"], nothing["alive_calls"]) == (0, 0)

    # the fixture's setup and teardown allocations: three each, in no region
    for size in (suite.SETUP_SIZE, suite.TEARDOWN_SIZE):
        n, inside = con.execute("""
            SELECT count(*), count(ra.region_id) FROM allocations a
            LEFT JOIN region_allocations ra USING (alloc_id) WHERE a.size = ?""",
                                [size]).fetchone()  # type: ignore[misc]
        assert (n, inside) == (3, 0), size
    # the heap timeline within the big test: up by the buffer, back to 0
    tl = [r[0] for r in con.execute("""
        SELECT heap_bytes FROM region_heap_timeline JOIN regions USING (region_id)
        WHERE name = 'suite.py::test_big_buffer' ORDER BY event_id""").fetchall()]
    assert tl == [suite.BIG, 0]

    db = art.with_suffix(".duckdb")
    out = json.loads(cli("report", str(db), "--format", "json", "--region",
                         "suite.py::test_leak").stdout)
    (inst,) = out["instances"]
    assert (inst["alive_allocations"], inst["alive_bytes"]) == (suite.LEAKS, sum(sizes))
    (site,) = out["sections"]["alive"]
    assert site["value"] == sum(sizes) and site["location"] != "[no stack]"
    names = [f["function"] for f in site["backtraces"][0]["frames"]]
    assert names[0] == "test_leak", names  # a Python cut's site: its innermost Python frame
    # the allocator's caller, under the site: ctypes' call into malloc (libffi)
    callers = {r[0] for r in con.execute("""
        SELECT m.path FROM region_allocations ra JOIN allocations a USING (alloc_id)
        JOIN regions r USING (region_id) JOIN stack_frames f USING (stack_id)
        JOIN modules m USING (module_id)
        WHERE r.name = 'suite.py::test_leak' AND f.depth = 1""").fetchall()}
    assert len(callers) == 1 and "libffi" in callers.pop(), callers
    text = cli("report", str(db)).stdout
    lines = text.split("REGIONS")[1].splitlines()
    assert any(ln.endswith("  suite.py::test_big_buffer") and " 1 " in ln for ln in lines)


def test_plugin_entry_point_and_opt_out(tmp_path: Path) -> None:
    """Installed, the plugin is active under capture without -p (a unittest test case
    too, around its call phase); -p no:memtrack.pytest turns it off; outside capture it
    does nothing."""
    fast = ("--stacks", "off", "--rss", "off")
    con = process(capture_suite(tmp_path, "auto", options=fast,
                                files=("suite.py", "suite_unittest.py")))
    assert [r[0] for r in con.execute("SELECT name FROM regions ORDER BY region_id")
            .fetchall()] == ["suite.py::test_big_buffer", "suite.py::test_leak",
                             "suite.py::test_nothing", "suite_unittest.py::Leaks::test_seven"]
    assert con.execute("""
        SELECT count(*) FROM region_allocations JOIN allocations a USING (alloc_id)
        JOIN regions USING (region_id)
        WHERE name = 'suite_unittest.py::Leaks::test_seven' AND a.size = 7777""").fetchone() \
        == (7,)
    con = process(capture_suite(tmp_path, "off", "-p", "no:memtrack.pytest", options=fast))
    assert con.execute("SELECT count(*) FROM regions").fetchone() == (0,)
    work = tmp_path / "auto"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTRACK_CONTROL")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "suite.py"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=300)
    assert "3 passed" in r.stdout and "memtrack" not in r.stdout


def test_two_threads_each_in_its_own_region(tracker: Any, tmp_path: Path) -> None:
    """Threads A and B allocate in lockstep inside their own regions (A's nests one),
    the main thread between them outside any; C's region never ends."""
    exe = build(["regions/threads.c"], libs=("-lpthread",))
    r = run(tracker, tmp_path, [str(exe)])
    assert r.result.status == 0, r.stdout
    tids = dict(re.findall(r"^thread (\w+) (\d+)$", r.stdout, re.M))
    con = process(r.path)
    reg = {x["name"]: x for x in rows(con, "SELECT * FROM regions")}
    assert set(reg) == {"A", "A/inner", "B", "C never ended"}
    for name, who in (("A", "A"), ("A/inner", "A"), ("B", "B"), ("C never ended", "C")):
        assert reg[name]["tid"] == int(tids[who])
    assert reg["A/inner"]["parent_id"] == reg["A"]["region_id"]
    assert (reg["A/inner"]["depth"], reg["A"]["depth"]) == (1, 0)
    c = reg["C never ended"]
    assert not c["ended"] and all(reg[n]["ended"] for n in ("A", "A/inner", "B"))
    exit_ts = con.execute("SELECT exit_ts FROM threads WHERE tid = ?", [c["tid"]]).fetchone()
    assert c["end_ts"] == exit_ts[0]  # type: ignore[index]

    def sizes(name: str) -> list[int]:
        return [s for (s,) in con.execute("""
            SELECT a.size FROM region_allocations ra JOIN allocations a USING (alloc_id)
            JOIN regions r USING (region_id) WHERE r.name = ? ORDER BY a.event_id""",
                                          [name]).fetchall()]

    rounds, half = 40, 20
    assert sizes("A") == [1000 + i for i in range(half)] + [1500 + i for i in range(half, rounds)]
    assert sizes("A/inner") == [1500 + i for i in range(half, rounds)]
    assert sizes("B") == [2000 + i for i in range(rounds)]
    assert sizes("C never ended") == [4000]
    main = [s for (s,) in con.execute("""
        SELECT a.size FROM allocations a LEFT JOIN region_allocations ra USING (alloc_id)
        WHERE a.tid = ? AND ra.region_id IS NULL AND a.size BETWEEN 3000 AND 3999""",
                                      [int(tids["main"])]).fetchall()]
    assert sorted(main) == [3000 + i for i in range(rounds)]
    # they did interleave: B allocated between A's first and last allocation
    a_span = con.execute("""SELECT min(ts), max(ts) FROM allocations
                            WHERE tid = ? AND size BETWEEN 1000 AND 1999""",
                         [int(tids["A"])]).fetchone()
    b_in = con.execute("SELECT count(*) FROM allocations WHERE tid = ? AND ts BETWEEN ? AND ?",
                       [int(tids["B"]), *a_span]).fetchone()  # type: ignore[misc]
    assert b_in[0] >= rounds - 2  # type: ignore[index]
    m = {x["name"]: x for x in rows(con, "SELECT * FROM region_metrics")}
    # each thread frees its blocks inside its region: everything back, nothing alive
    assert m["B"]["frees"] == rounds and m["B"]["alive_calls"] == 0
    assert m["B"]["peak_heap_bytes"] == sum(2000 + i for i in range(rounds))
    assert m["A/inner"]["frees"] == rounds and m["A/inner"]["peak_heap_bytes"] == sum(
        1500 + i for i in range(half, rounds))
    assert (m["C never ended"]["alive_calls"], m["C never ended"]["leaked_calls"]) == (1, 1)


def test_python_helper(tracker: Any, tmp_path: Path) -> None:
    """memtrack_control.py: begin/end, region() as context manager and decorator, a
    refused end, an end with nothing open; exact attribution of ctypes mallocs."""
    code = r"""
import ctypes, sys
sys.path.insert(0, sys.argv[1])
import memtrack_control as m
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
a = libc.malloc(11111)
assert m.active() and m.begin("outer"), m.last_error
b = libc.malloc(22222)
with m.region("inner") as on:
    assert on
    c = libc.malloc(33333)
    assert not m.end("nope") and "innermost open region" in m.last_error, m.last_error
libc.free(b)
@m.region("decorated")
def f():
    libc.free(libc.malloc(44444))
f()
assert m.end("outer")
assert not m.end() and "no open region" in m.last_error, m.last_error
libc.malloc(55555)
"""
    r = run(tracker, tmp_path, [sys.executable, "-c", code, str(CONTROL)])
    assert r.result.status == 0
    con = process(r.path)
    got = {name: sorted(s for (s,) in con.execute("""
        SELECT a.size FROM region_allocations ra JOIN allocations a USING (alloc_id)
        JOIN regions USING (region_id) WHERE name = ?""", [name]).fetchall())
           for name in ("outer", "inner", "decorated")}
    assert got == {"outer": [22222, 33333, 44444], "inner": [33333], "decorated": [44444]}
    m = {x["name"]: x for x in rows(con, "SELECT * FROM region_metrics")}
    assert m["outer"]["peak_heap_bytes"] == 22222 + 33333 + 44444 - 22222
    assert m["outer"]["alive_calls"] == 1 and m["outer"]["frees"] == 2
    assert con.execute("SELECT count(*) FROM regions WHERE NOT ended").fetchone() == (0,)


def test_cxx_example_bench(tracker: Any, tmp_path: Path) -> None:
    """examples/regions/bench.cc: one region per case; the leaking case's 100 blocks
    (new int[25]) are alive at its end, the harness's own allocation in no case."""
    exe = build([ROOT / "examples" / "regions" / "bench.cc"], flags=("-O2", "-g"))
    r = run(tracker, tmp_path, [str(exe)])
    assert r.result.status == 0
    con = process(r.path)
    m = {x["name"]: x for x in rows(con, "SELECT * FROM region_metrics ORDER BY begin_ts")}
    assert list(m) == ["vector_push", "map_insert", "string_concat", "leak_100"]
    leak = m["leak_100"]
    assert (leak["calls"], leak["bytes"], leak["alive_calls"], leak["alive_bytes"]) == (
        100, 100 * 100, 100, 100 * 100)
    assert m["map_insert"]["calls"] >= 2000 and m["map_insert"]["alive_calls"] == 0
    assert all(x["ended"] and x["alive_calls"] == 0 for n, x in m.items() if n != "leak_100")
    reserve = con.execute("""
        SELECT count(*) FROM allocations a LEFT JOIN region_allocations ra USING (alloc_id)
        WHERE a.size = 100 * 8 AND ra.region_id IS NULL""").fetchone()
    assert reserve == (1,)  # cache.reserve(100): the harness's, outside every case
