"""Stack records as bpf/stacks.h writes them into its ring, built in Python: the input
of the codec, decode and capture-part tests."""

from __future__ import annotations

import numpy as np

from memtrack.process.stackcodec import (
    FLAG_DELTA,
    FLAG_TRUNCATED,
    StackRef,
    encode_delta,
    hash_bytes,
)
from memtrack.schema import NUM_REGS

SP0 = 0x7FFD_0000_1000


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
