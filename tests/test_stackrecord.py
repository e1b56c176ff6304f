"""The stack-record format: the skeleton hash, ring record parsing, decoding."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.stackrecords import (
    CODE,
    SP0,
    ref_hash,
    regions_kept,
    regs_of,
    ring_record,
    stack_words,
)

from memtrack.capture.stackring import records_to_batches
from memtrack.process.decode import decode_pieces, decode_table
from memtrack.schema import STACK_COPIES, STACKS
from memtrack.schema.stackrecord import CALLEE_SAVED


def test_hash_and_skeleton_for_every_length_around_a_group() -> None:
    rng = np.random.default_rng(1)
    kept = regions_kept(CODE, SP0)
    for n in (1, 2, 3, 63, 64, 65, 127, 1000):
        words = stack_words(rng, n, SP0)
        regs = regs_of(rng, SP0)
        out = records_to_batches([ring_record(words, SP0, regs, kept)])
        assert out.malformed == 0
        assert out.stacks.num_rows == 1
        dec = decode_table(pa.Table.from_batches([out.stacks]))
        assert dec.counters["decode_mismatch"] == 0
        rec = dec.table.to_pylist()[0]
        canon = [int(w) if kept(int(w)) else 0 for w in words]
        assert np.frombuffer(rec["stack"], np.uint64).tolist() == canon
        assert rec["regs"] == [int(r) if kept(int(r)) and i in CALLEE_SAVED else 0
                               for i, r in enumerate(regs)]
        assert rec["regs"][7] == SP0 and rec["regs"][16] == CODE + 0x10
        assert rec["stack_hash"] == ref_hash(words.tolist(), regs.tolist(), SP0, kept)


def test_locals_do_not_change_the_hash_positions_values_and_sp_do() -> None:
    rng = np.random.default_rng(2)
    kept = regions_kept(CODE, SP0)
    words = stack_words(rng, 300, SP0)
    regs = regs_of(rng, SP0)
    h = ref_hash(words.tolist(), regs.tolist(), SP0, kept)
    other = words.copy()
    locals_ = np.flatnonzero([not kept(int(w)) for w in words])
    other[locals_] = rng.integers(0, 2**32, size=locals_.size, dtype=np.uint64)
    r2 = regs.copy()
    r2[0] = CODE + 8  # rax: dead at an allocator's entry, never kept
    r2[3] = 12345  # rbx: not in a kept region
    assert ref_hash(other.tolist(), r2.tolist(), SP0, kept) == h
    ret = np.flatnonzero([kept(int(w)) for w in words])[0]
    moved = words.copy()
    moved[ret], moved[ret + 1] = moved[ret + 1], moved[ret]
    assert ref_hash(moved.tolist(), regs.tolist(), SP0, kept) != h
    assert ref_hash(words.tolist(), regs.tolist(), SP0 + 8, kept) != h
    assert ref_hash(words.tolist()[:-1], regs.tolist(), SP0, kept) != h
    assert ref_hash(words.tolist(), regs.tolist(), SP0, kept, cut=True) != h


def test_cut_copy_hashes_its_frame_pointer_chain() -> None:
    rng = np.random.default_rng(3)
    kept = regions_kept(CODE, SP0)
    words = stack_words(rng, 128, SP0)
    regs = regs_of(rng, SP0)
    fp = (CODE + 0x10, CODE + 0x200, CODE + 0x300)
    rec = ring_record(words, SP0, regs, kept, cut=True, fp=fp)
    out = records_to_batches([rec])
    assert decode_table(pa.Table.from_batches([out.stacks])).counters["decode_mismatch"] == 0
    row = out.stacks.to_pylist()[0]
    assert row["truncated"] is True and row["fp_chain"] == list(fp)
    assert row["hash"] != ref_hash(words.tolist(), regs.tolist(), SP0, kept, cut=True,
                                   fp=fp[:2])


def test_ring_records_parse_into_the_stacks_schema_and_bad_ones_are_counted() -> None:
    rng = np.random.default_rng(4)
    kept = regions_kept(CODE, SP0)
    words = stack_words(rng, 200, SP0)
    regs = regs_of(rng, SP0)
    slot = SP0 + 8 * 5
    good = ring_record(words, SP0, regs, kept, tid=9, pid=8, ts=77,
                       fixups=((slot, CODE + 0x44),))
    wrong = ring_record(words, SP0, regs, kept, hash=0x1234)  # skeleton hashes otherwise
    short = good[:-8]
    out = records_to_batches([good, wrong, short, b"\x01" * 24])
    assert out.malformed == 2
    assert out.stacks.schema.equals(STACKS)
    # the hash is checked where the record is decoded
    dec = decode_table(pa.Table.from_batches([out.stacks]))
    assert dec.counters["decode_mismatch"] == 1
    assert 0x1234 not in dec.table.column("stack_hash").to_pylist()
    row = out.stacks.to_pylist()[0]
    assert (row["pid"], row["tid"], row["ts"], row["sp"]) == (8, 9, 77, SP0)
    assert row["copy_len"] == 200 * 8 and row["truncated"] is False
    assert row["ret_fixups"] == [{"slot": slot, "value": CODE + 0x44}]
    assert row["fp_chain"] == []
    nkept = sum(kept(int(w)) for w in words)
    assert len(row["payload"]) == 8 * (4 + nkept)  # 4 bitmap words, the kept words
    assert out.copies is None


def test_copies_mode_keeps_every_capture_and_only_new_records_become_stacks() -> None:
    rng = np.random.default_rng(5)
    kept = regions_kept(CODE, SP0)
    words = stack_words(rng, 100, SP0)
    regs = regs_of(rng, SP0)
    first = ring_record(words, SP0, regs, kept, copy=True)
    later = words.copy()
    later[[i for i in range(100) if not kept(int(words[i]))][:3]] ^= np.uint64(0xFF)
    again = ring_record(later, SP0, regs, kept, copy=True, new=False)
    out = records_to_batches([first, again], copies=True)
    assert out.stacks.num_rows == 1
    assert out.copies is not None and out.copies.schema.equals(STACK_COPIES)
    copies = out.copies.to_pylist()
    assert [c["hash"] for c in copies] == [out.stacks.column("hash")[0].as_py()] * 2
    assert [c["stack"] for c in copies] == [words.tobytes(), later.tobytes()]
    assert copies[0]["regs"] == regs.tolist()  # raw, not canonical


def skeleton_table(rng: np.random.Generator, count: int) -> tuple[pa.Table, list[bytes]]:
    kept = regions_kept(CODE, SP0)
    recs, canon = [], []
    for i in range(count):
        n = int(rng.integers(1, 700))
        sp = SP0 + 8 * int(rng.integers(0, 512))
        words = stack_words(rng, n, sp)
        recs.append(ring_record(words, sp, regs_of(rng, sp), kept, tid=i % 3 + 1, ts=i))
        canon.append(np.array([int(w) if kept(int(w)) else 0 for w in words],
                              np.uint64).tobytes())
    out = records_to_batches(recs)
    assert out.malformed == 0
    return pa.Table.from_batches([out.stacks]), canon


def test_decode_drops_bad_payloads_and_hash_mismatches() -> None:
    rng = np.random.default_rng(6)
    stacks, canon = skeleton_table(rng, 5)
    payload = stacks.column("payload").to_pylist()
    payload[1] = payload[1][:-8]  # one kept word short
    hashes = stacks.column("hash").to_pylist()
    hashes[3] ^= 1
    bits = bytearray(payload[4])
    bits[0] ^= 1  # the bitmap says another word: the count no longer matches
    payload[4] = bytes(bits)
    t = stacks.set_column(stacks.schema.get_field_index("payload"), "payload",
                          pa.array(payload, pa.binary()))
    t = t.set_column(0, "hash", pa.array(hashes, pa.uint64()))
    out = decode_table(t)
    assert out.counters["decode_bad_payload"] == 2
    assert out.counters["decode_mismatch"] == 3
    assert out.table.column("stack").to_pylist() == [canon[0], canon[2]]


def test_a_kept_bit_in_the_padding_must_stand_for_zero() -> None:
    """A zero word in a kept region (region 0 aliases a kept one) is kept, padding
    included; a nonzero value there is a bad payload."""
    rng = np.random.default_rng(7)
    kept = regions_kept(CODE, SP0, 0)
    words = stack_words(rng, 10, SP0)
    rec = ring_record(words, SP0, regs_of(rng, SP0), kept)
    out = records_to_batches([rec])
    t = pa.Table.from_batches([out.stacks])
    assert decode_table(t).counters["decode_mismatch"] == 0
    payload = bytearray(t.column("payload")[0].as_py())
    payload[-8:] = (5).to_bytes(8, "little")  # the last kept word is padding
    bad = t.set_column(t.schema.get_field_index("payload"), "payload",
                       pa.array([bytes(payload)], pa.binary()))
    assert decode_table(bad).counters["decode_bad_payload"] == 1


def test_decoded_stacks_are_split_into_binary_chunks_and_multi_chunk_payloads_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrow binary offsets are 32-bit: big outputs come in chunks, and a stacks table
    read in several batches decodes the same."""
    import memtrack.process.decode as dec

    rng = np.random.default_rng(9)
    stacks, canon = skeleton_table(rng, 12)
    split = pa.Table.from_batches(stacks.slice(0, 5).to_batches() +
                                  stacks.slice(5).to_batches())
    monkeypatch.setattr(dec, "_CHUNK_BYTES", 1)  # every copy is a chunk of its own
    out = decode_table(split)
    stack = out.table.column("stack")
    assert stack.num_chunks == 12
    assert stack.to_pylist() == canon


