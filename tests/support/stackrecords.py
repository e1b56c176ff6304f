"""Stack records as bpf/stacks.h writes them into its ring, built in Python: the input
of the stack-record, decode and capture-part tests. `encode_delta` is the kernel's delta
encoder written out plainly, one copy at a time (format: memtrack.schema.stackrecord).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memtrack.schema import NUM_REGS
from memtrack.schema.stackrecord import FLAG_DELTA, FLAG_TRUNCATED, GROUP_WORDS, hash_bytes

_U64 = np.dtype("<u8")
_BIT17 = np.arange(NUM_REGS, dtype=np.uint64)
_BIT64 = np.arange(64, dtype=np.uint64)

SP0 = 0x7FFD_0000_1000


@dataclass
class StackRef:
    """A thread's last emitted copy: what the next delta record is encoded against."""

    hash: int
    sp: int
    words: np.ndarray  # uint64
    regs: np.ndarray  # uint64[17]


def _aligned_ref(ref: StackRef | None, sp: int, nwords: int) -> np.ndarray:
    """The reference words paired with copy words 0..nwords-1 (zero outside the reference)."""
    out = np.zeros(nwords, dtype=np.uint64)
    if ref is None:
        return out
    diff = sp - ref.sp
    if diff % 8:
        return out
    shift = diff // 8
    lo = max(0, -shift)
    hi = min(nwords, ref.words.size - shift)
    if lo < hi:
        out[lo:hi] = ref.words[lo + shift:hi + shift]
    return out


def encode_delta(words: np.ndarray, sp: int, regs: np.ndarray, ref: StackRef | None) -> bytes:
    """The delta body the kernel writes for this copy against `ref` (None: keyframe)."""
    words = np.asarray(words, dtype=np.uint64)
    regs = np.asarray(regs, dtype=np.uint64)
    rx = regs ^ (ref.regs if ref is not None else np.zeros(NUM_REGS, np.uint64))
    rnz = rx != 0
    reg_mask = int((np.uint64(1) << _BIT17[rnz]).sum())
    x = words ^ _aligned_ref(ref, sp, words.size)
    ngroups = -(-words.size // GROUP_WORDS)
    padded = np.zeros(ngroups * GROUP_WORDS, dtype=np.uint64)
    padded[:words.size] = x
    nz = (padded != 0).reshape(ngroups, GROUP_WORDS)
    bitmaps = np.packbits(nz, axis=1, bitorder="little").view(_U64).ravel()
    present = bitmaps != 0
    group_mask = int((np.uint64(1) << _BIT64[:ngroups][present]).sum())
    parts = [
        np.array([reg_mask], dtype=_U64),
        rx[rnz].astype(_U64),
        np.array([group_mask], dtype=_U64),
        bitmaps[present].astype(_U64),
        padded[padded != 0].astype(_U64),
    ]
    return np.concatenate(parts).tobytes()


def rand_words(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)


def ring_record(words: np.ndarray, sp: int, regs: np.ndarray, *, tid: int = 7, pid: int = 7,
                ref: StackRef | None = None, delta: bool = True, truncated: bool = False,
                fp: tuple[int, ...] = (0x401000, 0x401100),
                fixups: tuple[tuple[int, int], ...] = (), ts: int = 1) -> bytes:
    h = hash_bytes(words.tobytes())
    body = encode_delta(words, sp, regs, ref) if delta else regs.tobytes() + words.tobytes()
    flags = (FLAG_DELTA if delta else 0) | (FLAG_TRUNCATED if truncated else 0)
    hdr = [h, ref.hash if ref is not None else 0, ts, pid | tid << 32, sp,
           words.size * 8 | len(fp) << 32 | len(fixups) << 48 | flags << 56, len(body)]
    extra = [v for pair in fixups for v in pair]
    return np.array(hdr + list(fp) + extra, dtype=np.uint64).tobytes() + body


def chain(rng: np.random.Generator, count: int, *, tid: int = 7, n: int = 512,
          delta: bool = True) -> tuple[list[bytes], list[np.ndarray], list[int]]:
    """A thread's records: sp wandering, a few words changing each time."""
    records, copies, sps = [], [], []
    ref = None
    words = rand_words(rng, n + 64)
    regs = rand_words(rng, NUM_REGS)
    for i in range(count):
        sp = SP0 + 8 * int(rng.integers(0, 64))
        cur = words[(sp - SP0) // 8:(sp - SP0) // 8 + n].copy()
        cur[int(rng.integers(0, n))] ^= np.uint64(i + 1)
        words[(sp - SP0) // 8:(sp - SP0) // 8 + n] = cur
        regs = regs.copy()
        regs[16] = np.uint64(0x401000 + i)
        records.append(ring_record(cur, sp, regs, tid=tid, pid=tid, ref=ref, delta=delta, ts=i))
        copies.append(cur)
        sps.append(sp)
        if delta:
            ref = StackRef(hash_bytes(cur.tobytes()), sp, cur, regs)
    return records, copies, sps
