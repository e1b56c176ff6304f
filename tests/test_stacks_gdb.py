"""Stacks as gdb sees them, on programs nobody here wrote the unwinding for: Debian's
sqlite3 inserting rows and a C++ std::map program built -O2 -g (its templates inlined).
With default options: records are at most 1 % of allocations, at least 99 % of the
allocations have a stack that reaches _start, and at three allocation sites each the
frames are gdb's `bt` (past main), return address for return address."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from conftest import build
from support.capture import spawn

from memtrack.capture.options import CaptureOptions
from memtrack.process.pipeline import process
from memtrack.schema import Allocator, EventKind
from memtrack.schema.artifact import Artifact
from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C"}
# A hardware breakpoint at the function's first instruction, set once libc is loaded
# (before any constructor runs): an int3 there would be swallowed by the uprobe that
# any memtrack capture on the host keeps at that place.
GDB_SCRIPT = """set pagination off
set confirm off
set disable-randomization on
set backtrace past-main on
unset environment
{env}
catch load libc.so
run
delete
python
import gdb
class SizeBreak(gdb.Breakpoint):
    def stop(self):
        return int(gdb.parse_and_eval("$rdi")) == {size}
SizeBreak("*{func}", type=gdb.BP_HARDWARE_BREAKPOINT)
end
continue
python
f, pcs = gdb.newest_frame(), []
while f is not None:
    if f.type() != gdb.INLINE_FRAME:  # one physical frame per pc, as stack_frames
        pcs.append(f.pc())
    f = f.older()
print("FRAMES " + " ".join(hex(p) for p in pcs))
end
kill
"""


def gdb_frames(cmd: list[str], func: str, size: int, tmp: Path) -> list[int]:
    """The pcs of the physical frames gdb unwinds at the first call of `func` with this
    size (rdi)."""
    script = tmp / "bt.gdb"
    script.write_text(GDB_SCRIPT.format(
        env="\n".join(f"set environment {k}={v}" for k, v in ENV.items()),
        size=size, func=func))
    out = subprocess.run(["gdb", "-nx", "-batch", "-x", str(script), "--args", *cmd],
                         capture_output=True, text=True, timeout=120, cwd=tmp)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("FRAMES ")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    return [int(x, 16) for x in lines[0].split()[1:]]


def capture(cmd: list[str], tmp: Path) -> Path:
    """Capture `cmd` with the default stack options, without address randomization (as
    gdb runs it: the same pcs), and neither RSS nor module copies (process reads this
    host's modules; the C++ program makes 340 k events/s, and a module copy at an attach
    stop of a busy machine can hold the drain up longer than the events ring lasts).
    The Tracker is gone when this returns: its uprobes on the allocators, live in every
    process of the host, would be in gdb's way."""
    from memtrack.capture.tracker import Tracker

    out = tmp / "run.memtrack"
    opts = CaptureOptions(rss=False, modules=False)
    with Tracker(opts) as tracker:
        result = spawn(tracker, ["setarch", "-R", *cmd], out, tmp / "stdout", timeout=300,
                       env=ENV, cwd=tmp)
    assert result.status == 0
    assert result.nonzero_losses() == {}
    return out


def check(cmd: list[str], allocator: Allocator, func: str, tmp: Path) -> None:
    art_path = capture(cmd, tmp)
    summary = process(art_path, tmp / "run.duckdb", progress=False)
    assert summary.counters["decode_mismatch"] == 0
    con = open_run(tmp / "run.duckdb")
    allocs, records, complete = con.execute("""
        SELECT count(*), (SELECT count(*) FROM stacks), count(*) FILTER (WHERE s.complete)
        FROM allocations a JOIN stacks s USING (stack_id)""").fetchone()
    assert allocs > 100_000
    assert records <= 0.01 * allocs, (records, allocs)
    assert complete >= 0.99 * allocs, (complete, allocs)
    # three sites: the first call of each of the three most frequent sizes of the
    # program's own (after its exec) calls of `func`
    ev = Artifact.open(art_path).read("events").table
    exec_ts = pc.max(ev.filter(pc.equal(ev.column("kind"), int(EventKind.EXEC)))
                     .column("ts")).as_py()
    mine = ev.filter(pc.and_(pc.and_(pc.greater(ev.column("ts"), exec_ts),
                                     pc.equal(ev.column("kind"), int(EventKind.MALLOC))),
                             pc.equal(ev.column("allocator"), int(allocator))))
    sizes, counts = np.unique(mine.column("size").to_numpy(), return_counts=True)
    for size in sizes[np.argsort(-counts, kind="stable")[:3]].tolist():
        first = mine.filter(pc.equal(mine.column("size"), size)).column("stack_hash")[0]
        ours = [a for (a,) in con.execute("""
            SELECT f.address FROM stacks s JOIN stack_frames f USING (stack_id)
            WHERE s.stack_hash = ? ORDER BY f.depth""", [first.as_py()]).fetchall()]
        theirs = gdb_frames(cmd, func, size, tmp)
        # frame 0 is the allocator itself (gdb stops at its first instruction, memtrack's
        # probe may sit a few bytes in); every caller, the same return address
        assert len(ours) == len(theirs) > 4, (size, ours, theirs)
        assert ours[1:] == theirs[1:], (size, [hex(x) for x in ours],
                                        [hex(x) for x in theirs])
        assert 0 <= ours[0] - theirs[0] < 64


def test_sqlite3_inserts(tmp_path: Path) -> None:
    sql = tmp_path / "ins.sql"
    sql.write_text("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);\nBEGIN;\n" +
                   "".join(f"INSERT INTO t(name, v) VALUES ('name-{i * 7919 % 100003}', "
                           f"{i}.5);\n" for i in range(10_000)) + "COMMIT;\n")
    cmd = ["/usr/bin/sqlite3", "-init", str(sql), ":memory:", ".quit"]
    check(cmd, Allocator.LIBC, "malloc", tmp_path)


def test_cxx_map_program(tmp_path: Path) -> None:
    exe = build(["stacks/cxxmap.cc"], flags=("-O2", "-g"))
    check([str(exe), "40000"], Allocator.CXX, "_Znwm", tmp_path)

