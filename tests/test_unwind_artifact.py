"""The unwinder behind an artifact: fixture snapshots written as stack records with
their modules copied in, read back through decode, and the `memtrack unwind` command.
(Real captures go through the same path; these need no BPF.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support.snaps import VARIANTS, Snaps, build_fixture, run_snaps, snaps_kept
from support.stackrecords import ring_record

from memtrack.addrspace.modules import ModuleStore
from memtrack.capture.stackring import records_to_batches
from memtrack.process.decode import decode
from memtrack.process.read import LIFECYCLE_TABLES, ROW_RULES
from memtrack.process.unwind import unwind
from memtrack.schema import table_file
from memtrack.schema.artifact import Artifact, ArtifactWriter


def write_artifact(snaps: Snaps, path: Path) -> tuple[Path, list[int]]:
    """An artifact holding the snapshots as stack records and their modules."""
    w = ArtifactWriter(path)
    t = snaps.stacks
    kept = snaps_kept(snaps)
    recs = [ring_record(np.frombuffer(s, np.uint64), sp, np.array(r, np.uint64), kept,
                        tid=tid, pid=pid, cut=cut, ts=ts)
            for s, sp, r, tid, pid, cut, ts in zip(
                *(t.column(c).to_pylist() for c in ("stack", "sp", "regs", "tid", "pid",
                                                     "copy_truncated", "ts")), strict=True)]
    out = records_to_batches(recs)
    w.write("stacks", out.stacks)
    w.write("mappings", snaps.mappings)
    for m in snaps.mappings.to_pylist():
        if m["build_id"] and m["perms"][2] == "x" and not w.has_module(m["build_id"]):
            w.add_module(m["build_id"], m["path"], Path(m["path"]))
    w.close()
    return path, out.stacks.column("hash").to_pylist()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    tmp = tmp_path_factory.mktemp("art")
    exe = build_fixture(["unwind/chain.c"], VARIANTS["O2"], "chain-O2")
    return write_artifact(run_snaps([str(exe)], tmp), tmp / "chain.memtrack")


def test_decode_then_unwind_with_artifact_modules_only(artifact: tuple[Path, list[int]]
                                                       ) -> None:
    path, hashes = artifact
    art = Artifact.open(path)
    decoded = decode(art)
    assert decoded.counters["decode_mismatch"] == 0
    assert decoded.table.column("stack_hash").to_pylist() == hashes
    res = unwind(decoded.table, art.read("mappings").table, ModuleStore(path))
    assert res.problems == []
    assert res.stacks.column("complete").to_pylist() == [True] * 3
    assert res.stack_frames.num_rows == 3 * 8
    assert set(res.stack_frames.column("method").to_pylist()) == {"regs", "cfi"}
    # Every frame's module is the artifact's copy, found by build id.
    bids = set(res.stack_frames.column("build_id").to_pylist())
    assert None not in bids and bids <= {m["build_id"] for m in art.modules()}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memtrack.cli", "unwind", *args],
                          capture_output=True, text=True)


def test_unwind_command(artifact: tuple[Path, list[int]]) -> None:
    path, hashes = artifact
    out = run_cli(str(path), "--record", f"{hashes[1]:#x}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    pid = Artifact.open(path).read("stacks").table.column("pid")[1].as_py()
    assert lines[0] == f"stack {hashes[1]:#018x} pid {pid}: 8 frames (complete)"
    frames = [ln.split() for ln in lines[1:]]
    assert [f[0] for f in frames] == [f"#{d}" for d in range(8)]
    assert [f[2] for f in frames] == ["regs"] + ["cfi"] * 7
    assert [f[3].split("+")[0] for f in frames] == [
        "mt_snap", "c", "b", "a", "main", "__libc_start_call_main", "__libc_start_main",
        "_start"]
    assert all(f[-1].startswith("[") for f in frames)
    assert run_cli(str(path), "--record", str(hashes[1])).stdout == out.stdout  # decimal


def test_unwind_command_reads_what_the_lifecycle_needs(artifact: tuple[Path, list[int]],
                                                       tmp_path: Path) -> None:
    """`memtrack unwind` reads the events and the lifecycle's tables, no other: with
    every other table not Arrow at all, its output is the same."""
    path, hashes = artifact
    copy = tmp_path / "junk.memtrack"
    shutil.copytree(path, copy)
    others = set(ROW_RULES) - {"events", "stacks", *LIFECYCLE_TABLES}
    assert others >= {"rss", "faults", "py_stacks", "py_codes", "stops"}
    for name in others:
        (copy / table_file(name)).write_bytes(b"not arrow")
    out = run_cli(str(copy), "--record", f"{hashes[1]:#x}")
    assert out.returncode == 0, out.stderr
    assert out.stdout == run_cli(str(path), "--record", f"{hashes[1]:#x}").stdout
    (copy / table_file("processes")).write_bytes(b"not arrow")
    bad = run_cli(str(copy), "--record", f"{hashes[1]:#x}")
    assert bad.returncode == 2 and "processes.arrow" in bad.stderr


def test_unwind_command_errors(artifact: tuple[Path, list[int]], tmp_path: Path) -> None:
    path, _ = artifact
    bad = run_cli(str(path), "--record", "0x1234")
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr == f"memtrack: unwind: no stack record with hash 0x1234 in {path}\n"
    bad = run_cli(str(path), "--record", "zz")
    assert bad.stderr == "memtrack: unwind: 'zz' is not a stack hash (hex or decimal)\n"
    bad = run_cli(str(tmp_path / "none.memtrack"), "--record", "1")
    assert bad.returncode == 2
    assert bad.stderr.startswith("memtrack: unwind: ") and "no such artifact" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1


def test_frames_table_types(artifact: tuple[Path, list[int]]) -> None:
    path, _ = artifact
    art = Artifact.open(path)
    res = unwind(decode(art).table, art.read("mappings").table, ModuleStore(path))
    label = pa.dictionary(pa.int32(), pa.string())  # strings of few values: per frame an index
    assert res.stack_frames.schema.types == [
        pa.uint64(), pa.uint32(), pa.uint16(), pa.uint64(), label, label, label, pa.uint64(),
        label]
    assert res.stack_frames.column("reason").null_count == res.stack_frames.num_rows
    assert res.stacks.column_names[:5] == ["stack_hash", "pid", "depth", "truncated",
                                           "complete"]