@pytest.mark.parametrize("max_bytes", [1, 4000, 20000, 1 << 30])
def test_decode_pieces_equals_decoding_whole(max_bytes: int) -> None:
    rng = np.random.default_rng(11)
    stacks, _ = skeleton_table(rng, 40)
    whole = decode_table(stacks)
    pieces = list(decode_pieces(stacks, max_bytes))
    sizes = np.split(stacks.column("copy_len").to_numpy(),
                     np.cumsum([r.counters["stack_records"] for r in pieces])[:-1])
    assert all(s.sum() <= max_bytes or s.size == 1 for s in sizes)
    assert pa.concat_tables([r.table for r in pieces]).equals(whole.table)
    assert {k: sum(r.counters[k] for r in pieces) for k in whole.counters} == whole.counters


def test_decode_pieces_of_an_empty_table_and_bad_sizes() -> None:
    pieces = list(decode_pieces(STACKS.empty_table()))
    assert [r.table.num_rows for r in pieces] == [0]
    assert pieces[0].counters["stack_records"] == 0
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        next(decode_pieces(STACKS.empty_table(), 0))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 20), cut=st.booleans(),
       density=st.floats(0, 1))
def test_property_ring_to_decode_round_trip(seed: int, count: int, cut: bool,
                                            density: float) -> None:
    """Copies of any length and any share of kept words, cut or not, with frame-pointer
    chains: each record parses, its hash verifies, and it decodes to its skeleton."""
    rng = np.random.default_rng(seed)
    kept = regions_kept(CODE, SP0)
    recs, want = [], []
    for i in range(count):
        n = int(rng.integers(1, 4097))
        words = rng.integers(0, 2**48, size=n, dtype=np.uint64)
        code = rng.random(n) < density
        words[code] = np.uint64(CODE) + rng.integers(0, 0x10000, size=int(code.sum()),
                                                     dtype=np.uint64)
        fp = tuple(int(x) for x in rng.integers(1, 2**47, size=int(rng.integers(0, 65))))
        regs = regs_of(rng, SP0)
        recs.append(ring_record(words, SP0, regs, kept, cut=cut, fp=fp, ts=i))
        # a random word may land in a kept region (or one of its aliases) too
        want.append(np.array([int(w) if kept(int(w)) else 0 for w in words],
                             np.uint64).tobytes())
    out = records_to_batches(recs)
    assert out.malformed == 0
    dec = decode_table(pa.Table.from_batches([out.stacks]))
    assert dec.counters["decode_mismatch"] == 0
    assert dec.table.column("stack").to_pylist() == want
