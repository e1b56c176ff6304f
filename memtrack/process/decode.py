"""Decode stack records: rebuild each record's stack bytes and registers.

Records of one thread form chains: a delta record is the XOR of its copy against the
thread's previous record (`ref_hash`), a keyframe (`ref_hash == 0`) or a raw record
stands alone. Records are rebuilt in file order per thread, then every rebuilt copy is
hashed (vectorized across records) and compared with the kernel's hash. A record is
kept when its hash matches, its reference was the thread's previous record, and every
record before it back to its keyframe was kept; otherwise it is dropped and counted in
`decode_mismatch`, and the thread recovers at its next keyframe.

`decode_chunks` rebuilds a bounded number of bytes at a time (the records in file order,
cut into runs of at most `max_bytes` of copies): each thread's last rebuilt record is
carried into the next run as its deltas' reference, so the runs decode exactly as the
whole table would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from memtrack.schema import NUM_REGS, StackEncoding
from memtrack.schema.artifact import Artifact
from memtrack.schema.stackrecord import stack_hash
from memtrack.schema.stages import DECODED_RECORDS

_HASH_ROWS = 1024  # records hashed per vectorized pass (bounds the padded matrix)


@dataclass
class DecodedRecords:
    table: pa.Table  # DECODED_RECORDS: one row per record that decoded and verified
    counters: dict[str, int] = field(default_factory=dict)


DEFAULT_MAX_BYTES = 256 << 20  # rebuilt stack bytes per decode_chunks run


@dataclass
class _Carry:
    """Each thread's last record so far (row order), the reference of its next delta."""

    tid: np.ndarray  # uint32
    hash: np.ndarray  # uint64, the kernel's hash of the record
    sp: np.ndarray  # uint64
    nwords: np.ndarray  # int64
    regs: np.ndarray  # (threads, NUM_REGS) uint64
    words: np.ndarray  # the rebuilt copies end to end, before the uretprobe fixups
    good: np.ndarray  # bool: the record and its chain back to its keyframe were kept

    @classmethod
    def empty(cls) -> _Carry:
        return cls(np.zeros(0, np.uint32), np.zeros(0, np.uint64), np.zeros(0, np.uint64),
                   np.zeros(0, np.int64), np.zeros((0, NUM_REGS), np.uint64),
                   np.zeros(0, np.uint64), np.zeros(0, bool))


def decode(artifact: Artifact) -> DecodedRecords:
    """Decode the stacks table of an artifact."""
    return decode_table(artifact.read("stacks", required=False).table)


def decode_chunks(source: Artifact | pa.Table, max_bytes: int = DEFAULT_MAX_BYTES
                  ) -> Iterator[DecodedRecords]:
    """Decode an artifact's (or a STACKS table's) records in runs of consecutive records
    whose copies add up to at most `max_bytes` (a run holds one record at least). The
    runs' tables, concatenated, are decode_table's table and their counters sum to its
    counters; only one run's rebuilt bytes are held at a time."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    stacks = source.read("stacks", required=False).table if isinstance(source, Artifact) \
        else source
    if stacks.num_rows == 0:
        yield decode_table(stacks)
        return
    ends = np.cumsum(stacks.column("copy_len").to_numpy() // 8 * 8, dtype=np.int64)
    carry = _Carry.empty()
    a = 0
    while a < ends.size:
        first = int(ends[a - 1]) if a else 0
        b = max(int(np.searchsorted(ends, first + max_bytes, side="right")), a + 1)
        out, carry = _decode_rows(stacks.slice(a, b - a), carry)
        yield out
        del out  # not held while the next run is decoded
        a = b


def _binary_parts(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64, data uint8) of a binary column; one chunk is read without a copy,
    several are joined here (Arrow could not join more than 2 GiB into one binary)."""
    chunks = arr.chunks if isinstance(arr, pa.ChunkedArray) else [arr]
    offs, datas, base = [np.zeros(1, dtype=np.int64)], [], 0
    for c in chunks:
        if len(c) == 0:
            continue
        _, obuf, dbuf = c.buffers()
        o = np.frombuffer(obuf, dtype=np.int32, count=len(c) + 1, offset=c.offset * 4)
        o = o.astype(np.int64)
        d = np.frombuffer(dbuf, dtype=np.uint8)[o[0]:o[-1]] if dbuf is not None else \
            np.zeros(0, np.uint8)
        offs.append(o[1:] - o[0] + base)
        datas.append(d)
        base += int(o[-1] - o[0])
    data = datas[0] if len(datas) == 1 else (np.concatenate(datas) if datas else
                                              np.zeros(0, np.uint8))
    return np.concatenate(offs), data


