"""A program that forks without exec, twice deep (fixtures/stacks/forktree.c), through
the command line: the child and the grandchild inherit their parent's address space
(their stacks unwind and symbolize as the parent's would) and its live blocks (their
frees of them pair with their copies, which are in their heaps and leaks), while the
parent's blocks stay the parent's. The parent's blocks include one a shared library's
constructor allocated, whose stack ends in ld.so's _dl_start_user and is complete."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from conftest import build

from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
LIBC_START = ["main", "__libc_start_call_main", "__libc_start_main", "_start"]
PARENT_BEFORE_FORK = [1000, 1001, 1002, 1003, 1100, 1200, 4321]
# size -> how each process's block of that size ends (None: the process has none)
ENDS = {  # parent, child, grandchild
    1000: ("free", "free", None), 1001: ("free", "free", None),
    1002: ("free", "exit", "free"), 1003: ("free", "exit", "exit"),
    1100: ("free", "exit", "exit"), 1200: ("exit", "exit", "exit"),
    4321: ("exit", "exit", "exit"), 2001: (None, "free", None),
    2002: (None, "exit", "exit"), 3001: (None, None, "exit"),
}
# sizes each process allocated itself (the rest are inherited copies)
OWN = ({1000, 1001, 1002, 1003, 1100, 1200, 4321}, {2001, 2002}, {3001})
SITES = {1000: ["parent_alloc", *LIBC_START], 2001: ["child_work", *LIBC_START],
         3001: ["grandchild_work", "child_work", *LIBC_START],
         # call_init inlined into itself (libc6-dbg's line tables), as gdb shows it
         4321: ["ctor_alloc", "call_init", "call_init", "_dl_init", "_dl_start_user"]}


def fixture_exe() -> Path:
    lib = build(["stacks/forkctor.c"], name="libforkctor", shared=True, flags=("-O1", "-g"))
    return build(["stacks/forktree.c"], flags=("-O1", "-g"),
                 libs=(str(lib), f"-Wl,-rpath,{lib.parent}"))


def capture_forks(cmd: list[str], d: Path, env: dict[str, str] | None = None,
                  options: tuple[str, ...] = ()) -> tuple[duckdb.DuckDBPyConnection, int, int]:
    """`cmd` (which prints `parent PID CHILD`) captured (with capture's `options`) and
    processed through the CLI in `d`: the run database, the parent's and the child's
    pid."""
    art, db = d / "f.memtrack", d / "f.duckdb"
    cap = subprocess.run([*MEMTRACK, "capture", "-o", str(art), *options, "--", *cmd],
                         capture_output=True, text=True, timeout=300, env=env)
    assert cap.returncode == 0, cap.stderr
    (parent, child), = [(int(a), int(b)) for a, b in
                        re.findall(r"^parent (\d+) (\d+)$", cap.stdout, re.M)]
    proc = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return open_run(db), parent, child


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[duckdb.DuckDBPyConnection,
                                                           tuple[int, int, int]]:
    d = tmp_path_factory.mktemp("forktree")
    con, parent, child = capture_forks([str(fixture_exe())], d)
    (grandchild,), = con.execute("SELECT pid FROM processes WHERE ppid = ?",
                                 [child]).fetchall()
    yield con, (parent, child, grandchild)
    con.close()


def test_inherited_blocks_pair_and_end(run) -> None:
    con, pids = run
    sizes = sorted(ENDS)
    got = {}
    for pid, size, end, inherited in con.execute(
            "SELECT pid, size, end_reason::VARCHAR, inherited_from IS NOT NULL "
            "FROM allocations WHERE size IN (SELECT unnest(?))", [sizes]).fetchall():
        assert (pid, size) not in got, f"two blocks of {size} in {pid}"
        got[(pid, size)] = (end, inherited)
    want = {(pid, size): (ends[k], size not in OWN[k])
            for size, ends in ENDS.items() for k, pid in enumerate(pids) if ends[k]}
    assert got == want
    # every free of the child and the grandchild ended a block (none is unmatched)
    unmatched = con.execute("""
        SELECT e.pid, count(*) FROM events e WHERE e.kind = 'free' AND e.addr != 0
          AND e.pid IN (SELECT unnest(?)) AND NOT EXISTS (
            SELECT 1 FROM allocations a WHERE a.free_event_id = e.event_id)
        GROUP BY 1""", [list(pids[1:])]).fetchall()
    assert unmatched == []
    counters = json.loads(con.execute("SELECT value FROM meta WHERE key = 'counters'"
                                      ).fetchone()[0])
    assert counters["allocations_inherited"] == con.execute(
        "SELECT count(*) FROM allocations WHERE inherited_from IS NOT NULL").fetchone()[0]


def test_copies_chain_to_the_parents_blocks(run) -> None:
    """A copy names the block it copies (same address, size and stack, in the parent
    process): the grandchild's copy of 1003 -> the child's copy -> the parent's block."""
    con, (parent, child, grandchild) = run
    rows = con.execute("""
        SELECT c.pid, o.pid, c.addr = o.addr, c.size = o.size, c.stack_id = o.stack_id,
               c.ts = (SELECT ts FROM events WHERE kind = 'fork' AND addr = c.pid)
        FROM allocations c JOIN allocations o ON o.alloc_id = c.inherited_from
        WHERE c.size IN (SELECT unnest(?))""", [sorted(ENDS)]).fetchall()
    assert rows and all(r[2:] == (True, True, True, True) for r in rows)
    assert {r[:2] for r in rows} == {(child, parent), (grandchild, child)}


def test_heaps_hold_the_copies(run) -> None:
    con, (parent, child, grandchild) = run

    def heap_at_fork(pid: int) -> int:
        return con.execute("""
            SELECT t.heap_bytes FROM heap_timeline t JOIN events e USING (event_id)
            WHERE t.pid = ? AND e.kind = 'fork' AND e.addr = ?""", [pid, pid]).fetchone()[0]

    parent_at_fork = con.execute("""
        SELECT heap_bytes FROM heap_timeline WHERE pid = ? AND event_id < (
            SELECT event_id FROM events WHERE kind = 'fork' AND addr = ?)
        ORDER BY event_id DESC LIMIT 1""", [parent, child]).fetchone()[0]
    assert parent_at_fork == sum(PARENT_BEFORE_FORK)
    assert heap_at_fork(child) == parent_at_fork
    # the child freed 1000 and 1001, kept 2002 (2001 freed)
    child_at_fork = sum(PARENT_BEFORE_FORK) - 1000 - 1001 + 2002
    assert con.execute("""
        SELECT heap_bytes FROM heap_timeline WHERE pid = ? AND event_id < (
            SELECT event_id FROM events WHERE kind = 'fork' AND addr = ?)
        ORDER BY event_id DESC LIMIT 1""", [child, grandchild]).fetchone()[0] == child_at_fork
    assert heap_at_fork(grandchild) == child_at_fork
    peaks = dict(con.execute("SELECT pid, peak_bytes FROM heap_peak").fetchall())
    # the child: its fork's heap, less 1000 and 1001, plus 2001 (then freed) and 2002
    assert peaks[child] == max(sum(PARENT_BEFORE_FORK), child_at_fork)
    assert peaks[grandchild] == child_at_fork - 1002 + 3001
    leaked = dict(con.execute("SELECT pid, sum(size) FROM leaks WHERE size IN "
                              "(SELECT unnest(?)) GROUP BY 1", [sorted(ENDS)]).fetchall())
    for k, pid in enumerate((parent, child, grandchild)):
        assert leaked[pid] == sum(s for s, e in ENDS.items() if e[k] == "exit")
    # the parent's own calls are its own: the copies count in no process's calls
    calls = dict(con.execute("SELECT pid, sum(calls) FROM stack_costs WHERE pid IN "
                             "(SELECT unnest(?)) GROUP BY 1", [[child, grandchild]]).fetchall())
    own = dict(con.execute("SELECT pid, count(*) FROM allocations WHERE inherited_from IS NULL "
                           "AND pid IN (SELECT unnest(?)) GROUP BY 1",
                           [[child, grandchild]]).fetchall())
    assert calls == own


def test_stacks_unwind_as_the_parents(run) -> None:
    """The children's own allocations (no mapping snapshot of their own) and the copies
    unwind to complete stacks; the constructor's stack ends at _dl_start_user."""
    con, pids = run
    for size, want in SITES.items():
        for pid in (pids if size in (1000, 4321) else pids[1:]):
            if ENDS[size][pids.index(pid)] is None:
                continue
            row = con.execute("""
                SELECT a.stack_id, s.complete, s.stop FROM allocations a
                JOIN stacks s USING (stack_id) WHERE a.pid = ? AND a.size = ?""",
                              [pid, size]).fetchone()
            assert row is not None, (pid, size)
            names = [n for (n,) in con.execute(
                "SELECT name FROM stack_lines WHERE stack_id = ? AND depth > 0 "
                "ORDER BY position", [row[0]]).fetchall()]
            assert names == want, (pid, size)
            assert row[1:] == (True, "complete"), (pid, size)


def test_unwind_command_shows_a_childs_record(run) -> None:
    """`memtrack unwind --record` unwinds a child's record in its inherited space."""
    con, (_, _, grandchild) = run
    (h,), = con.execute("""SELECT s.stack_hash FROM allocations a JOIN stacks s
                           USING (stack_id) WHERE a.pid = ? AND a.size = 3001""",
                        [grandchild]).fetchall()
    art = con.execute("SELECT value FROM meta WHERE key = 'artifact'").fetchone()[0]
    r = subprocess.run([*MEMTRACK, "unwind", art, "--record", hex(h)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"pid {grandchild}: 7 frames (complete)" in r.stdout  # malloc, SITES[3001]
    for name in ("grandchild_work", "child_work", "main", "_start"):
        assert name in r.stdout


def test_leaks_match_valgrind(run, tmp_path: Path) -> None:
    """valgrind --trace-children=yes as the oracle: each process's blocks in use at its
    exit (the copies it inherited included) are the blocks memtrack says it leaked."""
    assert shutil.which("valgrind"), "valgrind missing: run scripts/setup"
    con, pids = run
    r = subprocess.run(["valgrind", "--trace-children=yes",
                        f"--log-file={tmp_path}/vg.%p", str(fixture_exe())],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (parent, child), = [(int(a), int(b)) for a, b in
                        re.findall(r"^parent (\d+) (\d+)$", r.stdout, re.M)]
    in_use = {}
    for log in tmp_path.glob("vg.*"):
        m = re.search(r"in use at exit: ([\d,]+) bytes in ([\d,]+) blocks", log.read_text())
        assert m, log.read_text()
        in_use[int(log.name[3:])] = (int(m[2].replace(",", "")), int(m[1].replace(",", "")))
    assert len(in_use) == 3
    (grandchild,) = set(in_use) - {parent, child}
    want = [in_use[p] for p in (parent, child, grandchild)]
    got = [tuple(con.execute("SELECT count(*), coalesce(sum(size), 0) FROM leaks "
                             "WHERE pid = ?", [p]).fetchone()) for p in pids]
    assert got == want
    # and as the report tells them, per process
    db = Path(con.execute("SELECT value FROM meta WHERE key = 'artifact'").fetchone()[0]
              ).with_suffix(".duckdb")
    for p, (blocks, size) in zip(pids, want, strict=True):
        r = subprocess.run([*MEMTRACK, "report", str(db), "--format", "json", "--pid", str(p)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        t = json.loads(r.stdout)["totals"]
        assert (t["leaked_allocations"], t["leaked_bytes"]) == (blocks, size)


PY_FORK = """
import os
keep = [str(i) * 20 for i in range(5000)]
pid = os.fork()
if pid == 0:
    del keep
    junk = [bytes(100) for _ in range(1000)]
    os._exit(0)
os.waitpid(pid, 0)
print("parent", os.getpid(), pid)
"""


def test_python_child_frees_its_inherited_objects(tmp_path: Path) -> None:
    """Debian's python3 (PYTHONMALLOC=malloc) builds 5000 strings, forks, and the child
    drops them: every free of the child ends a copy of its parent's block (none is
    unmatched), the strings' copies among them, and its own allocations' whole native
    stacks (--python-stacks mixed) are complete, as the parent's."""
    con, parent, child = capture_forks(["/usr/bin/python3", "-c", PY_FORK], tmp_path,
                                       env={**os.environ, "PYTHONMALLOC": "malloc"},
                                       options=("--python-stacks", "mixed"))
    unmatched = con.execute("""
        SELECT count(*) FROM events e WHERE e.kind = 'free' AND e.addr != 0 AND e.pid = ?
          AND NOT EXISTS (SELECT 1 FROM allocations a WHERE a.free_event_id = e.event_id)
        """, [child]).fetchone()[0]
    frees = con.execute("SELECT count(*) FROM events WHERE kind = 'free' AND pid = ?",
                        [child]).fetchone()[0]
    assert frees >= 5000 and unmatched == 0
    # the strings: one malloc each in the parent (str(i) * 20: 20 to 80 characters),
    # each freed by the child as its copy
    strings = con.execute("""
        SELECT count(*) FROM allocations c JOIN allocations o ON o.alloc_id = c.inherited_from
        WHERE c.pid = ? AND o.pid = ? AND c.end_reason = 'free'
          AND o.size BETWEEN 49 + 20 AND 49 + 80""", [child, parent]).fetchone()[0]
    assert strings >= 5000
    own = con.execute("""
        SELECT count(*), count(*) FILTER (WHERE s.complete) FROM allocations a
        JOIN stacks s USING (stack_id) WHERE a.pid = ? AND a.inherited_from IS NULL""",
                      [child]).fetchone()
    con.close()
    assert own[0] >= 1000 and own[1] >= 0.99 * own[0]
