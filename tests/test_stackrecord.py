"""Stack records: the hash, delta bodies, ring record parsing and chain decoding."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.stackrecords import SP0, StackRef, chain, rand_words, ring_record

from memtrack.capture.stackring import records_to_batch
from memtrack.process.decode import decode_chunks, decode_table
from memtrack.schema import NUM_REGS, STACKS, StackEncoding
from memtrack.schema.stackrecord import FNV_OFFSET, FNV_PRIME, hash_bytes, stack_hash

M64 = (1 << 64) - 1


def ref_hash(words: list[int]) -> int:
    """The hash written out plainly, one word at a time (the issue's definition)."""
    lanes = [FNV_OFFSET ^ lane for lane in range(4)]
    for i, w in enumerate(words):
        lanes[i % 4] = ((lanes[i % 4] ^ w) * FNV_PRIME) & M64
    h = FNV_OFFSET
    for lane in lanes:
        h = ((h ^ lane) * FNV_PRIME) & M64
    h = ((h ^ (8 * len(words))) * FNV_PRIME) & M64
    return h or 1


def test_hash_matches_the_definition_for_every_length_mod_4() -> None:
    rng = np.random.default_rng(1)
    rows = [rand_words(rng, n) for n in (1, 2, 3, 4, 5, 63, 64, 65, 1023, 1024)]
    width = max(r.size for r in rows)
    mat = np.zeros((len(rows), width), dtype=np.uint64)
    for i, r in enumerate(rows):
        mat[i, :r.size] = r
    got = stack_hash(mat, np.array([r.size for r in rows]))
    assert got.tolist() == [ref_hash(r.tolist()) for r in rows]
    assert hash_bytes(rows[4].tobytes()) == ref_hash(rows[4].tolist())
    # the length is part of the hash: trailing zero words change it
    assert hash_bytes(b"\0" * 16) != hash_bytes(b"\0" * 24)


def decoded(records: list[bytes]) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """(the records as stacks.arrow rows, decode_table's rows, its counters)."""
    batch, bad = records_to_batch(records)
    assert bad == 0
    stacks = pa.Table.from_batches([batch])
    out = decode_table(stacks)
    return stacks, out.table, out.counters


def rebuilt(table: pa.Table, row: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """(copy words, registers) of a decoded row."""
    r = table.slice(row % table.num_rows, 1).to_pylist()[0]
    return np.frombuffer(r["stack"], np.uint64), np.array(r["regs"], np.uint64)


def test_keyframe_round_trip() -> None:
    rng = np.random.default_rng(2)
    words = rand_words(rng, 1000)
    words[100:300] = 0  # whole zero groups are left out of the body
    regs = rand_words(rng, NUM_REGS)
    regs[3] = 0
    stacks, table, _ = decoded([ring_record(words, SP0, regs)])
    got, got_regs = rebuilt(table)
    assert np.array_equal(got, words)
    assert np.array_equal(got_regs, regs)
    body = stacks.column("payload")[0].as_py()
    # reg mask + 16 regs + group mask + 16 bitmaps (groups 2-3 are all zero) + words
    assert len(body) == 8 * (1 + 16 + 1 + 14 + 800)


def keyframe_of(ref: StackRef) -> bytes:
    """The record that makes `ref` the thread's reference."""
    return ring_record(ref.words, ref.sp, ref.regs)


@pytest.mark.parametrize("shift_words", [0, 1, -1, 7, -300, 999, -999, 1000, -1000, 5000])
def test_delta_against_a_reference_at_another_sp(shift_words: int) -> None:
    """sp moving up and down, by less and by more than the copy (no overlap)."""
    rng = np.random.default_rng(3)
    ref_words = rand_words(rng, 1000)
    ref = StackRef(hash=hash_bytes(ref_words.tobytes()), sp=SP0, words=ref_words,
                   regs=rand_words(rng, NUM_REGS))
    sp = SP0 + 8 * shift_words
    words = rand_words(rng, 1000)
    # the part that overlaps the reference is mostly unchanged, as on a real stack
    lo, hi = max(0, -shift_words), min(1000, 1000 - shift_words)
    if lo < hi:
        words[lo:hi] = ref_words[lo + shift_words:hi + shift_words]
        words[lo] ^= np.uint64(0xDEAD)
    regs = ref.regs.copy()
    regs[16] += np.uint64(5)
    stacks, table, counters = decoded([keyframe_of(ref), ring_record(words, sp, regs, ref=ref)])
    assert counters["stack_deltas"] == 1 and counters["decode_mismatch"] == 0
    got, got_regs = rebuilt(table)
    assert np.array_equal(got, words)
    assert np.array_equal(got_regs, regs)
    if hi - lo >= 900:  # the overlap costs nothing but the changed word
        assert len(stacks.column("payload")[1].as_py()) < 8 * 200


def test_malformed_bodies_are_dropped_and_counted() -> None:
    words = np.arange(1, 65, dtype=np.uint64)
    stacks, _, _ = decoded([ring_record(words, SP0, np.zeros(NUM_REGS, np.uint64))])
    body = stacks.column("payload")[0].as_py()
    for payload, copy_len in ((body[:-8], 64 * 8),
                              (body, 32 * 8),  # bitmap bits beyond the copy
                              (b"\xff" * 8, 64 * 8)):
        bad = stacks.set_column(stacks.schema.get_field_index("payload"), "payload",
                                pa.array([payload], pa.binary()))
        bad = bad.set_column(bad.schema.get_field_index("copy_len"), "copy_len",
                             pa.array([copy_len], pa.uint32()))
        out = decode_table(bad)
        assert out.counters["decode_bad_payload"] == 1
        assert out.table.num_rows == 0


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 4096),
    ref_n=st.integers(0, 4096),
    shift=st.integers(-5000, 5000),
    seed=st.integers(0, 2**32 - 1),
    density=st.floats(0, 1),
)
def test_property_encode_decode_is_identity(n: int, ref_n: int, shift: int, seed: int,
                                            density: float) -> None:
    rng = np.random.default_rng(seed)
    ref_words = rand_words(rng, ref_n)
    ref = None if ref_n == 0 else StackRef(hash_bytes(ref_words.tobytes()), SP0, ref_words,
                                           rand_words(rng, NUM_REGS))
    sp = SP0 + 8 * shift
    base = np.zeros(n, dtype=np.uint64)
    if ref is not None:
        lo, hi = max(0, -shift), min(n, ref_n - shift)
        if lo < hi:
            base[lo:hi] = ref_words[lo + shift:hi + shift]
    change = rng.random(n) < density
    words = np.where(change, rand_words(rng, n), base)
    regs = rand_words(rng, NUM_REGS)
    records = ([] if ref is None else [keyframe_of(ref)]) + [ring_record(words, sp, regs,
                                                                         ref=ref)]
    _, table, counters = decoded(records)
    assert counters["decode_mismatch"] == 0
    got, got_regs = rebuilt(table)
    assert np.array_equal(got, words)
    assert np.array_equal(got_regs, regs)