_CHUNK_BYTES = 1 << 30  # output binary chunks stay well below Arrow's 2 GiB offsets


def _binary_chunks(flat: np.ndarray, lengths: np.ndarray) -> pa.ChunkedArray:
    """The byte strings laid end to end in `flat` (lengths in bytes) as binary chunks."""
    data = flat.view(np.uint8)
    ends = np.cumsum(lengths)
    bounds = [0]
    while bounds[-1] < lengths.size:
        first = int(ends[bounds[-1] - 1]) if bounds[-1] else 0
        nxt = int(np.searchsorted(ends, first + _CHUNK_BYTES, side="right"))
        bounds.append(max(nxt, bounds[-1] + 1))
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        first = int(ends[a - 1]) if a else 0
        off = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(lengths[a:b], out=off[1:])
        chunks.append(pa.Array.from_buffers(
            pa.binary(), b - a, [None, pa.py_buffer(off.astype(np.int32)),
                                 pa.py_buffer(data[first:first + int(off[-1])])]))
    return pa.chunked_array(chunks, pa.binary())


def _hash_rows(flat: np.ndarray, nwords: np.ndarray) -> np.ndarray:
    """Stack hashes of the copies laid end to end in `flat` (nwords[i] words each)."""
    out = np.zeros(nwords.size, dtype=np.uint64)
    first = 0
    for lo in range(0, nwords.size, _HASH_ROWS):
        n = nwords[lo:lo + _HASH_ROWS]
        count = int(n.sum())
        width = int(n.max()) if n.size else 0
        mat = np.zeros((n.size, width), dtype=np.uint64)
        # row-major order of `live` is the order of the copies in flat
        mat[np.arange(width)[None, :] < n[:, None]] = flat[first:first + count]
        first += count
        out[lo:lo + n.size] = stack_hash(mat, n)
    return out


