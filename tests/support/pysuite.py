"""fixtures/pysuite (a toolz-like pytest suite of a small pure-Python library) captured
as a user would, through the command line with the memtrack.pytest plugin, and the
figures that say whether stack records track call paths: records against the distinct
Python call paths and the distinct call paths (native and Python frames) of the
allocations. Used by tests/test_pysuite_records.py and bench/bench_stack_records.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "fixtures" / "pysuite"
# venv's interpreter: pytest is installed beside memtrack (Debian's python3 has neither)
PYTHON = sys.executable
# every run compiles the suite (its modules and pytest's rewriting of its tests) as the
# first run of a checkout does, and leaves no bytecode behind: what a run records does
# not depend on the runs before it; and hashes strings alike (no hash randomization: the
# same set and dict orders, so the same code runs)
SUITE_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}

# per stack of an allocation, its Python frames (method 'python') and all its frames,
# as the hash of their frame ids from the leaf outward; counted distinct over those
# stacks (not joined per allocation, not as strings: the PYTHONMALLOC=malloc suite has
# millions of allocations and tens of millions of frames)
PATHS = """
WITH used AS (SELECT DISTINCT stack_id FROM allocations),
s AS (
  SELECT stack_id,
         CASE WHEN bool_or(method = 'python') THEN hash(list(frame_id ORDER BY depth)
           FILTER (WHERE method = 'python')) END AS python_path,
         hash(list(frame_id ORDER BY depth)) AS path
  FROM stack_frames SEMI JOIN used USING (stack_id) GROUP BY stack_id)
SELECT (SELECT count(*) FROM allocations) AS allocations,
       count(DISTINCT python_path) AS python_paths,
       count(DISTINCT path) AS paths,
       (SELECT count(*) FROM stacks) AS records
FROM s
"""


@dataclass(frozen=True)
class Paths:
    allocations: int
    python_paths: int  # distinct Python frame sequences of the allocations
    paths: int  # distinct whole call paths (native and Python frames)
    records: int  # stack records (the run database's stacks: native and Python)


def memtrack(*args: str, tree: Path = ROOT, env: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`memtrack ARGS` run from the source tree `tree` (its package first on the path)."""
    return subprocess.run([PYTHON, "-m", "memtrack.cli", *args], text=True,
                          capture_output=True, cwd=tree, timeout=timeout,
                          env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)})


def suite_command(*select: str, options: tuple[str, ...] = ()) -> list[str]:
    """pytest over the suite (or the files `select` of it), as a user runs it (and with
    pytest's `options`)."""
    files = [str(SUITE / f) for f in select] or [str(SUITE)]
    return [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, *files]


def clear_bytecode() -> None:
    """Remove the suite's bytecode (a pytest run outside capture_suite writes it)."""
    for d in SUITE.rglob("__pycache__"):
        shutil.rmtree(d, ignore_errors=True)


def capture_suite(out: Path, *select: str, options: tuple[str, ...] = (),
                  pymalloc: bool = True, tree: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`memtrack capture -o OUT -- python -m pytest ...`, with the default pymalloc or
    PYTHONMALLOC=malloc (set for the command: memtrack passes it on)."""
    clear_bytecode()
    env = SUITE_ENV | ({} if pymalloc else {"PYTHONMALLOC": "malloc"})
    return memtrack("capture", "-o", str(out), "--force", "--",
                    *suite_command(*select, options=options), tree=tree, env=env)


def call_paths(db: Path, tree: Path = ROOT) -> Paths:
    r = memtrack("query", str(db), PATHS, "--format", "json", tree=tree)
    if r.returncode:
        raise RuntimeError(f"query of {db} failed: {r.stderr[-500:]}")
    return Paths(**json.loads(r.stdout)[0])
