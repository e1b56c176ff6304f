"""Stack records as bpf/stacks.h writes them, built in Python for the tests: the skeleton
hash written out plainly one word at a time, ring records, plausible stack copies."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memtrack.schema import NUM_REGS
from memtrack.schema.stackrecord import (
    CALLEE_SAVED,
    FLAG_COPY,
    FLAG_CUT,
    FLAG_NEW,
    FLAG_SKELETON,
    FNV_OFFSET,
    FNV_PRIME,
    GROUP_WORDS,
    REGION_BYTES,
    REGION_SHIFT,
)

M64 = (1 << 64) - 1
SP0 = 0x7FFD_0000_1000
CODE = 0x5555_5555_0000  # a kept code region in these tests
Kept = Callable[[int], bool]


def regions_kept(*starts: int) -> Kept:
    """A kept-region test: the 64 KiB regions holding these addresses (and their
    256 GiB aliases, as the kernel's byte map has them)."""
    marked = {(a >> REGION_SHIFT) & (REGION_BYTES - 1) for a in starts}
    return lambda v: ((v >> REGION_SHIFT) & (REGION_BYTES - 1)) in marked


def ref_hash(words: list[int], regs: list[int], sp: int, kept: Kept, *, cut: bool = False,
             fp: tuple[int, ...] = ()) -> int:
    """The skeleton hash written out plainly, one word at a time."""
    padded = words + [0] * (-len(words) % GROUP_WORDS)
    lanes = [FNV_OFFSET ^ lane for lane in range(2)]
    for i, w in enumerate(padded):
        lanes[i % 2] = ((lanes[i % 2] ^ (w if kept(w) else 0)) * FNV_PRIME) & M64
    h = FNV_OFFSET
    callee = [regs[r] for r in CALLEE_SAVED]
    for x in lanes + [r if kept(r) else 0 for r in callee] + [sp, len(words) * 8 | cut << 32]:
        h = ((h ^ x) * FNV_PRIME) & M64
    if cut:
        for x in [*fp, len(fp)]:
            h = ((h ^ x) * FNV_PRIME) & M64
    return h or 1


def ring_record(words: np.ndarray, sp: int, regs: np.ndarray, kept: Kept, *, tid: int = 7,
                pid: int = 7, cut: bool = False, fp: tuple[int, ...] = (),
                fixups: tuple[tuple[int, int], ...] = (), ts: int = 1, new: bool = True,
                copy: bool = False, hash: int | None = None) -> bytes:
    """A ring record as bpf/stacks.h writes it."""
    n = words.size
    padded = np.zeros(-(-n // GROUP_WORDS) * GROUP_WORDS, dtype=np.uint64)
    padded[:n] = words
    flags = np.array([kept(int(w)) for w in padded], dtype=bool)
    bitmap = np.packbits(flags.reshape(-1, GROUP_WORDS), axis=1, bitorder="little").view(
        np.uint64).ravel()
    body = [*regs.tolist(), *bitmap.tolist(), *padded[flags].tolist()]
    if copy:
        body += words.tolist()
    reg_kept = sum(1 << r for r in CALLEE_SAVED if kept(int(regs[r])))
    h = hash if hash is not None else ref_hash(words.tolist(), regs.tolist(), sp, kept,
                                               cut=cut, fp=fp)
    f = FLAG_SKELETON | (FLAG_CUT if cut else 0) | (FLAG_NEW if new else 0) | \
        (FLAG_COPY if copy else 0)
    hdr = [h, ts, pid | tid << 32, sp, n * 8 | len(fp) << 32 | len(fixups) << 48 | f << 56,
           reg_kept, len(body) * 8]
    extra = [v for pair in fixups for v in pair]
    return np.array(hdr + list(fp) + extra + body, dtype=np.uint64).tobytes()


def stack_words(rng: np.random.Generator, n: int, sp: int) -> np.ndarray:
    """A plausible copy: locals, return addresses into CODE, pointers into the stack."""
    w = rng.integers(0, 2**48, size=n, dtype=np.uint64)
    kind = rng.random(n)
    w[kind < 0.1] = np.uint64(CODE) + rng.integers(0, 0x8000, size=int((kind < 0.1).sum()),
                                                  dtype=np.uint64)
    stack = (kind >= 0.1) & (kind < 0.2)
    w[stack] = np.uint64(sp) + rng.integers(0, 8 * n, size=int(stack.sum()), dtype=np.uint64)
    return w


def regs_of(rng: np.random.Generator, sp: int) -> np.ndarray:
    regs = rng.integers(0, 2**48, size=NUM_REGS, dtype=np.uint64)
    regs[7] = sp
    regs[16] = CODE + 0x10
    return regs
