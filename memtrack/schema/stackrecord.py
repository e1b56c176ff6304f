"""Stack records: the kernel's stack hash, the ring record layout and the delta body
format. The kernel side is memtrack/bpf/stacks.h; both must agree word for word.
Capture parses ring records into stacks.arrow rows (memtrack.capture.stackring),
process rebuilds the copies from them (memtrack.process.decode).

Hash: FNV-1a 64 over the copy's 8-byte little-endian words, word i into lane i % 4
(lane l seeded FNV_OFFSET ^ l, each step `h = (h ^ w) * FNV_PRIME`), then the four
lanes folded in order into FNV_OFFSET the same way, then the copy length in bytes.
0 means "no stack": a result of 0 becomes 1.

Ring record (u64 words): hash, ref_hash, ts, pid | tid << 32, sp,
copy_len | fp_count << 32 | nfix << 48 | flags << 56, body_len; then fp_count
frame-pointer return addresses, nfix (slot, value) pairs, and the body.

Body of a raw record: the 17 registers, then the copy. Body of a delta record (what
`stacks.payload` holds for encoding DELTA): reg_mask, the nonzero words of regs ^ ref
regs, group_mask (bit g: 512 B group g of the copy has a nonzero delta word), one word
bitmap per present group, then the nonzero words of copy ^ reference in order. Word i of
the copy pairs with reference word i + (sp - ref_sp) / 8, zero outside the reference. A
keyframe (ref_hash 0) is the delta against nothing (all zero).
"""

from __future__ import annotations

import numpy as np

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
LANES = 4
GROUP_WORDS = 64  # words per 512 B group of a delta body
HDR_WORDS = 7  # words of a ring record's header
FLAG_TRUNCATED = 1  # the budget cut the copy before the stack's end
FLAG_DELTA = 2
MAX_BUDGET = 32768  # bytes of stack copied per allocation, at most
MIN_BUDGET = 512  # and at least; the budget is a multiple of it


def stack_hash(words: np.ndarray, nwords: np.ndarray) -> np.ndarray:
    """Hashes of many copies at once: row r of `words` (n x W uint64) holds nwords[r] words.

    The lanes are sequential within a copy, so the loop runs over word columns (4 at a
    time, one per lane) and each step updates every row at once; columns every row has
    need no masking."""
    words = np.asarray(words, dtype=np.uint64)
    if words.ndim != 2:
        raise ValueError("words must be a 2-D array (one copy per row)")
    n = np.asarray(nwords, dtype=np.int64)
    rows, width = words.shape
    width4 = -(-width // LANES) * LANES
    cols = np.zeros((width4, rows), dtype=np.uint64)  # column-major: one step = 4 rows
    cols[:width] = words.T
    lanes = np.empty((LANES, rows), dtype=np.uint64)
    lanes[:] = (np.uint64(FNV_OFFSET) ^ np.arange(LANES, dtype=np.uint64))[:, None]
    prime = np.uint64(FNV_PRIME)
    full = (int(n.min()) if rows else 0) // LANES * LANES
    lane_idx = np.arange(LANES)[:, None]
    with np.errstate(over="ignore"):
        for c in range(0, full, LANES):
            lanes ^= cols[c:c + LANES]
            lanes *= prime
        for c in range(full, width4, LANES):
            live = (c + lane_idx) < n[None, :]
            if not live.any():
                break
            np.copyto(lanes, (lanes ^ cols[c:c + LANES]) * prime, where=live)
        h = np.full(rows, FNV_OFFSET, dtype=np.uint64)
        for lane in range(LANES):
            h = (h ^ lanes[lane]) * prime
        h = (h ^ (n.astype(np.uint64) * np.uint64(8))) * prime
    h[h == 0] = 1
    return h


def hash_bytes(data: bytes) -> int:
    """The stack hash of one copy (a multiple of 8 bytes)."""
    if len(data) % 8:
        raise ValueError(f"a stack copy is whole words; got {len(data)} bytes")
    w = np.frombuffer(data, dtype="<u8")
    return int(stack_hash(w[None, :], np.array([w.size]))[0])
