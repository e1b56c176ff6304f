"""Stack records of deep Python stacks (issue 34), through the command line: a toolz-like
pytest suite (fixtures/pysuite) captured with the memtrack.pytest plugin, processed,
reported and exported; and stack records that do not grow with a Python loop's
allocations (PYTHONMALLOC=malloc).

One file of the suite runs, with the default pymalloc, as a user runs it (pytest's
assertion rewriting compiles every test module and plugin: C recursions over the syntax
tree whose native call paths are as many as its nodes, which only the default
--python-stacks python folds into their Python call paths; docs/DESIGN.md, Stack
identity). bench/bench_stack_records.py measures the whole suite, both allocators."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.pysuite import Paths, call_paths, capture_suite, memtrack

from memtrack.schema.artifact import Artifact

pytestmark = pytest.mark.bpf

# one file of the suite: pytest's start, collection and 38 tests (currying, composition,
# memoization)
SELECT = ("test_functools.py",)
TESTS = 38


def ok(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 0, r.stderr[-2000:]


def artifact_records(art: Path) -> int:
    """Stack records (native and Python) of an artifact."""
    a = Artifact.open(art)
    return a.read("stacks").table.num_rows + a.read("py_stacks").table.num_rows


def record_kinds(art: Path) -> tuple[int, int, int]:
    """An artifact's Python stack records, Python cuts and whole native stack records."""
    a = Artifact.open(art)
    stacks = a.read("stacks").table
    cuts = sum(stacks.column("python_cut").to_pylist())
    return a.read("py_stacks").table.num_rows, cuts, stacks.num_rows - cuts


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Paths]:
    tmp = tmp_path_factory.mktemp("pysuite")
    art, db = tmp / "r.memtrack", tmp / "r.duckdb"
    r = capture_suite(art, *SELECT)
    ok(r)
    assert f"{TESTS} passed" in r.stdout, r.stdout
    ok(memtrack("process", str(art), "-o", str(db), "-q"))
    return art, db, call_paths(db)


def test_suite_reports_and_exports(suite_run: tuple[Path, Path, Paths],
                                   tmp_path: Path) -> None:
    _, db, paths = suite_run
    assert paths.allocations > 0 and paths.python_paths > 0
    regions = json.loads(memtrack("query", str(db), "SELECT count(*) AS n FROM regions",
                                  "--format", "json").stdout)
    assert regions == [{"n": TESTS}]  # every test a region
    ok(memtrack("report", str(db)))
    ok(memtrack("report", str(db), "--html", str(tmp_path / "r.html")))
    assert (tmp_path / "r.html").stat().st_size > 0
    for fmt in ("folded", "pprof", "speedscope"):
        ok(memtrack("export", str(db), "--format", fmt, "-o", str(tmp_path / f"r.{fmt}")))
        assert (tmp_path / f"r.{fmt}").stat().st_size > 0


def test_records_against_call_paths(suite_run: tuple[Path, Path, Paths],
                                    tmp_path: Path) -> None:
    """One record per Python call path (and allocator caller): at least one per
    distinct Python call path, at most two; in an identical run the same Python records
    and Python cuts, and the whole native stacks of the code that ran before any Python
    frame (the interpreter's start-up) within a few: their stale slots (docs/DESIGN.md,
    "Stack identity")."""
    art, _, p = suite_run
    assert p.python_paths <= p.records <= 2 * p.python_paths, p
    again = tmp_path / "again.memtrack"
    ok(capture_suite(again, *SELECT))
    (py, cuts, native), (py2, cuts2, native2) = record_kinds(art), record_kinds(again)
    assert (py, cuts) == (py2, cuts2)
    assert abs(native - native2) <= max(3, native // 50), (native, native2)


LOOP = """import sys
rounds = int(sys.argv[1])
keep = []
def record(i):
    return {"id": str(i), "name": f"item-{i}", "tags": [i, i + 1, str(i + 2)]}
def buffers(i):
    return [bytes(64 + (i + k) % 960) for k in range(4)]
for i in range(rounds):
    r, b = record(i), buffers(i)
    if i % 100 == 0:
        keep.append(b[0])
print(len(keep))
"""


def records(tmp: Path, name: str, *cmd: str, env: dict[str, str] | None = None) -> int:
    """Stack records (native and Python) of `memtrack capture -- CMD`."""
    art = tmp / f"{name}.memtrack"
    ok(memtrack("capture", "-o", str(art), "--", *cmd, env=env))
    return artifact_records(art)


def test_python_loop_records_do_not_grow_with_allocations(tmp_path: Path) -> None:
    """The same loop run N and 4N times (PYTHONMALLOC=malloc: every object a malloc):
    its records are those of its call paths, not one more per so many allocations (the
    counts of two identical runs differ by a few tenths of a percent: start-up's stale
    slots)."""
    loop = tmp_path / "loop.py"
    loop.write_text(LOOP)
    env = {"PYTHONMALLOC": "malloc"}
    n = 3000
    few = records(tmp_path, "few", sys.executable, str(loop), str(n), env=env)
    many = records(tmp_path, "many", sys.executable, str(loop), str(4 * n), env=env)
    assert many <= few * 1.02, (few, many)
