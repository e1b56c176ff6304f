"""Outermost frames through the command line: a main thread whose `_start`
has no CFI (fixtures/stacks/nocfi_start.S, as musl's or a hand-written entry point)
has complete stacks that end there, not `bad-register` (ld.so's `_dl_start_user`, where
constructors' stacks end, is tested in test_stacks_fork.py), and a stack with pages
not in memory between the allocation and `_start`."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import build
from support.cli import capture_and_process

from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf


def unwound_sites(exe: Path, size: int, d: Path) -> list[tuple[list[str], bool, str]]:
    """`exe` captured and processed through the CLI: each distinct stack of its 100
    allocations of `size` bytes, as (frame names above the allocator, complete, stop)."""
    db, _ = capture_and_process([str(exe)], d)
    con = open_run(db)
    rows = con.execute("""
        SELECT a.stack_id, count(*), s.complete, s.stop FROM allocations a
        JOIN stacks s USING (stack_id) WHERE a.size = ? GROUP BY ALL""", [size]).fetchall()
    assert sum(r[1] for r in rows) == 100
    out = [([n for (n,) in con.execute(
        "SELECT name FROM stack_lines WHERE stack_id = ? AND depth > 0 ORDER BY position",
        [stack_id]).fetchall()], complete, stop) for stack_id, _, complete, stop in rows]
    con.close()
    return out


def test_start_without_cfi_is_complete(tmp_path: Path) -> None:
    exe = build(["stacks/nocfi_start.S", "stacks/nocfi_main.c"], name="nocfi",
                flags=("-O1", "-g", "-nostartfiles"))
    for names, complete, stop in unwound_sites(exe, 777, tmp_path):
        assert names == ["site", "main", "_start"]
        assert (complete, stop) == (True, "complete")


def test_untouched_stack_pages_do_not_end_the_copy(tmp_path: Path) -> None:
    """A 16 KiB frame whose middle pages were never touched (not in memory: the copy's
    read of them faults) still unwinds to `_start`, as gdb's backtrace does."""
    exe = build(["stacks/bigframe.c"], name="bigframe",
                flags=("-O1", "-g", "-fno-stack-clash-protection"))
    for names, complete, stop in unwound_sites(exe, 555, tmp_path):
        assert names == ["big_frame", "main", "__libc_start_call_main", "__libc_start_main",
                         "_start"]
        assert (complete, stop) == (True, "complete")
