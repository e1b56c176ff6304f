"""The pipeline's stack half on real unwinding and symbolization: stacks that a fixture
snapshots itself (tests/support/snaps.py: what a malloc uprobe sees, decode-shaped)
go through unwind, module and frame ids, symbolize and load, and come out as the
report's sites and backtraces and the exports' frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from support.snaps import VARIANTS, Snaps, build_fixture, run_snaps, snaps_kept
from support.stackrecords import SP0, regions_kept, ring_record
from support.synth import END_NS

from memtrack.capture.stackring import records_to_batches
from memtrack.process.decode import decode_pieces
from memtrack.process.pipeline import process
from memtrack.report.folded import folded
from memtrack.report.reader import RunReader
from memtrack.report.text import ReportOptions, report_data
from memtrack.schema import EVENTS, MAPPINGS, NUM_REGS, EventKind
from memtrack.schema.artifact import Artifact, ArtifactWriter
from memtrack.schema.ddl import open_run
from memtrack.schema.manifest import Host

CHAIN = ["c", "b", "a", "main", "__libc_start_call_main", "__libc_start_main", "_start"]


def test_chain_through_load(tmp_path: Path) -> None:
    exe = build_fixture(["unwind/chain.c"], VARIANTS["O2"], "chain-O2")
    snaps = run_snaps([str(exe)], tmp_path)
    n = snaps.stacks.num_rows
    assert snaps.sizes == [102, 112, 122]
    art, _ = repeated_artifact(snaps, tmp_path / "chain.memtrack", 1, snaps.sizes)
    loaded = process(art, tmp_path / "run.duckdb", progress=False)
    assert loaded.rows["stacks"] == n
    assert loaded.unknown_frames == 0
    assert loaded.frames_by_method == {"cfi": 7 * n, "regs": n}
    con = open_run(tmp_path / "run.duckdb")
    # every stack: mt_snap (the "allocator", depth 0) then the chain
    lines = con.execute("""
        SELECT stack_id, list(function ORDER BY position) FROM stack_lines GROUP BY 1""").fetchall()
    assert len(lines) == n
    for _, fns in lines:
        assert fns[0] == "mt_snap" and fns[1:] == CHAIN
    sites = con.execute("SELECT DISTINCT name, file LIKE '%chain.c' FROM stack_location").fetchall()
    assert sites == [("c", True)]
    assert con.execute("SELECT count(*) FROM events WHERE stack_id IS NULL").fetchone() == (0,)
    mods = dict(con.execute("SELECT regexp_extract(path, '[^/]*$'), has_debuginfo FROM modules "
                            "WHERE module_id IN (SELECT module_id FROM stack_frames)").fetchall())
    assert mods[exe.name] is True and "libc.so.6" in mods
    d = report_data(con, ReportOptions())
    leaks = d["sections"]["leaks"]
    assert [(e["location"], e["value"]) for e in leaks] == [("c", sum(snaps.sizes))]
    assert [f["function"] for f in leaks[0]["backtraces"][0]["frames"]] == CHAIN
    text = folded(RunReader(con).costs(), "allocated")
    assert text == "?;" + ";".join(reversed(CHAIN)) + f" {sum(snaps.sizes)}\n"


def test_unknown_mapping_and_null_vaddr(tmp_path: Path) -> None:
    """Frames outside any module (null build id) or in a module that is not available
    (null lookup vaddr) keep their place in the stack as runtime-address locations, with
    the reason normalization gave: a record whose pc is in no mapping, continued by the
    kernel's frame-pointer chain into a module the artifact lacks, then out of every
    mapping again."""
    lib = 0x7000_0000
    chain = (0x10, lib + 0x20, 0x30)
    regs = np.zeros(NUM_REGS, np.uint64)
    regs[7], regs[16] = SP0, chain[0]
    rec = records_to_batches([ring_record(np.array([lib + 0x20], np.uint64), SP0, regs,
                                          regions_kept(SP0, lib, chain[0]), tid=1, pid=1, cut=True,
                                          fp=chain)])
    w = ArtifactWriter(tmp_path / "x.memtrack")
    w.write("stacks", pa.Table.from_batches([rec.stacks]))
    w.write("mappings", pa.table({
        "ts": [0], "pid": pa.array([1], pa.uint32()), "start": [lib], "end": [lib + 0x1000],
        "offset": [0], "perms": ["r-xp"], "dev": ["fd:01"], "inode": [7],
        "path": ["/nonexistent/lib.so"], "build_id": ["ee" * 20]}, schema=MAPPINGS))
    w.close()
    loaded = process(w.path, tmp_path / "x.duckdb", progress=False, host_modules=False)
    con = open_run(tmp_path / "x.duckdb")
    sf = con.execute("SELECT depth, frame_id, module_id FROM stack_frames ORDER BY depth"
                     ).fetchall()
    assert [r[0] for r in sf] == [0, 1, 2]
    assert len({r[1] for r in sf}) == 3
    reasons = con.execute("SELECT f.reason FROM stack_frames JOIN frames f USING (frame_id) "
                          "ORDER BY depth").fetchall()
    assert [r[0] for r in reasons] == ["no-mapping", "no-module", "no-mapping"]
    assert loaded.unknown_frames == 3
    assert [r[2] for r in sf] == [None, 0, None]


def repeated_artifact(snaps: Snaps, path: Path, rounds: int,
                      sizes: list[int] | None = None) -> tuple[Path, int]:
    """The snapshots recorded `rounds` times over by one thread, as the kernel writes
    records (the same skeleton again once the dedupe set forgot it), and one malloc
    event per record (of `sizes`, else 16, 17, ... bytes); returns the number of
    records."""
    t = snaps.stacks
    pid = t.column("pid")[0].as_py()
    kept = snaps_kept(snaps)
    copies = [np.frombuffer(b, np.uint64) for b in t.column("stack").to_pylist()]
    regs = [np.array(r, np.uint64) for r in t.column("regs").to_pylist()]
    sps, cuts = t.column("sp").to_pylist(), t.column("copy_truncated").to_pylist()
    fps = t.column("fp_chain").to_pylist()
    records = [ring_record(copies[j], sps[j], regs[j], kept, tid=pid, pid=pid, cut=cuts[j],
                           fp=tuple(fps[j]) if cuts[j] else (), ts=t.column("ts")[j].as_py())
               for _ in range(rounds) for j in range(len(copies))]
    out = records_to_batches(records)
    assert out.malformed == 0
    hashes = out.stacks.column("hash").to_pylist()
    n = len(records)
    w = ArtifactWriter(path)
    w.write("stacks", pa.Table.from_batches([out.stacks]))
    w.write("events", pa.table({
        "ts": [100 * (i + 1) for i in range(n)], "pid": [pid] * n, "tid": [pid] * n,
        "kind": [int(EventKind.MALLOC)] * n, "allocator": [1] * n, "flags": [0] * n,
        "addr": [0x1000 * (i + 1) for i in range(n)], "old_addr": [0] * n,
        "size": sizes or [16 + i for i in range(n)], "stack_hash": hashes}, schema=EVENTS))
    w.write("mappings", snaps.mappings.cast(MAPPINGS))
    w.manifest.root_pid = pid
    w.manifest.end_ns = END_NS * n
    w.manifest.host = Host.current()  # snapshots of this host: its modules are the mapped files
    w.close()
    return path, n


def test_process_in_tiny_runs_equals_the_default(tmp_path: Path) -> None:
    """`process` decoding and unwinding one record at a time (repeated stacks spread over
    every run) writes the same run database."""
    exe = build_fixture(["unwind/chain.c"], VARIANTS["O2"], "chain-O2")
    art, n = repeated_artifact(run_snaps([str(exe)], tmp_path), tmp_path / "a.memtrack", 5)
    assert len(list(decode_pieces(Artifact.open(art), 1))) == n == 15
    whole = process(art, tmp_path / "whole.duckdb", progress=False)
    tiny = process(art, tmp_path / "tiny.duckdb", progress=False, piece_bytes=1)
    assert whole.stacks == tiny.stacks == 3
    assert whole.counters["decode_mismatch"] == 0
    assert whole.counters["stack_records"] == 15
    assert whole.counters["unwind_stacks"] == 3
    assert whole.counters["events_stack_missing"] == 0
    assert tiny.counters == whole.counters
    assert tiny.frames_by_method == whole.frames_by_method == {"cfi": 21, "regs": 3}
    a, b = open_run(tmp_path / "whole.duckdb"), open_run(tmp_path / "tiny.duckdb")
    for table in ("events", "allocations", "stacks", "stack_frames", "frames", "modules"):
        rows = a.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall()
        assert rows, table
        assert b.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall() == rows, table
    lines = a.execute("SELECT list(function ORDER BY position) FROM stack_lines "
                      "GROUP BY stack_id").fetchall()
    assert [fns[1:] for (fns,) in lines] == [CHAIN] * 3
