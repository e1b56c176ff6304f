"""Stack records: the kernel's skeleton hash and record layouts, in numpy.

The kernel side is memtrack/bpf/stacks.h; both must agree word for word.

A stack record holds the skeleton of a stack copy: the words (and registers) whose value
lies in a kept region of the address space (executable code, thread stacks), every other
word read as 0. Its hash (FNV-1a steps `h = (h ^ x) * FNV_PRIME`): the canonical copy,
zero-padded to whole groups of GROUP_WORDS words, word i into lane i % 2 (lane l seeded
FNV_OFFSET ^ l); the lanes folded in order into FNV_OFFSET; then the canonical
registers of CALLEE_SAVED in order, sp, copy_len | cut << 32, and for a cut copy each
frame-pointer entry then their count. 0 means "no stack": a result of 0 becomes 1.

Ring record (u64 words): hash, ts, pid | tid << 32, sp,
copy_len | fp_count << 32 | nfix << 48 | flags << 56, reg_kept, body_len; then fp_count
frame-pointer return addresses, nfix (slot, value) pairs, and the body: the 17 raw
registers, the kept bitmap (one word per group of the padded copy), the kept words in
order, and with FLAG_COPY the raw copy.

`stacks.payload` of a record: the kept bitmap then the kept words (a bit set in the
padding beyond the copy stands for a 0 word); `stacks.regs` are the canonical registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memtrack.schema import NUM_REGS, STACK_COPIES, STACKS

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
LANES = 2
GROUP_WORDS = 64
HDR_WORDS = 7
FLAG_CUT = 1
FLAG_SKELETON = 4
FLAG_NEW = 8
FLAG_COPY = 16
MAX_BUDGET = 32768
MIN_BUDGET = 512
REGION_SHIFT = 16  # kept regions are 64 KiB
REGION_BYTES = 1 << 22  # one byte per region, addresses' bits 16..37
# The registers a skeleton may keep (DWARF numbers): rbx, rbp, rsp, r12-r15, rip; the
# others are dead at an allocator's entry.
CALLEE_SAVED = (3, 6, 7, 12, 13, 14, 15, 16)

_U64 = np.dtype("<u8")
_HASH_ROWS = 512  # copies hashed per vectorized pass (bounds the padded matrix)


class StackFormatError(ValueError):
    """A stack record that does not parse."""


def _fnv(h: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (h ^ x) * np.uint64(FNV_PRIME)


def skeleton_hash(canon: np.ndarray, nwords: np.ndarray, regs: np.ndarray, sp: np.ndarray,
                  cut: np.ndarray, fp_offsets: np.ndarray, fp_values: np.ndarray
                  ) -> np.ndarray:
    """Hashes of many skeletons at once. Row r of `canon` (rows x W, W a multiple of
    GROUP_WORDS) holds the canonical copy of nwords[r] words, zero beyond; `regs` the
    canonical registers; fp_values[fp_offsets[r]:fp_offsets[r + 1]] the frame-pointer
    chain of row r (used where cut)."""
    canon = np.asarray(canon, dtype=np.uint64)
    rows, width = canon.shape
    if width % GROUP_WORDS:
        raise ValueError("canonical copies must be padded to whole groups")
    n = np.asarray(nwords, dtype=np.int64)
    padded = -(-n // GROUP_WORDS) * GROUP_WORDS
    lanes = np.empty((LANES, rows), dtype=np.uint64)
    lanes[:] = (np.uint64(FNV_OFFSET) ^ np.arange(LANES, dtype=np.uint64))[:, None]
    cols = np.ascontiguousarray(canon.T)
    lane_idx = np.arange(LANES)[:, None]
    full = int(padded.min()) if rows else 0
    with np.errstate(over="ignore"):
        for c in range(0, full, LANES):
            lanes = _fnv(lanes, cols[c:c + LANES])
        for c in range(full, width, LANES):
            live = (c + lane_idx) < padded[None, :]
            if not live.any():
                break
            np.copyto(lanes, _fnv(lanes, cols[c:c + LANES]), where=live)
        h = np.full(rows, FNV_OFFSET, dtype=np.uint64)
        for lane in range(LANES):
            h = _fnv(h, lanes[lane])
        for r in CALLEE_SAVED:
            h = _fnv(h, regs[:, r].astype(np.uint64))
        h = _fnv(h, np.asarray(sp, dtype=np.uint64))
        cut = np.asarray(cut, dtype=bool)
        h = _fnv(h, n.astype(np.uint64) * np.uint64(8) | (cut.astype(np.uint64) << np.uint64(32)))
        nfp = np.diff(fp_offsets).astype(np.int64)
        if cut.any():
            for i in range(int(nfp[cut].max(initial=0))):
                live = cut & (nfp > i)
                idx = np.minimum(fp_offsets[:-1] + i, max(fp_values.size - 1, 0))
                vals = fp_values[idx] if fp_values.size else np.zeros(rows, np.uint64)
                np.copyto(h, _fnv(h, vals), where=live)
            np.copyto(h, _fnv(h, nfp.astype(np.uint64)), where=cut)
    h[h == 0] = 1
    return h


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + lengths[i])."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    offs = np.repeat(starts.astype(np.int64) - (ends - lengths), lengths)
    return np.arange(total, dtype=np.int64) + offs


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def ngroups(nwords: np.ndarray) -> np.ndarray:
    """Kept-bitmap words of copies of `nwords` words."""
    return -(-np.asarray(nwords, dtype=np.int64) // GROUP_WORDS)


@dataclass
class Skeletons:
    """Skeletons rebuilt as canonical copies laid end to end (nwords[i] words each)."""

    flat: np.ndarray  # uint64
    nwords: np.ndarray  # int64
    good: np.ndarray  # bool: the payload parsed


def rebuild(payload_words: np.ndarray, payload_offsets: np.ndarray, nwords: np.ndarray
            ) -> Skeletons:
    """Canonical copies from skeleton payloads (the words of payload i are
    payload_words[payload_offsets[i]:payload_offsets[i + 1]])."""
    nwords = np.asarray(nwords, dtype=np.int64)
    k = nwords.size
    nb = ngroups(nwords)
    start = payload_offsets[:-1].astype(np.int64)
    plen = np.diff(payload_offsets).astype(np.int64)
    good = (nwords > 0) & (plen >= nb)
    nb = np.where(good, nb, 0)
    bm = payload_words[_ragged(start, nb)]
    ones = np.bitwise_count(bm).astype(np.int64)
    row_of_bm = np.repeat(np.arange(k), nb)
    kept = np.bincount(row_of_bm, weights=ones, minlength=k).astype(np.int64)
    good &= plen == nb + kept
    flat = np.zeros(int(nwords.sum()), dtype=np.uint64)
    sel = good[row_of_bm]
    bits = np.unpackbits(bm[sel].view(np.uint8), bitorder="little").reshape(-1, GROUP_WORDS)
    bi, bj = np.nonzero(bits)
    rows = row_of_bm[sel]
    g = _ragged(np.zeros(k, np.int64), nb)[sel]  # each bitmap word's group within its row
    w_row = rows[bi]
    w_pos = g[bi] * GROUP_WORDS + bj
    vals = payload_words[_ragged(start + nb, np.where(good, kept, 0))]
    inside = w_pos < nwords[w_row]
    # a bit beyond the copy (its zero padding) must stand for a 0 word
    bad = np.unique(w_row[~inside & (vals != 0)])
    good[bad] = False
    ok = inside & good[w_row]
    starts = _offsets(nwords)[:-1]
    flat[starts[w_row[ok]] + w_pos[ok]] = vals[ok]
    return Skeletons(flat, nwords, good)


def hash_rows(flat: np.ndarray, nwords: np.ndarray, regs: np.ndarray, sp: np.ndarray,
              cut: np.ndarray, fp_offsets: np.ndarray, fp_values: np.ndarray) -> np.ndarray:
    """skeleton_hash of canonical copies laid end to end in `flat` (nwords[i] words each),
    a bounded number of rows at a time."""
    nwords = np.asarray(nwords, dtype=np.int64)
    out = np.zeros(nwords.size, dtype=np.uint64)
    starts = _offsets(nwords)
    for lo in range(0, nwords.size, _HASH_ROWS):
        hi = min(lo + _HASH_ROWS, nwords.size)
        n = nwords[lo:hi]
        width = int(ngroups(n).max(initial=0)) * GROUP_WORDS
        mat = np.zeros((hi - lo, width), dtype=np.uint64)
        # row-major order of `live` is the order of the copies in flat
        mat[np.arange(width)[None, :] < n[:, None]] = flat[starts[lo]:starts[hi]]
        fo = fp_offsets[lo:hi + 1]
        out[lo:hi] = skeleton_hash(mat, n, regs[lo:hi], sp[lo:hi], cut[lo:hi],
                                   fo - fo[0], fp_values[fo[0]:fo[-1]])
    return out


def skeleton_payloads(canon: np.ndarray, kept: np.ndarray, nwords: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(payload words laid end to end, their offsets) of copies laid end to end in
    `canon`, `kept` (bool, same layout) marking the skeleton's words."""
    nwords = np.asarray(nwords, dtype=np.int64)
    nb = ngroups(nwords)
    padded = np.zeros(int((nb * GROUP_WORDS).sum()), dtype=bool)
    pstart = _offsets(nb * GROUP_WORDS)[:-1]
    padded[_ragged(pstart, nwords)] = kept
    bm = np.packbits(padded.reshape(-1, GROUP_WORDS), axis=1, bitorder="little").view(_U64)
    bm = bm.ravel()
    nkept = np.add.reduceat(kept.astype(np.int64), _offsets(nwords)[:-1]) if kept.size \
        else np.zeros(nwords.size, np.int64)
    nkept = np.where(nwords > 0, nkept, 0)
    plen = nb + nkept
    offs = _offsets(plen)
    words = np.zeros(int(plen.sum()), dtype=_U64)
    words[_ragged(offs[:-1], nb)] = bm
    words[_ragged(offs[:-1] + nb, nkept)] = canon[kept]
    return words, offs


