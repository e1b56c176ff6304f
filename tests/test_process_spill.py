"""The events' way through `process` without being held whole (memtrack.process.spill):
pairing bucket by bucket gives the tables one bucket gives, events out of time order are
sorted first, and nothing of the spill stays behind."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from support import synth
from test_process_jobs import checksums
from test_process_jobs import synth as synth_artifact

import memtrack.process.match as match_module
import memtrack.process.pair as pair_module
import memtrack.process.pipeline as pipeline
import memtrack.process.spill as spill_module
from memtrack.process.lifecycle import lifecycle
from memtrack.process.pair import pair
from memtrack.process.read import read_artifact, sort_events, spilled_events
from memtrack.process.spill import EventSpill, bucket_of, buckets_for
from memtrack.schema import table_file
from memtrack.schema.artifact import Artifact, ArtifactError
from memtrack.schema.enums import CLONE_VM, EndReason, EventKind


@pytest.mark.parametrize("seed", range(12))
def test_buckets_pair_as_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """What crosses buckets and event ranges (a realloc's old and new block, a forked
    child's copies of its parent's blocks, copies of copies, the heap timeline's running
    sum) comes out as with one bucket and one range."""
    ev = sort_events(synth.random_events(seed))
    lc = lifecycle(ev)
    one = pair(ev, lc, buckets=1)
    a = one.allocations
    assert one.counters["allocations_inherited"] > 0
    assert a["realloc_of"].null_count < a.num_rows
    monkeypatch.setattr(pair_module, "RANGE_EVENTS", 300)  # ten ranges
    for buckets in (1, 4, 64):
        many = pair(ev, lc, buckets=buckets)
        assert many.allocations.equals(a), buckets
        assert many.heap_timeline.equals(one.heap_timeline), buckets
        assert many.counters == one.counters, buckets
    # events handed to the spill in small batches: what it carries from one to the next
    # (each thread's last heap event, last allocation and free before its exit)
    small = pair(pa.Table.from_batches(ev.to_batches(max_chunksize=37)), lc, buckets=4)
    assert small.allocations.equals(a) and small.counters == one.counters
    # a bucket too big where children inherit: split again by another hash of the address
    monkeypatch.setattr(spill_module, "OPS_PER_BUCKET", 40)
    again = pair(ev, lc, buckets=2)
    assert again.allocations.equals(a) and again.counters == one.counters
    # a match too big for one sort: cut by address within the bucket
    monkeypatch.setattr(match_module, "BUCKET_OPS", 30)
    cut = pair(ev, lc, buckets=1)
    assert cut.allocations.equals(a) and cut.counters == one.counters
    assert cut.heap_timeline.equals(one.heap_timeline)


@pytest.mark.parametrize("seed", range(6))
def test_spans_of_time_pair_as_whole(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket too big for one match (an address handed out again and again) is matched
    a span of time at a time, its open blocks and last frees carried over: the tables of
    the whole bucket. (Children that inherit need the whole history: vforks here.)"""
    ev = synth.random_events(seed, 6000)
    flags = ev.column("flags").to_numpy().copy()
    flags[ev.column("kind").to_numpy() == EventKind.FORK] |= CLONE_VM
    ev = sort_events(ev.set_column(ev.schema.get_field_index("flags"), "flags",
                                   pa.array(flags)))
    lc = lifecycle(ev)
    ev = pa.Table.from_batches(ev.to_batches(max_chunksize=97))  # spans end at batches
    whole = pair(ev, lc, buckets=2)
    spans = []
    match = match_module.match_bucket
    monkeypatch.setattr(match_module, "match_bucket", lambda *a, **k: spans.append(
        k.get("carried", 0)) or match(*a, **k))
    monkeypatch.setattr(match_module, "OPS_PER_BUCKET", 50)
    cut = pair(ev, lc, buckets=2)
    assert len(spans) > 20 and max(spans) > 0  # spans, with blocks carried between them
    assert cut.allocations.equals(whole.allocations)
    assert cut.heap_timeline.equals(whole.heap_timeline)
    assert cut.counters == whole.counters


