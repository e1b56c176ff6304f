"""capture --python-allocators on (issue 31): CPython's object allocator recorded as the
family pymalloc, through the command line on fixtures/python/objects.py: every object at
its line on 3.10 to 3.13 (pyenv's builds), nothing of it by default, its totals
against memray's --trace-python-allocators on the same program, the families of a block
freed by the other allocator, and an interpreter whose allocator is inlined (Debian's
PGO python3.11): one warning, no probes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "fixtures" / "python" / "objects.py"
MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
PYENV = Path.home() / ".pyenv/versions"
BUILT = {"3.10": PYENV / "3.10.13/bin/python3.10", "3.11": PYENV / "3.11.7/bin/python3.11",
         "3.12": PYENV / "3.12.1/bin/python3.12", "3.13": PYENV / "3.13.0/bin/python3.13"}
N = 10_000


def site() -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, ln in enumerate(lines, start=1) if "# site objects" in ln)


def run(tmp_path: Path, python: str | Path, *args: str, options: tuple[str, ...] = (
        "--python-allocators", "on")) -> tuple[duckdb.DuckDBPyConnection, str]:
    art, db = tmp_path / "run.memtrack", tmp_path / "run.duckdb"
    r = subprocess.run([*MEMTRACK, "capture", "-o", str(art), *options, "--", str(python),
                        *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    p = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db), "-q"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return duckdb.connect(str(db), read_only=True), r.stdout + r.stderr


def at_line(con: duckdb.DuckDBPyConnection, line: int) -> list[tuple[str, str, int, int]]:
    """(family, kind, size, count) of the allocations made at `line` of objects.py (their
    site: the innermost Python frame)."""
    return con.execute("""
        SELECT allocator::VARCHAR, kind::VARCHAR, size, count(*) FROM allocation_sites
        WHERE location = 'objects' AND file LIKE '%objects.py' AND line = ?
        GROUP BY ALL ORDER BY ALL""", [line]).fetchall()


def under(con: duckdb.DuckDBPyConnection, function: str) -> list[tuple[str, str, int, int]]:
    """(family, kind, size, count) of the allocations whose stack runs through
    `function` of objects.py."""
    return con.execute("""
        SELECT allocator::VARCHAR, kind::VARCHAR, size, count(*) FROM allocations
        WHERE stack_id IN (SELECT stack_id FROM stack_lines WHERE method = 'python'
                           AND name = ? AND file LIKE '%objects.py')
        GROUP BY ALL ORDER BY ALL""", [function]).fetchall()


@pytest.mark.bpf
@pytest.mark.parametrize("version", sorted(BUILT))
def test_every_object_at_its_line(tmp_path: Path, version: str) -> None:
    """N instances of a class without a free list, made at one line: exactly N
    allocations of the family pymalloc there, each its object's size, each freed by
    _PyObject_Free (a free of the same family) when the list goes. The loop's ints
    (i > 256) are made by the `for` line, the list holding the objects (8 N bytes, over
    512: pymalloc passes it to malloc, recorded once, as pymalloc's) by the line before;
    CPython adds only 3.12's and 3.13's collector's strings at the line."""
    python = BUILT[version]
    if not python.exists():
        pytest.skip(f"no {python} here")
    con, _ = run(tmp_path, python, str(SCRIPT), "objects", str(N))
    rows = at_line(con, site())
    # 32 bytes: the PyObject header and the GC header of a heap type's instance
    assert [r for r in rows if r[2] == 32] == [("pymalloc", "malloc", 32, N)]
    # 3.12 and 3.13 run the cyclic collector between instructions (_Py_HandlePending),
    # here once per 700 (3.13: 2000) container objects, and its invoke_gc_callback
    # decodes "start" and "stop" (3.11 makes none there)
    rest = [r for r in rows if r[2] != 32]
    assert {(f, k, s) for f, k, s, _ in rest} <= {("pymalloc", "malloc", 45),
                                                  ("pymalloc", "malloc", 46)}
    assert sum(c for *_, c in rest) <= (2 * (N // 700 + 1) if version != "3.11" else 0)
    frees = con.execute("""
        SELECT e.allocator::VARCHAR, count(*) FROM allocation_sites a
        JOIN events e ON e.event_id = a.free_event_id
        WHERE a.location = 'objects' AND a.line = ? AND a.size = 32
        GROUP BY ALL""",
                        [site()]).fetchall()
    assert frees == [("pymalloc", N)]
    # the list's 8 N bytes: one allocation, pymalloc's, not a malloc too
    keep = at_line(con, site() - 2)
    assert ("pymalloc", "malloc", 8 * N, 1) in keep
    assert {f for f, *_ in keep} == {"pymalloc"}
    counters = dict(con.execute("SELECT key, value FROM meta").fetchall())
    assert '"frees_unmatched": 0' in counters["counters"]


@pytest.mark.bpf
def test_off_by_default(tmp_path: Path) -> None:
    """Without the option the objects never reach a probe (pymalloc serves them from its
    arenas); the list of N slots, over 512 bytes, does, by malloc."""
    con, _ = run(tmp_path, BUILT["3.11"] if BUILT["3.11"].exists() else sys.executable,
                 str(SCRIPT), "objects", str(N), options=())
    assert at_line(con, site()) == []
    assert [(f, c) for f, _, _, c in at_line(con, site() - 2)] == [("libc", 1)]
    assert con.execute("SELECT count(*) FROM events WHERE allocator = 'pymalloc'"
                       ).fetchone() == (0,)


MEMRAY_TOTALS = """
import sys
import memray
from memray import AllocatorType as A
frees = {A.FREE, A.MUNMAP, A.PYMALLOC_FREE}
count = size = 0
for rec in memray.FileReader(sys.argv[1]).get_allocation_records():
    if A(rec.allocator) not in frees and any(
            f[0] == sys.argv[2] for f in rec.stack_trace()):
        count += 1
        size += rec.size
print(count, size)
"""


@pytest.mark.bpf
def test_totals_against_memray(tmp_path: Path) -> None:
    """The dict/list loop (with zlib, whose state is malloc'd): the allocations made
    under `churn`, pymalloc's and malloc's, against memray run --trace-python-allocators
    on the same interpreter and program, within 1 % in count and bytes. memray calls
    PyMem_RawMalloc's allocations pymalloc's (memtrack: libc's, which serves them) and
    adds one 72-byte bound method per C method call under its profile hook
    (trace_call_function -> PyCMethod_New: `.encode()`, every 100th round)."""
    try:
        import memray  # noqa: F401
    except ImportError:
        pytest.skip("memray is not installed (the dev extras)")
    rounds = 20_000
    con, _ = run(tmp_path, sys.executable, str(SCRIPT), "churn", str(rounds))
    ours = under(con, "churn")
    assert {f for f, *_ in ours} == {"pymalloc", "libc"}
    count = sum(c for *_, c in ours)
    size = sum(s * c for _, _, s, c in ours)
    out = tmp_path / "memray.bin"
    subprocess.run([sys.executable, "-m", "memray", "run", "-q", "--trace-python-allocators",
                    "-o", str(out), str(SCRIPT), "churn", str(rounds)], check=True,
                   capture_output=True, timeout=600)
    theirs = subprocess.run([sys.executable, "-c", MEMRAY_TOTALS, str(out), "churn"],
                            capture_output=True, text=True, check=True, timeout=600)
    m_count, m_size = map(int, theirs.stdout.split())
    assert count > 6 * rounds
    assert abs(count - m_count) <= 0.01 * m_count, (count, m_count)
    assert abs(size - m_size) <= 0.01 * m_size, (size, m_size)


MIXED = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
ctypes.pythonapi.PyObject_Malloc.restype = ctypes.c_void_p
p = libc.malloc(100003)
ctypes.pythonapi.PyObject_Free(ctypes.c_void_p(p))
q = ctypes.pythonapi.PyObject_Malloc(100005)
libc.free(ctypes.c_void_p(q))
"""


@pytest.mark.bpf
def test_freed_by_the_other_family(tmp_path: Path) -> None:
    """A malloc'd block given to PyObject_Free (pymalloc passes it on to free: one free,
    of the family pymalloc) and a PyObject_Malloc'd one (over 512 bytes: malloc'd
    inside it, one allocation, pymalloc's) given to free: each allocation ends at its
    free, and the two events' families tell the mismatch."""
    python = BUILT["3.11"] if BUILT["3.11"].exists() else Path(sys.executable)
    con, _ = run(tmp_path, python, "-c", MIXED)
    rows = con.execute("""
        SELECT a.size, a.allocator::VARCHAR, e.allocator::VARCHAR FROM allocations a
        JOIN events e ON e.event_id = a.free_event_id
        WHERE a.size IN (100003, 100005) ORDER BY a.size""").fetchall()
    assert rows == [(100003, "libc", "pymalloc"), (100005, "pymalloc", "libc")]
    counters = dict(con.execute("SELECT key, value FROM meta").fetchall())
    assert '"frees_unmatched": 0' in counters["counters"]


@pytest.mark.bpf
def test_inlined_allocator_is_one_warning(tmp_path: Path) -> None:
    """Debian's python3.11 (LTO and PGO) inlines _PyObject_Malloc into PyObject_Malloc
    and its callers: not probed, said once, nothing of the family pymalloc."""
    python = Path("/usr/bin/python3.11")
    if not python.exists():
        pytest.skip(f"no {python} here")
    con, out = run(tmp_path, python, str(SCRIPT), "objects", "100")
    notes = [ln for ln in out.splitlines() if "python allocators:" in ln]
    assert len(notes) == 1 and "/usr/bin/python3.11" in notes[0]
    assert "inlines that function" in notes[0]
    assert con.execute("SELECT count(*) FROM events WHERE allocator = 'pymalloc'"
                       ).fetchone() == (0,)


@pytest.mark.bpf
def test_regions_hold_none_of_memtracks_objects(tmp_path: Path) -> None:
    """fixtures/regions/empty_suite.py under the pytest plugin with every object
    recorded: no allocation in any test's region has a Python frame in memtrack's code
    (the plugin, the control helper: their requests are made before the begin and
    send none after it); test_limited, whose limits are sent inside its region, holds
    no more than test_empty; test_objects holds its objects besides."""
    work = tmp_path / "suite"
    work.mkdir()
    shutil.copy(ROOT / "fixtures" / "regions" / "empty_suite.py", work)
    art, db = tmp_path / "s.memtrack", tmp_path / "s.duckdb"
    # the plugin named, no other: the venv's hypothesis plugin, whose modules pytest's
    # assertion rewriting parses again at each run (no bytecode written here), made
    # 2.2 M of the run's 2.8 M allocations (74 s of this test, 22 s left), none in a region
    r = subprocess.run([*MEMTRACK, "capture", "-o", str(art), "--python-allocators", "on",
                        "--rss", "off", "--", sys.executable, "-m", "pytest", "-q", "-p",
                        "no:cacheprovider", "-p", "memtrack.pytest", "empty_suite.py"],
                       capture_output=True, text=True, timeout=900, cwd=work,
                       env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 0 and "3 passed" in r.stdout, (r.stdout, r.stderr)
    p = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db), "-q"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    con = duckdb.connect(str(db), read_only=True)
    memtrack_files = str(ROOT / "memtrack") + "/%"
    got = dict((name.split("::")[1], (calls, ours)) for name, calls, ours in con.execute("""
        SELECT m.name, count(*), count(*) FILTER (WHERE a.stack_id IN (
            SELECT stack_id FROM stack_frames JOIN frames USING (frame_id)
            WHERE method = 'python' AND file LIKE ?))
        FROM region_metrics m JOIN region_allocations USING (region_id)
        JOIN allocations a USING (alloc_id) GROUP BY m.name""", [memtrack_files]).fetchall())
    assert {k: ours for k, (_, ours) in got.items()} == {
        "test_empty": 0, "test_limited": 0, "test_objects": 0}
    assert got["test_limited"][0] == got["test_empty"][0] > 0  # pytest's own (pluggy's)
    assert got["test_objects"][0] >= got["test_empty"][0] + 100
    # the helper's frames are recorded and named: its objects outside the regions (its
    # requests, made before each begin) are found so
    assert con.execute("""
        SELECT count(*) FROM allocations WHERE stack_id IN (
            SELECT stack_id FROM stack_frames JOIN frames USING (frame_id)
            WHERE method = 'python' AND file LIKE ? AND name = 'Request.__init__')""",
                       [memtrack_files]).fetchone()[0] > 0
