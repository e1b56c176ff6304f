"""The Python view (issue 31: `report`, `export`, `diff` and `query --python-only`) of a
Python program's run, through the command line on fixtures/python/frames.py: each stack
keeps its Python frames and the native frames its innermost Python frame called (down to
the allocator function), the interpreter's frames around them folded away; a stack with
no Python frame stays whole; every total is the native view's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memtrack.schema.ddl import open_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "fixtures" / "python" / "frames.py"
MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
N = 300_000
# native frames of the interpreter's own start and evaluation loop: in the native view
# around every Python frame, in the Python view on no stack that has one
OUTER = ("_start", "Py_RunMain", "PyEval_EvalCode", "_PyEval_Vector")

pytestmark = pytest.mark.bpf


def memtrack(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*MEMTRACK, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (args, r.stderr)
    return r


def captured(tmp: Path, name: str, *program: str) -> Path:
    """`program` run by the venv's CPython 3.11 (built from source: its functions are
    named), captured with the whole native stacks (--python-stacks mixed; the default
    Python cut records no frame outside the innermost Python one): its artifact."""
    art = tmp / f"{name}.memtrack"
    memtrack("capture", "-o", str(art), "--rss", "off", "--modules", "off",
             "--python-stacks", "mixed", "--", sys.executable, *program)
    return art


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """frames.py's run, processed."""
    tmp = tmp_path_factory.mktemp("python_only")
    art, db = captured(tmp, "run", str(SCRIPT)), tmp / "run.duckdb"
    memtrack("process", "-q", str(art), "-o", str(db))
    return db


@pytest.fixture(scope="module")
def base_db(tmp_path_factory: pytest.TempPathFactory, run_db: Path) -> Path:
    """A smaller Python program's run (diff's base against frames.py's), processed; both
    also appended to a run dataset beside it (run ids base and head)."""
    tmp = tmp_path_factory.mktemp("python_only_base")
    art, db = captured(tmp, "base", "-c", "x = [bytearray(300_000 + i) for i in range(3)]"), \
        tmp / "base.duckdb"
    memtrack("process", "-q", str(art), "-o", str(db))
    for run_id, a in (("base", art), ("head", run_db.with_suffix(".memtrack"))):
        memtrack("process", "-q", str(a), "-o", str(tmp / f"ds-{run_id}.duckdb"), "--dataset",
                 str(tmp / "dataset"), "--run-id", run_id)
    return db


def test_stacks_fold_to_python_frames(run_db: Path) -> None:
    """Per stack, the Python view's frames are exactly the native view's without the
    native frames outside its innermost Python frame, depths from 0 in order; stacks'
    depths and the allocations' stacks follow."""
    def frames(python_only: bool) -> dict[int, list[tuple[str, int]]]:
        out: dict[int, list[tuple[str, int]]] = {}
        con = open_run(run_db, python_only=python_only)
        for sid, depth, method, frame in con.execute(
                "SELECT stack_id, depth, method, frame_id FROM stack_frames "
                "ORDER BY stack_id, depth").fetchall():
            assert depth == len(out.setdefault(sid, []))
            out[sid].append((method, frame))
        depths = dict(con.execute("SELECT stack_id, depth FROM stacks").fetchall())
        assert {s: depths[s] for s in out} == {s: len(f) for s, f in out.items()}
        return out

    native, python = frames(False), frames(True)
    assert native.keys() == python.keys()
    folded = 0
    for sid, stack in native.items():
        methods = [m for m, _ in stack]
        if "python" in methods:
            inner = methods.index("python")
            want = stack[:inner] + [f for f in stack[inner:] if f[0] == "python"]
            folded += len(stack) > len(want)
        else:
            want = stack
        assert python[sid] == want, sid
    assert folded > 100  # most stacks of a Python program have frames folded


