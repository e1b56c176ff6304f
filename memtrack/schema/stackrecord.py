"""The stack-record format (part of the artifact contract): the kernel's skeleton hash
and record layouts, in numpy. capture/stackring.py parses ring records with it, and
process/decode.py rebuilds and verifies skeletons.

The kernel side is memtrack/bpf/stacks.h; both must agree word for word.

A stack record holds the skeleton of a stack copy: the words (and registers) whose value
lies in a kept region of the address space (executable code, thread stacks), every other
word read as 0. Its hash (FNV-1a steps `h = (h ^ x) * FNV_PRIME`): the canonical copy,
zero-padded to whole groups of GROUP_WORDS words, word i into lane i % 2 (lane l seeded
FNV_OFFSET ^ l); the lanes folded in order into FNV_OFFSET; then the canonical
registers of CALLEE_SAVED in order, sp (0 for a Python cut), copy_len | cut << 32, and
for a cut copy each frame-pointer entry then their count. 0 means "no stack": a result
of 0 becomes 1.

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

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
LANES = 2
GROUP_WORDS = 64
HDR_WORDS = 7
FLAG_CUT = 1
FLAG_SKELETON = 4
FLAG_NEW = 8
FLAG_COPY = 16
FLAG_PYTHON_CUT = 32  # a Python cut: the hash takes sp as 0 (memtrack.schema STACKS)
MAX_BUDGET = 32768
MIN_BUDGET = 512
REGION_SHIFT = 16  # kept regions are 64 KiB
REGION_BYTES = 1 << 22  # one byte per region, addresses' bits 16..37
# The registers a skeleton may keep (DWARF numbers): rbx, rbp, rsp, r12-r15, rip; the
# others are dead at an allocator's entry.
CALLEE_SAVED = (3, 6, 7, 12, 13, 14, 15, 16)

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


def ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + lengths[i])."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    offs = np.repeat(starts.astype(np.int64) - (ends - lengths), lengths)
    return np.arange(total, dtype=np.int64) + offs


def offsets_of(lengths: np.ndarray) -> np.ndarray:
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
    bm = payload_words[ragged(start, nb)]
    ones = np.bitwise_count(bm).astype(np.int64)
    row_of_bm = np.repeat(np.arange(k), nb)
    kept = np.bincount(row_of_bm, weights=ones, minlength=k).astype(np.int64)
    good &= plen == nb + kept
    sel = good[row_of_bm]
    bits = np.unpackbits(bm[sel].view(np.uint8), bitorder="little").reshape(-1, GROUP_WORDS)
    bi, bj = np.nonzero(bits)
    g = ragged(np.zeros(k, np.int64), nb)[sel]  # each bitmap word's group within its row
    w_row = row_of_bm[sel][bi]
    w_pos = g[bi] * GROUP_WORDS + bj
    vals = payload_words[ragged(start + nb, np.where(good, kept, 0))]
    inside = w_pos < nwords[w_row]
    # a bit beyond the copy (its zero padding) must stand for a 0 word
    good[np.unique(w_row[~inside & (vals != 0)])] = False
    ok = inside & good[w_row]
    flat = np.zeros(int(nwords.sum()), dtype=np.uint64)
    flat[offsets_of(nwords)[:-1][w_row[ok]] + w_pos[ok]] = vals[ok]
    return Skeletons(flat, nwords, good, w_row[ok], w_pos[ok], vals[ok])