def test_one_address_again_and_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A malloc/free loop on one address (no process boundary at all), a span at a time:
    every block freed by the next free, the last one left open."""
    rows = [(1000 + i, 100, 100, synth.K.MALLOC if i % 2 == 0 else synth.K.FREE, 0, 0x40,
             0, 16 if i % 2 == 0 else 0, 0) for i in range(2001)]
    ev = sort_events(synth.events_table(rows))
    ev = pa.Table.from_batches(ev.to_batches(max_chunksize=64))
    whole = pair(ev, lifecycle(ev))
    monkeypatch.setattr(match_module, "OPS_PER_BUCKET", 100)
    cut = pair(ev, lifecycle(ev))
    assert cut.allocations.equals(whole.allocations) and cut.counters == whole.counters
    reasons = cut.allocations["end_reason"].to_pylist()
    assert reasons == [EndReason.FREE] * 1000 + [EndReason.END]
    assert cut.allocations["temporary"].to_pylist() == [True] * 1000 + [False]
    assert cut.heap_timeline["heap_bytes"].to_pylist() == [16, 0] * 1000 + [16]


def test_buckets_hold_every_operation_of_an_address() -> None:
    addr = np.arange(1, 100_000, dtype=np.uint64) * 16
    for buckets in (1, 8, 256):
        b = bucket_of(addr, buckets)
        assert b.max() < buckets and (bucket_of(addr.copy(), buckets) == b).all()
        if buckets > 1:  # spread: no bucket holds more than twice its share
            assert np.bincount(b, minlength=buckets).max() < 2 * len(addr) / buckets
    assert buckets_for(0) == 1 and buckets_for(5 << 20) == 8 and buckets_for(1 << 40) == 256


def test_realloc_chain_across_buckets() -> None:
    """A block realloc'd from address to address, each in another bucket: every link."""
    rows = [(1000, 100, 100, synth.K.MALLOC, 0, 0x1000, 0, 8, 1)]
    rows += [(1001 + i, 100, 100, synth.K.REALLOC, 0, 0x1000 + 16 * (i + 1), 0x1000 + 16 * i,
              8 * (i + 2), 1) for i in range(50)]
    rows.append((1100, 100, 100, synth.K.FREE, 0, 0x1000 + 16 * 50, 0, 0, 0))
    ev = sort_events(synth.events_table(rows))
    out = pair(ev, lifecycle(ev), buckets=16)
    a = out.allocations
    assert a["realloc_of"].to_pylist() == [None, *range(50)]
    assert a["end_reason"].to_pylist() == [EndReason.REALLOC] * 50 + [EndReason.FREE]
    assert out.heap_timeline["heap_bytes"].to_pylist() == [8 * (i + 1) for i in range(51)] + [0]


def test_pipeline_buckets_and_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `process`: many buckets give the tables one bucket gives; an artifact
    whose events are out of time order gives the tables of the same events in order."""
    art = tmp_path / "synth.memtrack"
    synth_artifact().generate(art, 30_000, 2_000, threads=4, depth=12, quiet=True)
    one = process_to(art, tmp_path / "one.duckdb", monkeypatch, buckets=1)
    many = process_to(art, tmp_path / "many.duckdb", monkeypatch, buckets=32)
    assert one.counters == many.counters and one.allocations > 10_000
    assert checksums(tmp_path / "one.duckdb") == checksums(tmp_path / "many.duckdb")

    ev = synth.random_events(5, 4000)  # times made distinct: one order only
    ev = ev.set_column(0, "ts", pa.array(np.arange(1000, 1000 + ev.num_rows, dtype=np.uint64)))
    shuffled = ev.take(pa.array(np.random.default_rng(1).permutation(ev.num_rows)))
    synth.write_artifact(tmp_path / "sorted.memtrack", ev)
    synth.write_artifact(tmp_path / "shuffled.memtrack", shuffled)
    a = process_to(tmp_path / "sorted.memtrack", tmp_path / "a.duckdb", monkeypatch, 4)
    b = process_to(tmp_path / "shuffled.memtrack", tmp_path / "b.duckdb", monkeypatch, 4)
    assert a.counters == b.counters and a.allocations > 500
    sa, sb = checksums(tmp_path / "a.duckdb"), checksums(tmp_path / "b.duckdb")
    for name in ("events", "allocations", "heap_timeline", "threads", "processes"):
        assert sa[name] == sb[name], name
    assert sa["allocations"][0] == (a.allocations - a.counters["allocations_before_exec"]
                                    + a.counters["allocations_inherited"])
    assert a.counters["allocations_before_exec"] > 0


def process_to(art: Path, db: Path, monkeypatch: pytest.MonkeyPatch, buckets: int
               ) -> pipeline.Summary:
    monkeypatch.setattr(pipeline, "buckets_for", lambda _n: buckets)
    summary = pipeline.process(art, db, progress=False, jobs=1)
    assert not [p.name for p in db.parent.iterdir() if p.name.startswith(".")], "left behind"
    return summary


def test_nothing_left_after_a_failure(tmp_path: Path) -> None:
    """A damaged events file fails `process` after its events went to the spill: no
    spill, no half-written database."""
    art = synth.write_artifact(tmp_path / "run.memtrack", synth.random_events(2))
    other = synth.write_artifact(tmp_path / "other.memtrack", synth.random_events(3))
    # other events: they parse, their checksum is not the manifest's
    (art / table_file("events")).write_bytes((other / table_file("events")).read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ArtifactError, match="checksum"):
        pipeline.process(art, out / "run.duckdb", progress=False, jobs=1)
    assert list(out.iterdir()) == []


def test_events_read_again_must_be_the_same(tmp_path: Path) -> None:
    """Events in time order are read from the artifact again to be loaded: an events
    file that changed in between is refused, not loaded."""
    art = synth.write_artifact(tmp_path / "run.memtrack", synth.random_events(3))
    opened = Artifact.open(art)
    spill = EventSpill(tmp_path / "spill", 2)
    read_artifact(opened, spill, duckdb.connect())
    assert not spill.stage_events and spill.staged.rows == 0
    assert sum(t.num_rows for t in spilled_events(opened, spill)) == spill.n
    synth.write_artifact(tmp_path / "other.memtrack", synth.random_events(3, 1000))
    (art / table_file("events")).write_bytes(
        (tmp_path / "other.memtrack" / table_file("events")).read_bytes())
    with pytest.raises(ArtifactError):
        list(spilled_events(opened, spill))
    spill.remove()
    assert not (tmp_path / "spill").exists()
