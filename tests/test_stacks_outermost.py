"""Outermost frames through the command line: a main thread whose `_start`
has no CFI (fixtures/stacks/nocfi_start.S, as musl's or a hand-written entry point)
has complete stacks that end there, not `bad-register` (ld.so's `_dl_start_user`, where
constructors' stacks end, is tested in test_stacks_fork.py), and a stack with pages
not in memory between the allocation and `_start`."""

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


def test_untouched_stack_pages_do_not_end_the_copy(tmp_path: Path) -> None:
    """A 16 KiB frame whose middle pages were never touched (not in memory: the copy's
    read of them faults) still unwinds to `_start`, as gdb's backtrace does."""
    exe = build(["stacks/bigframe.c"], name="bigframe",
                flags=("-O1", "-g", "-fno-stack-clash-protection"))
    art, db = tmp_path / "b.memtrack", tmp_path / "b.duckdb"
    for cmd in (["capture", "-o", str(art), "--", str(exe)],
                ["process", str(art), "-o", str(db)]):
        r = subprocess.run([*MEMTRACK, *cmd], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    con = open_run(db)
    rows = con.execute("""
        SELECT a.stack_id, count(*), s.complete, s.stop FROM allocations a
        JOIN stacks s USING (stack_id) WHERE a.size = 555 GROUP BY ALL""").fetchall()
    assert sum(r[1] for r in rows) == 100
    for stack_id, _, complete, stop in rows:
        names = [n for (n,) in con.execute(
            "SELECT name FROM stack_lines WHERE stack_id = ? AND depth > 0 ORDER BY position",
            [stack_id]).fetchall()]
        assert names == ["big_frame", "main", "__libc_start_call_main", "__libc_start_main",
                         "_start"]
        assert (complete, stop) == (True, "complete")
    con.close()
