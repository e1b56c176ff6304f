"""Stack records in pieces, whatever the stack bytes add up to (memtrack.process.decode
StackRecords): a piece never holds more than its bound of copies nor a column combined
beyond it, and the tables are those of one piece; `process` ended by SIGTERM leaves no
spill and no database, and a killed run's leftovers go with the next run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from test_process_jobs import checksums
from test_stackrecord import skeleton_table

import memtrack.process.parallel as parallel
from memtrack.process.decode import StackRecords, piece_ends
from memtrack.process.pipeline import process
from memtrack.schema.artifact import ArtifactError


def test_pieces_take_rows_from_their_batches() -> None:
    stacks, _ = skeleton_table(np.random.default_rng(5), 60)
    batches = pa.Table.from_batches(stacks.to_batches(max_chunksize=7))  # 9 batches
    records = StackRecords.of(batches)
    assert records.index.column("hash").to_pylist() == stacks.column("hash").to_pylist()
    rows = np.arange(3, 60, 2)
    max_bytes = 3 * int(stacks.column("copy_len").to_numpy().max())
    ends = piece_ends(records.index.column("copy_len").to_numpy()[rows], max_bytes)
    pieces = list(records.read(rows, ends))
    assert len(pieces) == len(ends) > 3
    for piece in pieces:
        copies = piece.column("copy_len").to_numpy() // 8 * 8
        assert copies.sum() <= max_bytes or piece.num_rows == 1
        # a chunk per batch the piece's rows came from, none of more than a batch's rows
        assert max(len(c) for c in piece.column("payload").chunks) <= 7
    assert pa.concat_tables(pieces).equals(stacks.take(pa.array(rows)))


def test_records_that_changed_are_refused() -> None:
    stacks, _ = skeleton_table(np.random.default_rng(6), 10)
    reads = iter([stacks, stacks.slice(1), stacks.slice(0, 5)])
    records = StackRecords(lambda: next(reads).to_batches())
    with pytest.raises(ArtifactError, match="changed while being processed"):
        list(records.read(np.arange(10), [10]))  # shifted by one
    with pytest.raises(ArtifactError, match="changed while being processed"):
        list(records.read(np.arange(10), [10]))  # cut short


def test_lowered_piece_size_same_tables(small_synth: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of at most 32 KiB of copies (a few dozen records each), decoded and unwound
    in this process so that each can be looked at: none holds more, none of its columns
    more than its records, and the tables are those of one piece."""
    bound = 32 << 10
    seen: list[tuple[int, int, int]] = []
    decode_table = parallel.decode_table

    def spy(records: pa.Table):  # noqa: ANN202
        out = decode_table(records)
        copies = int((records.column("copy_len").to_numpy() // 8 * 8).sum())
        seen.append((records.num_rows, copies, out.table.column("stack").nbytes))
        return out

    monkeypatch.setattr(parallel, "decode_table", spy)
    process(small_synth, tmp_path / "small.duckdb", progress=False, jobs=1, piece_bytes=bound)
    assert len(seen) > 10
    assert all(copies <= bound or n == 1 for n, copies, _ in seen)
    assert all(stack <= bound + 8 * (n + 1) for n, _, stack in seen)  # + offsets
    seen.clear()
    process(small_synth, tmp_path / "one.duckdb", progress=False, jobs=1, piece_bytes=1 << 40)
    assert len(seen) == 1
    assert checksums(tmp_path / "small.duckdb") == checksums(tmp_path / "one.duckdb")


def test_sigterm_leaves_nothing(small_synth: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.duckdb"
    # what a run killed outright left: its database and spill, its process gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [tmp_path / f".r.duckdb.{dead.pid}.tmp", tmp_path / f".r.duckdb.{dead.pid}.tmp.wal"]
    for p in left:
        p.write_bytes(b"x")
    (tmp_path / f".r.duckdb.{dead.pid}.tmp.spill").mkdir()
    (tmp_path / f".r.duckdb.{dead.pid}.tmp.spill" / "ops-0.arrow").write_bytes(b"x")
    p = subprocess.Popen([sys.executable, "-m", "memtrack.cli", "process", str(small_synth),
                          "-o", str(out), "--cache", "off", "--jobs", "2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    spill = tmp_path / f".r.duckdb.{p.pid}.tmp.spill"
    deadline = time.monotonic() + 120
    while not spill.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spill.exists(), "process never made its spill"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert sorted(x.name for x in tmp_path.iterdir()) == [], err