def test_ring_records_parse_into_the_stacks_schema() -> None:
    rng = np.random.default_rng(4)
    recs, copies, sps = chain(rng, 5)
    raw, _, _ = chain(rng, 2, tid=9, delta=False)
    batch, bad = records_to_batch(recs + raw + [b"\x01" * 24])
    assert bad == 1
    assert batch.schema.equals(STACKS)
    assert batch.num_rows == 7
    assert batch.column("sp").to_pylist()[:5] == sps
    assert batch.column("encoding").to_pylist() == [StackEncoding.DELTA] * 5 + \
        [StackEncoding.RAW] * 2
    assert batch.column("ref_hash").to_pylist()[0] == 0
    assert batch.column("regs").null_count == 5
    assert batch.column("fp_chain").to_pylist()[0] == [0x401000, 0x401100]
    assert len(batch.column("payload")[5].as_py()) == 512 * 8  # raw: the copy itself


def test_decode_rebuilds_interleaved_thread_chains() -> None:
    rng = np.random.default_rng(5)
    a, ca, _ = chain(rng, 40, tid=1)
    b, cb, _ = chain(rng, 40, tid=2)
    r, cr, _ = chain(rng, 3, tid=3, delta=False)
    mixed = [x for pair in zip(a, b, strict=True) for x in pair] + r
    batch, _ = records_to_batch(mixed)
    out = decode_table(pa.Table.from_batches([batch]))
    assert out.counters["decode_mismatch"] == 0
    assert out.counters["stack_keyframes"] == 2
    assert out.counters["stack_deltas"] == 78
    assert out.counters["stack_raw"] == 3
    t = out.table
    assert t.num_rows == 83
    by_hash = dict(zip(t.column("stack_hash").to_pylist(), t.column("stack").to_pylist(),
                       strict=True))
    for c in ca + cb + cr:
        assert by_hash[hash_bytes(c.tobytes())] == c.tobytes()
    assert t.column("regs")[0].as_py()[16] == 0x401000