def _payload_words(poff: np.ndarray, pdata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The payloads as one uint64 array and each payload's word offsets. Payloads of a
    length that is not whole words are left out (their offsets give an empty range)."""
    lens = np.diff(poff)
    whole = lens % 8 == 0
    if whole.all() and poff[0] % 8 == 0:
        base = int(poff[0])
        words = pdata[base:int(poff[-1])].view(np.uint64)
        return words, (poff - base) // 8
    keep = np.repeat(whole, lens)
    words = pdata[int(poff[0]):int(poff[-1])][keep].view(np.uint64)
    woff = np.zeros(poff.size, dtype=np.int64)
    np.cumsum(np.where(whole, lens // 8, 0), out=woff[1:])
    return words, woff


def _rank(rows: np.ndarray) -> np.ndarray:
    """For a sorted array of row numbers: each entry's index among its row's entries."""
    if rows.size == 0:
        return rows
    start = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    return np.arange(rows.size) - np.repeat(start, np.diff(np.r_[start, rows.size]))


def _parse_deltas(rows: np.ndarray, P: np.ndarray, woff: np.ndarray, nwords: np.ndarray,
                  starts: np.ndarray, flat: np.ndarray, regs: np.ndarray) -> np.ndarray:
    """Scatter the delta words and registers of `rows` into flat/regs (still to be XORed
    with their references); returns which rows parsed."""
    b, e = woff[rows], woff[rows + 1]
    good = e - b >= 2
    safe = np.minimum(b, max(P.size - 1, 0))
    rm = np.where(good, P[safe] if P.size else 0, 0)
    good &= (rm >> np.uint64(NUM_REGS)) == 0
    rbits = ((rm[:, None] >> np.arange(NUM_REGS, dtype=np.uint64)) & np.uint64(1)).astype(bool)
    gpos = b + 1 + rbits.sum(axis=1)
    good &= gpos < e
    gm = np.where(good, P[np.minimum(gpos, max(P.size - 1, 0))] if P.size else 0, 0)
    ngroups = (nwords[rows] + 63) // 64
    over = np.where(ngroups >= 64, 0, gm >> np.minimum(ngroups, 63).astype(np.uint64))
    good &= over == 0
    gbits = ((gm[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)).astype(bool)
    wstart = gpos + 1 + gbits.sum(axis=1)
    good &= wstart <= e
    gbits &= good[:, None]
    g_row, g_idx = np.nonzero(gbits)
    bitmaps = P[gpos[g_row] + 1 + _rank(g_row)]
    nbits = np.bincount(g_row, weights=np.bitwise_count(bitmaps), minlength=rows.size)
    good &= nbits.astype(np.int64) == e - wstart
    keep = good[g_row]
    g_row, g_idx, bitmaps = g_row[keep], g_idx[keep], bitmaps[keep]
    bit = np.unpackbits(bitmaps.view(np.uint8), bitorder="little").reshape(-1, 64)
    bi, bj = np.nonzero(bit)
    w_row = g_row[bi]
    word = g_idx[bi] * 64 + bj
    inside = word < nwords[rows[w_row]]
    bad_rows = np.unique(w_row[~inside])
    good[bad_rows] = False
    sel = good[w_row]
    flat[starts[rows[w_row[sel]]] + word[sel]] = P[wstart[w_row] + _rank(w_row)][sel]
    r_row, r_reg = np.nonzero(rbits & good[:, None])
    regs[rows[r_row], r_reg] = P[b[r_row] + 1 + _rank(r_row)]
    return good


def decode_table(stacks: pa.Table) -> DecodedRecords:
    """Decode a STACKS table (as read from stacks.arrow)."""
    return _decode_rows(stacks, _Carry.empty())[0]


def _decode_rows(stacks: pa.Table, carry: _Carry) -> tuple[DecodedRecords, _Carry]:
    """Decode the records of `stacks`, the first delta of each thread against the
    thread's record in `carry`; returns the records' table and the next run's carry.

    The carried records lead every array below as rows 0..k-1 (no payload, their copies
    and registers already rebuilt, verified as `carry.good` says); they are left out of
    the table and the counters."""
    n = stacks.num_rows
    counters = {"stack_records": n, "stack_keyframes": 0, "stack_deltas": 0, "stack_raw": 0,
                "decode_mismatch": 0, "decode_stale_ref": 0, "decode_bad_payload": 0}
    if n == 0:
        return DecodedRecords(DECODED_RECORDS.empty_table(), counters), carry
    col = {name: stacks.column(name).to_numpy() for name in
           ("hash", "ref_hash", "sp", "copy_len", "tid", "encoding")}
    k = carry.tid.size
    hashes = np.concatenate([carry.hash, col["hash"]])
    ref_hash = np.concatenate([np.zeros(k, np.uint64), col["ref_hash"]])
    sp = np.concatenate([carry.sp, col["sp"]])
    tid = np.concatenate([carry.tid, col["tid"]])
    nwords = np.concatenate([carry.nwords, (col["copy_len"] // 8).astype(np.int64)])
    lead = np.zeros(k, dtype=bool)
    raw = np.concatenate([lead, col["encoding"] == StackEncoding.RAW])
    delta = np.concatenate([lead, col["encoding"] == StackEncoding.DELTA])
    total = k + n
    counters["stack_raw"] = int(raw.sum())
    counters["stack_keyframes"] = int((delta & (ref_hash == 0)).sum())
    counters["stack_deltas"] = int((delta & (ref_hash != 0)).sum())

    poff, pdata = _binary_parts(stacks.column("payload"))
    P, woff = _payload_words(poff, pdata)
    woff = np.concatenate([np.full(k, woff[0]), woff])  # carried rows: empty payloads
    starts = np.zeros(total, dtype=np.int64)
    np.cumsum(nwords[:-1], out=starts[1:])
    flat = np.zeros(int(nwords.sum()), dtype=np.uint64)
    flat[:carry.words.size] = carry.words
    regs = np.zeros((total, NUM_REGS), dtype=np.uint64)
    regs[:k] = carry.regs
    usable = raw | delta  # reference and payload are sound

    # Raw records: the payload is the copy; copied for all of them at once.
    raw_ok = raw & (woff[1:] - woff[:-1] == nwords)
    counters["decode_bad_payload"] += int((raw & ~raw_ok).sum())
    usable &= ~(raw & ~raw_ok)
    flat[np.repeat(raw_ok, nwords)] = P[np.repeat(raw_ok, woff[1:] - woff[:-1])]
    regs_col = stacks.column("regs").combine_chunks()
    # .values keeps the slots of null (delta) rows, so row i is values[i * 17:(i + 1) * 17]
    raw_regs = regs_col.values.to_numpy(zero_copy_only=False)[
        regs_col.offset * NUM_REGS:(regs_col.offset + n) * NUM_REGS].reshape(n, NUM_REGS)
    regs[k:][raw_ok[k:]] = raw_regs[raw_ok[k:]]

    # Delta records: every body parsed at once, then XORed with the thread's previous
    # record, in file order per thread (each needs the one before it).
    drows = np.flatnonzero(delta)
    parsed = _parse_deltas(drows, P, woff, nwords, starts, flat, regs)
    counters["decode_bad_payload"] += int((~parsed).sum())
    usable[drows[~parsed]] = False
    order = np.argsort(tid, kind="stable")
    prev = np.full(total, -1, dtype=np.int64)
    same = tid[order[1:]] == tid[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    chained = delta & (ref_hash != 0)
    stale = chained & ((prev < 0) | (hashes[np.maximum(prev, 0)] != ref_hash))
    counters["decode_stale_ref"] = int(stale.sum())
    usable &= ~stale
    todo = order[(chained & usable)[order]]
    p = prev[todo]
    diff = sp[todo].astype(np.int64) - sp[p].astype(np.int64)
    todo, p, diff = todo[diff % 8 == 0], p[diff % 8 == 0], diff[diff % 8 == 0]
    shift = diff // 8
    lo = np.maximum(0, -shift)
    hi = np.minimum(nwords[todo], nwords[p] - shift)
    go = lo < hi
    d0 = (starts[todo] + lo)[go].tolist()
    d1 = (starts[todo] + hi)[go].tolist()
    s0 = (starts[p] + lo + shift)[go].tolist()
    for a, z, f in zip(d0, d1, s0, strict=True):
        flat[a:z] ^= flat[f:f + z - a]
    # registers: a delta's are the XOR of its chain's register deltas back to its keyframe
    seq_regs = regs[order]
    seg_start = ~chained[order]
    seg_start[1:] |= tid[order[1:]] != tid[order[:-1]]
    acc = np.bitwise_xor.accumulate(seq_regs, axis=0)
    first = np.maximum.accumulate(np.where(seg_start, np.arange(total), 0))
    before = np.where((first > 0)[:, None], acc[np.maximum(first - 1, 0)], 0)
    regs[order] = acc ^ before

    ok = usable.copy()
    ok[k:] &= _hash_rows(flat[carry.words.size:], nwords[k:]) == hashes[k:]
    ok[:k] = carry.good
    # A delta record is only as good as every record back to its keyframe.
    idx = np.arange(total)
    last_bad = np.maximum.accumulate(np.where(~ok[order], idx, -1))
    kept = np.zeros(total, dtype=bool)
    kept[order] = last_bad < first
    keep = kept.copy()
    keep[:k] = False
    counters["decode_mismatch"] = int(n - keep.sum())

    # Each thread's last record, as rebuilt (before the fixups), for the next run.
    last = np.sort(order[np.r_[tid[order[1:]] != tid[order[:-1]], True]])
    in_last = np.zeros(total, dtype=bool)
    in_last[last] = True
    nxt = _Carry(tid[last], hashes[last], sp[last], nwords[last], regs[last],
                 flat[np.repeat(in_last, nwords)], kept[last])

    _apply_fixups(stacks, flat, starts[k:], sp[k:], nwords[k:])
    rows = np.flatnonzero(keep[k:])
    data = flat if rows.size == total else flat[np.repeat(keep, nwords)]
    stack_arr = _binary_chunks(data, nwords[k:][rows] * 8)
    take = pa.array(rows)
    table = pa.table({
        "stack_hash": pa.array(hashes[k:][rows]),
        "pid": stacks.column("pid").take(take),
        "tid": stacks.column("tid").take(take),
        "ts": stacks.column("ts").take(take),
        "sp": pa.array(sp[k:][rows]),
        "copy_len": stacks.column("copy_len").take(take),
        "copy_truncated": stacks.column("truncated").take(take),
        "regs": pa.FixedSizeListArray.from_arrays(pa.array(regs[k:][rows].ravel()),
                                                  NUM_REGS),
        "stack": stack_arr,
        "fp_chain": stacks.column("fp_chain").take(take),
    }, schema=DECODED_RECORDS)
    return DecodedRecords(table, counters), nxt


def _apply_fixups(stacks: pa.Table, flat: np.ndarray, starts: np.ndarray, sp: np.ndarray,
                  nwords: np.ndarray) -> None:
    """Put the recorded original return addresses back where a uretprobe trampoline was
    (the kernel already does so before hashing; this keeps decode exact either way)."""
    fx = stacks.column("ret_fixups").combine_chunks()
    lens = np.diff(np.asarray(fx.offsets)) if len(fx) else np.zeros(0, np.int64)
    if not lens.sum():
        return
    row = np.repeat(np.arange(len(fx)), lens)
    items = fx.flatten()
    slot = items.field("slot").to_numpy()
    value = items.field("value").to_numpy()
    off = slot - sp[row]
    word = (off // np.uint64(8)).astype(np.int64)
    good = (off % np.uint64(8) == 0) & (off < (nwords[row] * 8).astype(np.uint64))
    flat[starts[row[good]] + word[good]] = value[good]