def _list(values: np.ndarray, offsets: np.ndarray, typ: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, typ))


def _binary(data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """Words laid end to end as a binary array (offsets in words)."""
    return pa.Array.from_buffers(pa.binary(), offsets.size - 1, [
        None, pa.py_buffer((offsets * 8).astype(np.int32)),
        pa.py_buffer(np.ascontiguousarray(data, dtype=_U64).tobytes())])


def skeleton_batch(*, hash: np.ndarray, ts: np.ndarray, pid: np.ndarray, tid: np.ndarray,
                   sp: np.ndarray, nwords: np.ndarray, cut: np.ndarray, regs: np.ndarray,
                   payload: tuple[np.ndarray, np.ndarray], fp: tuple[np.ndarray, np.ndarray],
                   fixups: tuple[np.ndarray, np.ndarray]) -> pa.RecordBatch:
    """A STACKS batch. payload/fp: (words end to end, offsets per row); fixups:
    ((k, 2) slot/value pairs end to end, offsets per row)."""
    pairs, fix_off = fixups
    fix = pa.StructArray.from_arrays(
        [pa.array(pairs[:, 0], pa.uint64()), pa.array(pairs[:, 1], pa.uint64())],
        names=["slot", "value"])
    cols = {
        "hash": pa.array(hash, pa.uint64()),
        "ts": pa.array(ts, pa.uint64()),
        "pid": pa.array(pid, pa.uint32()),
        "tid": pa.array(tid, pa.uint32()),
        "sp": pa.array(sp, pa.uint64()),
        "copy_len": pa.array((np.asarray(nwords) * 8).astype(np.uint32)),
        "truncated": pa.array(np.asarray(cut, dtype=bool)),
        "regs": pa.FixedSizeListArray.from_arrays(
            pa.array(np.asarray(regs, dtype=np.uint64).ravel(), pa.uint64()), NUM_REGS),
        "payload": _binary(*payload),
        "fp_chain": _list(fp[0], fp[1], pa.uint64()),
        "ret_fixups": pa.ListArray.from_arrays(pa.array(fix_off.astype(np.int32)), fix),
    }
    return pa.RecordBatch.from_arrays([cols[f.name] for f in STACKS], schema=STACKS)


@dataclass
class RingBatches:
    stacks: pa.RecordBatch  # the records new to the kernel's dedupe set
    copies: pa.RecordBatch | None  # every record's raw copy (records with FLAG_COPY)
    malformed: int  # records that do not parse
    mismatched: list[int]  # hashes of records whose skeleton does not hash to them


def records_to_batches(records: list[bytes], *, copies: bool = False) -> RingBatches:
    """Ring records as a STACKS batch (and a STACK_COPIES batch)."""
    lens = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
    ok = (lens >= HDR_WORDS * 8) & (lens % 8 == 0)
    blob = b"".join(r for r, good in zip(records, ok.tolist(), strict=True) if good)
    lens = lens[ok]
    words = np.frombuffer(blob, dtype=_U64)
    wstart = _offsets(lens // 8)[:-1]
    hdr = words[wstart[:, None] + np.arange(HDR_WORDS)] if lens.size else \
        np.zeros((0, HDR_WORDS), _U64)
    w4 = hdr[:, 4]
    n = (w4 & np.uint64(0xFFFFFFFF)).astype(np.int64) // 8
    nfp = ((w4 >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64)
    nfix = ((w4 >> np.uint64(48)) & np.uint64(0xFF)).astype(np.int64)
    flags = (w4 >> np.uint64(56)).astype(np.int64)
    body_len = hdr[:, 6].astype(np.int64)
    has_copy = (flags & FLAG_COPY) != 0
    body = wstart + HDR_WORDS + nfp + 2 * nfix
    nb = ngroups(n)
    good = ((flags & FLAG_SKELETON) != 0) & (n > 0) & (n <= MAX_BUDGET // 8) & \
        (body_len % 8 == 0) & (HDR_WORDS * 8 + nfp * 8 + nfix * 16 + body_len == lens) & \
        (body_len // 8 >= NUM_REGS + nb + np.where(has_copy, n, 0))
    nb = np.where(good, nb, 0)
    bstart = body + NUM_REGS
    bm = words[_ragged(bstart, nb)]
    row_bm = np.repeat(np.arange(n.size), nb)
    nkept = np.bincount(row_bm, weights=np.bitwise_count(bm), minlength=n.size).astype(
        np.int64)
    good &= body_len // 8 == NUM_REGS + nb + nkept + np.where(has_copy, n, 0)
    bad = int((~ok).sum() + (~good).sum())
    keep = np.flatnonzero(good)
    hdr, body, n, nfp, nfix, flags, nb, nkept, wstart, has_copy = (
        v[keep] for v in (hdr, body, n, nfp, nfix, flags, nb, nkept, wstart, has_copy))
    rows = keep.size
    regs_raw = words[body[:, None] + np.arange(NUM_REGS)] if rows else \
        np.zeros((0, NUM_REGS), _U64)
    reg_kept = (hdr[:, 5][:, None] >> np.arange(NUM_REGS, dtype=np.uint64)) & np.uint64(1)
    regs = regs_raw * reg_kept
    pay_off = _offsets(nb + nkept)
    payload_words = words[_ragged(body + NUM_REGS, nb + nkept)]
    sk = rebuild(payload_words, pay_off, n)
    fp_off = _offsets(nfp)
    fp_vals = words[_ragged(wstart + HDR_WORDS, nfp)]
    cut = (flags & FLAG_CUT) != 0
    got = hash_rows(sk.flat, n, regs, hdr[:, 3], cut, fp_off, fp_vals)
    fine = sk.good & (got == hdr[:, 0])
    mismatched = hdr[:, 0][~fine].tolist()
    fix_off = _offsets(nfix)
    fix_vals = words[_ragged(wstart + HDR_WORDS + nfp, 2 * nfix)].reshape(-1, 2)
    pidtid = hdr[:, 2]
    pid = (pidtid & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    tid = (pidtid >> np.uint64(32)).astype(np.uint32)

    def take(sel: np.ndarray, offs: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.diff(offs)[sel]
        return vals[_ragged(offs[:-1][sel], lengths)], _offsets(lengths)

    new = fine & ((flags & FLAG_NEW) != 0)
    s = np.flatnonzero(new)
    stacks = skeleton_batch(
        hash=hdr[s, 0], ts=hdr[s, 1], pid=pid[s], tid=tid[s], sp=hdr[s, 3], nwords=n[s],
        cut=cut[s], regs=regs[s], payload=take(s, pay_off, payload_words),
        fp=take(s, fp_off, fp_vals), fixups=take(s, fix_off, fix_vals))
    copy_batch = None
    if copies:
        c = np.flatnonzero(fine & has_copy)
        cstart = body + NUM_REGS + nb + nkept
        raw = words[_ragged(cstart[c], n[c])]
        fpv, fpo = take(c, fp_off, fp_vals)
        copy_batch = pa.RecordBatch.from_pydict({
            "hash": pa.array(hdr[c, 0]), "pid": pa.array(pid[c]), "tid": pa.array(tid[c]),
            "ts": pa.array(hdr[c, 1]), "sp": pa.array(hdr[c, 3]),
            "copy_len": pa.array((n[c] * 8).astype(np.uint32)), "truncated": pa.array(cut[c]),
            "regs": pa.FixedSizeListArray.from_arrays(pa.array(regs_raw[c].ravel()), NUM_REGS),
            "stack": _binary(raw, _offsets(n[c])),
            "fp_chain": _list(fpv, fpo, pa.uint64()),
        }, schema=STACK_COPIES)
    return RingBatches(stacks, copy_batch, bad, mismatched)
