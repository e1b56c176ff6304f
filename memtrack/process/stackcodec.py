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


class StackFormatError(ValueError):
    """A stack record that does not parse."""


def _fnv(h: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (h ^ x) * np.uint64(FNV_PRIME)


def _powers(n: int) -> np.ndarray:
    """FNV_PRIME ** k mod 2^64 for k in 0..n: k hash steps over zero words."""
    out = np.ones(n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(1, n + 1):
            out[k] = out[k - 1] * np.uint64(FNV_PRIME)
    return out


_POW = _powers(MAX_BUDGET // 8 // LANES)


def skeleton_hash(nwords: np.ndarray, row: np.ndarray, pos: np.ndarray, vals: np.ndarray,
                  regs: np.ndarray, sp: np.ndarray, cut: np.ndarray, fp_offsets: np.ndarray,
                  fp_values: np.ndarray) -> np.ndarray:
    """Hashes of many skeletons at once. Skeleton r has nwords[r] words; its kept words are
    the entries with row == r (pos: word index, increasing within a row; vals: value);
    `regs` its canonical registers; fp_values[fp_offsets[r]:fp_offsets[r + 1]] its
    frame-pointer chain (used where cut).

    A zero word's step is a multiplication by FNV_PRIME, so each lane jumps from kept
    word to kept word by a power of it: the work is per kept word, not per word."""
    n = np.asarray(nwords, dtype=np.int64)
    rows = n.size
    steps = -(-n // GROUP_WORDS) * GROUP_WORDS // LANES  # words per lane, padding included
    row = np.asarray(row, dtype=np.int64)
    lane = (pos & (LANES - 1)).astype(np.int64)
    group = row * LANES + lane
    step = (pos // LANES).astype(np.int64)
    vals = np.asarray(vals, np.uint64)
    # each entry's rank among its lane's kept words (rows, then positions, are in order)
    counts = np.bincount(group, minlength=rows * LANES)
    before = np.zeros(group.size, dtype=np.int64)
    for ln in range(LANES):
        mine = lane == ln
        seen = np.cumsum(mine) - mine  # this lane's entries before each entry
        first = np.concatenate([[0], np.cumsum(counts[ln::LANES])])[:-1]  # per row
        before[mine] = (seen - first[row])[mine]
    rank = before
    h_lane = np.tile(np.uint64(FNV_OFFSET) ^ np.arange(LANES, dtype=np.uint64), rows)
    nxt = np.zeros(rows * LANES, dtype=np.int64)  # the lane's next step
    prime = np.uint64(FNV_PRIME)
    with np.errstate(over="ignore"):
        by_rank = np.argsort(rank.astype(np.uint16), kind="stable")  # a radix sort
        bounds = np.searchsorted(rank[by_rank], np.arange(int(rank.max(initial=-1)) + 2))
        for k in range(bounds.size - 1):
            sel = by_rank[bounds[k]:bounds[k + 1]]
            g, st = group[sel], step[sel]
            h_lane[g] = ((h_lane[g] * _POW[st - nxt[g]]) ^ vals[sel]) * prime
            nxt[g] = st + 1
        h_lane *= _POW[np.repeat(steps, LANES) - nxt]
        h = np.full(rows, FNV_OFFSET, dtype=np.uint64)
        for ln in range(LANES):
            h = _fnv(h, h_lane[ln::LANES])
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
                fv = fp_values[idx] if fp_values.size else np.zeros(rows, np.uint64)
                np.copyto(h, _fnv(h, fv), where=live)
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
    """Skeletons rebuilt as canonical copies laid end to end (nwords[i] words each), and
    their kept words (row, position, value; positions increasing within a row)."""

    flat: np.ndarray  # uint64
    nwords: np.ndarray  # int64
    good: np.ndarray  # bool: the payload parsed
    row: np.ndarray  # int64
    pos: np.ndarray  # int64
    vals: np.ndarray  # uint64


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
    sel = good[row_of_bm]
    bits = np.unpackbits(bm[sel].view(np.uint8), bitorder="little").reshape(-1, GROUP_WORDS)
    bi, bj = np.nonzero(bits)
    g = _ragged(np.zeros(k, np.int64), nb)[sel]  # each bitmap word's group within its row
    w_row = row_of_bm[sel][bi]
    w_pos = g[bi] * GROUP_WORDS + bj
    vals = payload_words[_ragged(start + nb, np.where(good, kept, 0))]
    inside = w_pos < nwords[w_row]
    # a bit beyond the copy (its zero padding) must stand for a 0 word
    good[np.unique(w_row[~inside & (vals != 0)])] = False
    ok = inside & good[w_row]
    flat = np.zeros(int(nwords.sum()), dtype=np.uint64)
    flat[_offsets(nwords)[:-1][w_row[ok]] + w_pos[ok]] = vals[ok]
    return Skeletons(flat, nwords, good, w_row[ok], w_pos[ok], vals[ok])


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


def records_to_batches(records: list[bytes], *, copies: bool = False) -> RingBatches:
    """Ring records as a STACKS batch (and a STACK_COPIES batch). Their layout is
    checked, not their hashes: `process` verifies those when it decodes (capture keeps
    its drain loop short)."""
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
    fp_off = _offsets(nfp)
    fp_vals = words[_ragged(wstart + HDR_WORDS, nfp)]
    cut = (flags & FLAG_CUT) != 0
    fix_off = _offsets(nfix)
    fix_vals = words[_ragged(wstart + HDR_WORDS + nfp, 2 * nfix)].reshape(-1, 2)
    pidtid = hdr[:, 2]
    pid = (pidtid & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    tid = (pidtid >> np.uint64(32)).astype(np.uint32)

    def take(sel: np.ndarray, offs: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.diff(offs)[sel]
        return vals[_ragged(offs[:-1][sel], lengths)], _offsets(lengths)

    s = np.flatnonzero((flags & FLAG_NEW) != 0)
    stacks = skeleton_batch(
        hash=hdr[s, 0], ts=hdr[s, 1], pid=pid[s], tid=tid[s], sp=hdr[s, 3], nwords=n[s],
        cut=cut[s], regs=regs[s], payload=take(s, pay_off, payload_words),
        fp=take(s, fp_off, fp_vals), fixups=take(s, fix_off, fix_vals))
    copy_batch = None
    if copies:
        c = np.flatnonzero(has_copy)
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
    return RingBatches(stacks, copy_batch, bad)