def test_stale_reference_is_dropped_until_the_next_keyframe() -> None:
    rng = np.random.default_rng(6)
    recs, copies, _ = chain(rng, 6)
    again, copies2, _ = chain(rng, 3)  # a new keyframe chain of the same thread
    lost = recs[:2] + recs[3:] + again  # record 2 never arrived (ring loss)
    batch, _ = records_to_batch(lost)
    out = decode_table(pa.Table.from_batches([batch]))
    assert out.counters["decode_stale_ref"] == 1
    assert out.counters["decode_mismatch"] == 3  # record 3 and the two chained on it
    kept = set(out.table.column("stack_hash").to_pylist())
    want = {hash_bytes(c.tobytes()) for c in copies[:2] + copies2}
    assert kept == want


def test_hash_mismatch_is_dropped_and_counted() -> None:
    rng = np.random.default_rng(7)
    recs, copies, _ = chain(rng, 4)
    bad = bytearray(recs[1])
    bad[-1] ^= 0x40  # last delta word flipped: decodes, but hashes differently
    batch, _ = records_to_batch([recs[0], bytes(bad), recs[2], recs[3]])
    out = decode_table(pa.Table.from_batches([batch]))
    assert out.counters["decode_mismatch"] == 3
    assert out.table.column("stack_hash").to_pylist() == [hash_bytes(copies[0].tobytes())]


def test_truncated_copy_and_uretprobe_fixups_survive_decoding() -> None:
    rng = np.random.default_rng(8)
    words = rand_words(rng, 256)
    slot = SP0 + 8 * 5
    rec = ring_record(words, SP0, rand_words(rng, NUM_REGS), truncated=True,
                      fixups=((slot, int(words[5])),))
    batch, _ = records_to_batch([rec])
    assert batch.column("truncated").to_pylist() == [True]
    assert batch.column("ret_fixups").to_pylist() == [[{"slot": slot, "value": int(words[5])}]]
    out = decode_table(pa.Table.from_batches([batch]))
    assert out.table.column("copy_truncated").to_pylist() == [True]
    assert out.table.column("copy_len").to_pylist() == [256 * 8]
    assert out.table.column("stack")[0].as_py() == words.tobytes()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), threads=st.integers(1, 4), count=st.integers(1, 25))
def test_property_decode_table_rebuilds_random_chains(seed: int, threads: int,
                                                      count: int) -> None:
    """Interleaved threads, copies of varying length, sp jumping by up to 3x the budget,
    keyframes now and then: every record comes back with its bytes and registers."""
    rng = np.random.default_rng(seed)
    records, want = [], {}
    refs: dict[int, StackRef | None] = {}
    for _ in range(count):
        for tid in range(1, threads + 1):
            n = int(rng.integers(1, 1025))
            sp = SP0 + 8 * int(rng.integers(-3072, 3072))
            ref = refs.get(tid)
            words = rand_words(rng, n)
            if ref is not None:  # mostly the reference's bytes where they overlap
                base = np.zeros(n, dtype=np.uint64)
                shift = (sp - ref.sp) // 8
                lo, hi = max(0, -shift), min(n, ref.words.size - shift)
                if lo < hi:
                    base[lo:hi] = ref.words[lo + shift:hi + shift]
                words = np.where(rng.random(n) < 0.1, words, base)
            if rng.random() < 0.1:
                ref = None  # the kernel lost the reference: a keyframe
            regs = rand_words(rng, NUM_REGS)
            records.append(ring_record(words, sp, regs, tid=tid, pid=tid, ref=ref))
            h = hash_bytes(words.tobytes())
            want[h] = (words.tobytes(), regs.tolist())
            refs[tid] = StackRef(h, sp, words, regs)
    batch, bad = records_to_batch(records)
    assert bad == 0
    out = decode_table(pa.Table.from_batches([batch]))
    assert out.counters["decode_mismatch"] == 0
    got = out.table.to_pylist()
    assert len(got) == len(records)
    for rec in got:
        assert (rec["stack"], rec["regs"]) == want[rec["stack_hash"]]


