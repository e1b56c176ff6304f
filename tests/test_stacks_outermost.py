"""Outermost frames without CFI, through the command line: a main thread whose `_start`
has no CFI (fixtures/stacks/nocfi_start.S, as musl's or a hand-written entry point)
has complete stacks that end there, not `bad-register` (ld.so's `_dl_start_user`, where
constructors' stacks end, is tested in test_stacks_fork.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build

from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]


def test_start_without_cfi_is_complete(tmp_path: Path) -> None:
    exe = build(["stacks/nocfi_start.S", "stacks/nocfi_main.c"], name="nocfi",
                flags=("-O1", "-g", "-nostartfiles"))
    art, db = tmp_path / "n.memtrack", tmp_path / "n.duckdb"
    for cmd in (["capture", "-o", str(art), "--", str(exe)],
                ["process", str(art), "-o", str(db)]):
        r = subprocess.run([*MEMTRACK, *cmd], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    con = open_run(db)
    rows = con.execute("""
        SELECT a.stack_id, count(*), s.complete, s.stop FROM allocations a
        JOIN stacks s USING (stack_id) WHERE a.size = 777 GROUP BY ALL""").fetchall()
    assert sum(r[1] for r in rows) == 100
    for stack_id, _, complete, stop in rows:
        names = [n for (n,) in con.execute(
            "SELECT name FROM stack_lines WHERE stack_id = ? AND depth > 0 ORDER BY position",
            [stack_id]).fetchall()]
        assert names == ["site", "main", "_start"]
        assert (complete, stop) == (True, "complete")
    con.close()