def test_report_and_exports(run_db: Path, tmp_path: Path) -> None:
    """The folded export: the same total in both views; the leaf allocation's stack
    reads <module>;main;middle;leaf then what `bytearray(N + 1)` called (the native view
    starts at _start); no stack with a Python frame keeps the interpreter's outer frames.
    The report's totals and speedscope's (every metric) are the native view's too."""
    def export(fmt: str, python_only: bool) -> bytes:
        out = tmp_path / f"{fmt}-{python_only}"
        memtrack("export", str(run_db), "--format", fmt, "-o", str(out),
                 *(["--python-only"] if python_only else []))
        return out.read_bytes()

    def lines(data: bytes) -> dict[str, int]:
        return {k: int(v) for k, v in (ln.rsplit(" ", 1) for ln in data.decode().splitlines())}

    native, python = (lines(export("folded", p)) for p in (False, True))
    assert sum(python.values()) == sum(native.values()) > 0
    (leaf,) = [k for k, v in python.items() if v == N + 2]
    frames = leaf.split(";")
    assert frames[1:5] == ["<module>", "main", "middle", "leaf"], leaf
    assert not set(frames[5:]) & {"<module>", "main", "middle", "leaf"}
    assert len(python) < len(native)
    (native_leaf,) = [k for k, v in native.items() if v == N + 2]
    assert native_leaf.split(";")[1] == "_start" and native_leaf.endswith(";".join(frames[5:]))
    with_python = [k for k in python if "<module>" in k.split(";")]
    assert with_python and not [k for k in with_python if set(k.split(";")) & set(OUTER)]

    def weights(python_only: bool) -> dict[str, int]:
        doc = json.loads(export("speedscope", python_only))
        return {prof["name"]: sum(prof["weights"]) for prof in doc["profiles"]}

    folded_weights = weights(True)
    assert folded_weights == weights(False) and len(folded_weights) == 5
    assert export("pprof", True)

    def report(*extra: str) -> dict:
        return json.loads(memtrack("report", str(run_db), "--format", "json", *extra).stdout)

    n, p = report(), report("--python-only")
    assert (n["python_only"], p["python_only"]) == (False, True)
    assert p["totals"] == n["totals"] and p["totals"]["allocated_bytes"] == sum(native.values())
    text = memtrack("report", str(run_db), "--python-only", "--html",
                    str(tmp_path / "p.html")).stdout
    assert "stacks: Python view (--python-only)" in text.splitlines()[1]
    assert (tmp_path / "p.html").stat().st_size > 0


def test_diff_folds_both_runs(run_db: Path, base_db: Path) -> None:
    """`diff --python-only`: both runs' backtraces folded (a path with Python frames ends
    at <module>, none keeps the interpreter's outer frames, which the native diff's
    do), the totals those of the native diff; the same diff from the runs of a
    dataset (`--dataset DIR base head --python-only`)."""
    def diff(*extra: str) -> dict:
        return json.loads(memtrack("diff", *extra, "--format", "json").stdout)

    def paths(d: dict) -> list[list[str]]:
        return [[f["function"] for f in bt["frames"]]
                for metric in d["sections"]["sites"]["metrics"].values()
                for kind in ("matched", "head_only", "base_only")
                for site in metric[kind]["sites"] for bt in site["backtraces"]]

    native, python = diff(str(base_db), str(run_db)), diff(str(base_db), str(run_db),
                                                          "--python-only")
    assert (native["python_only"], python["python_only"]) == (False, True)
    assert python["sections"]["totals"] == native["sections"]["totals"]
    with_python = [p for p in paths(python) if "<module>" in p]
    assert len(with_python) > 10
    assert all(p[-1] == "<module>" and not set(p) & set(OUTER) for p in with_python)
    assert [p for p in paths(native) if "<module>" in p and p[-1] == "_start"]
    text = memtrack("diff", str(base_db), str(run_db), "--python-only").stdout
    assert text.splitlines()[2] == ("stacks: Python view (--python-only): Python frames, "
                                    "and the native ones their innermost called")

    from_dataset = diff("--dataset", str(base_db.parent / "dataset"), "base", "head",
                        "--python-only")
    for d in (python, from_dataset):
        del d["base"], d["head"]
    assert from_dataset == python


def test_query_sees_folded_stacks(run_db: Path) -> None:
    """`query --python-only`: stack_frames, stacks and every view over them folded (no
    stack with a Python frame has an outer interpreter frame; the native query finds
    them on the main thread's), the allocations unchanged; a dataset has no Python view:
    refused."""
    sql = ("SELECT count(DISTINCT stack_id) FILTER (WHERE function IN ('_start', "
           "'Py_RunMain')) AS outer_stacks, count(DISTINCT stack_id) AS stacks, "
           "(SELECT sum(size) FROM allocations) AS bytes FROM stack_lines "
           "WHERE stack_id IN (SELECT stack_id FROM stack_frames WHERE method = 'python')")

    def query(*extra: str) -> dict:
        (row,) = json.loads(memtrack("query", str(run_db), sql, "--format", "json",
                                     *extra).stdout)
        return row

    native, python = query(), query("--python-only")
    assert python["outer_stacks"] == 0 and native["outer_stacks"] > native["stacks"] // 2
    assert python["stacks"] == native["stacks"] and python["bytes"] == native["bytes"] > 0
    r = subprocess.run([*MEMTRACK, "query", "--dataset", str(run_db.parent), "SELECT 1",
                        "--python-only"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (2, "")
    assert "--python-only: a run database's stacks, not a dataset's" in r.stderr