def test_decoded_stacks_are_split_into_binary_chunks_and_multi_chunk_payloads_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrow binary offsets are 32-bit: big outputs come in chunks, and a stacks table
    read in several batches decodes the same."""
    import memtrack.process.decode as dec

    rng = np.random.default_rng(9)
    recs, copies, _ = chain(rng, 12, tid=3)
    b1, _ = records_to_batch(recs[:5])
    b2, _ = records_to_batch(recs[5:])
    monkeypatch.setattr(dec, "_CHUNK_BYTES", 3 * 512 * 8)
    out = decode_table(pa.Table.from_batches([b1, b2]))
    stack = out.table.column("stack")
    assert stack.num_chunks == 4
    assert stack.to_pylist() == [c.tobytes() for c in copies]


def mixed_records(rng: np.random.Generator) -> tuple[list[bytes], int]:
    """One thread's long stream (keyframes mid-way, a hash mismatch, a lost record, so a
    stale reference), another thread interleaved, raw records, and a keyframe with a
    uretprobe fixup that a later delta references; and the copies' largest size."""
    a1, _, _ = chain(rng, 30, tid=7)
    a2, _, _ = chain(rng, 25, tid=7)  # a new keyframe chain of the same thread
    a3, _, _ = chain(rng, 20, tid=7)
    bad = bytearray(a1[12])
    bad[-1] ^= 0x40  # decodes, hashes differently: 12..29 are dropped
    main = a1[:12] + [bytes(bad)] + a1[13:] + a2[:9] + a2[10:] + a3  # a2[9] lost
    other, _, _ = chain(rng, 20, tid=8, n=300)
    raw, _, _ = chain(rng, 4, tid=9, delta=False)
    words = rand_words(rng, 200)
    regs = rand_words(rng, NUM_REGS)
    slot = SP0 + 8 * 3
    key = ring_record(words, SP0, regs, tid=5, pid=5, fixups=((slot, 0x401234),))
    nxt = words.copy()
    nxt[100] ^= np.uint64(1)
    dlt = ring_record(nxt, SP0, regs, tid=5, pid=5,
                      ref=StackRef(hash_bytes(words.tobytes()), SP0, words, regs))
    out = main[:40] + [key] + main[40:50] + raw[:2] + main[50:] + [dlt] + raw[2:]
    for i, rec in enumerate(other):
        out.insert(3 * i + 1, rec)
    return out, 512 * 8


@pytest.mark.parametrize("records_per_run", [1, 2, 3, 7, 1000])
def test_decode_chunks_equals_decoding_whole(records_per_run: int) -> None:
    """Runs of a few records each (a thread's chain crossing dozens of runs) come out as
    the whole table and the same counters."""
    rng = np.random.default_rng(11)
    recs, biggest = mixed_records(rng)
    batch, _ = records_to_batch(recs)
    stacks = pa.Table.from_batches([batch])
    whole = decode_table(stacks)
    assert whole.counters["decode_stale_ref"] == 1
    assert whole.counters["decode_mismatch"] == 18 + 15  # a1[12..29], a2[10..24]
    assert whole.counters["stack_keyframes"] == 5 and whole.counters["stack_raw"] == 4
    fixed = whole.table.filter(pa.compute.equal(whole.table.column("tid"), 5))
    assert fixed.num_rows == 2
    assert np.frombuffer(fixed.column("stack")[0].as_py(), np.uint64)[3] == 0x401234
    runs = list(decode_chunks(stacks, records_per_run * biggest))
    sizes = np.split(stacks.column("copy_len").to_numpy(),
                     np.cumsum([r.counters["stack_records"] for r in runs])[:-1])
    assert all(s.sum() <= records_per_run * biggest or s.size == 1 for s in sizes)
    assert len(runs) >= len(recs) // records_per_run
    got = pa.concat_tables([r.table for r in runs])
    assert got.equals(whole.table)
    summed = {k: sum(r.counters[k] for r in runs) for k in whole.counters}
    assert summed == whole.counters


def test_decode_chunks_of_an_empty_table_and_bad_sizes() -> None:
    runs = list(decode_chunks(STACKS.empty_table()))
    assert [r.table.num_rows for r in runs] == [0]
    assert runs[0].counters["stack_records"] == 0
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        next(decode_chunks(STACKS.empty_table(), 0))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_bytes=st.integers(1, 40000))
def test_property_decode_chunks_equals_decoding_whole(seed: int, max_bytes: int) -> None:
    rng = np.random.default_rng(seed)
    recs, _ = mixed_records(rng)
    drop = rng.integers(0, len(recs), size=3)  # losses anywhere: more stale references
    recs = [r for i, r in enumerate(recs) if i not in set(drop.tolist())]
    stacks = pa.Table.from_batches([records_to_batch(recs)[0]])
    whole = decode_table(stacks)
    runs = list(decode_chunks(stacks, max_bytes))
    assert pa.concat_tables([r.table for r in runs]).equals(whole.table)
    assert {k: sum(r.counters[k] for r in runs) for k in whole.counters} == whole.counters
