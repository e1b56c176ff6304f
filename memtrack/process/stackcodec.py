"""Stack records: the kernel's hash, record layout and XOR-delta format, in numpy.

The kernel side is memtrack/bpf/stacks.h; both must agree word for word.

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

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memtrack.schema import NUM_REGS, STACKS, StackEncoding

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
LANES = 4
GROUP_WORDS = 64
HDR_WORDS = 7
FLAG_TRUNCATED = 1
FLAG_DELTA = 2
MAX_BUDGET = 32768
MIN_BUDGET = 512

_U64 = np.dtype("<u8")
_BIT17 = np.arange(NUM_REGS, dtype=np.uint64)
_BIT64 = np.arange(64, dtype=np.uint64)


class StackFormatError(ValueError):
    """A delta body that does not parse against its record."""


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
    w = np.frombuffer(data, dtype=_U64)
    return int(stack_hash(w[None, :], np.array([w.size]))[0])


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


def _bits(mask: int, width: np.ndarray) -> np.ndarray:
    return np.flatnonzero((np.uint64(mask) >> width) & np.uint64(1))


def decode_delta(body: bytes | np.ndarray, sp: int, nwords: int,
                 ref: StackRef | None) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild (copy words, registers) of a delta body against `ref` (None: keyframe)."""
    a = np.frombuffer(body, dtype=_U64) if isinstance(body, bytes | bytearray | memoryview) \
        else np.asarray(body, dtype=_U64)
    if a.size < 2:
        raise StackFormatError(f"delta body of {a.size * 8} bytes is too short")
    rbits = _bits(int(a[0]), _BIT17)
    if int(a[0]) >> NUM_REGS:
        raise StackFormatError("register mask has bits beyond the 17 registers")
    p = 1 + rbits.size
    if a.size < p + 1:
        raise StackFormatError("delta body ends inside its registers")
    regs = np.zeros(NUM_REGS, dtype=np.uint64)
    regs[rbits] = a[1:p]
    groups = _bits(int(a[p]), _BIT64)
    ngroups = -(-nwords // GROUP_WORDS)
    if groups.size and groups[-1] >= ngroups:
        raise StackFormatError(f"group {groups[-1]} is beyond the copy's {ngroups} groups")
    p += 1
    bitmaps = a[p:p + groups.size]
    if bitmaps.size != groups.size:
        raise StackFormatError("delta body ends inside its bitmaps")
    p += groups.size
    nz = np.unpackbits(bitmaps.view(np.uint8), bitorder="little").reshape(groups.size, 64)
    gi, wi = np.nonzero(nz)
    idx = groups[gi] * GROUP_WORDS + wi
    vals = a[p:]
    if vals.size != idx.size:
        raise StackFormatError(f"{vals.size} delta words for {idx.size} bitmap bits")
    if idx.size and idx[-1] >= nwords:
        raise StackFormatError(f"delta word {idx[-1]} is beyond the copy's {nwords} words")
    words = _aligned_ref(ref, sp, nwords)
    words[idx] ^= vals
    if ref is not None:
        regs ^= ref.regs
    return words, regs


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + lengths[i])."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    offs = np.repeat(starts.astype(np.int64) - (ends - lengths), lengths)
    return np.arange(total, dtype=np.int64) + offs


def _list_offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def records_to_batch(records: list[bytes]) -> tuple[pa.RecordBatch, int]:
    """Ring records as one STACKS batch, and how many malformed records were dropped."""
    lens = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
    ok = (lens >= HDR_WORDS * 8) & (lens % 8 == 0)
    blob = b"".join(r for r, good in zip(records, ok.tolist(), strict=True) if good)
    lens = lens[ok]
    words = np.frombuffer(blob, dtype=_U64)
    wlen = lens // 8
    wstart = np.zeros(lens.size, dtype=np.int64)
    np.cumsum(wlen[:-1], out=wstart[1:])
    hdr = words[wstart[:, None] + np.arange(HDR_WORDS)] if lens.size else \
        np.zeros((0, HDR_WORDS), _U64)
    w5 = hdr[:, 5]
    copy_len = (w5 & np.uint64(0xFFFFFFFF)).astype(np.int64)
    nfp = ((w5 >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64)
    nfix = ((w5 >> np.uint64(48)) & np.uint64(0xFF)).astype(np.int64)
    flags = (w5 >> np.uint64(56)).astype(np.int64)
    body_len = (hdr[:, 6] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    delta = (flags & FLAG_DELTA) != 0
    raw_body = NUM_REGS * 8 + copy_len
    good = (
        (HDR_WORDS * 8 + nfp * 8 + nfix * 16 + body_len == lens)
        & (body_len % 8 == 0) & (copy_len % 8 == 0) & (copy_len > 0)
        & (copy_len <= MAX_BUDGET) & (delta | (body_len == raw_body))
    )
    bad = int((~ok).sum() + (~good).sum())
    if not good.all():
        keep = np.flatnonzero(good)
        hdr, wstart, copy_len, nfp, nfix, flags, body_len, delta = (
            v[keep] for v in (hdr, wstart, copy_len, nfp, nfix, flags, body_len, delta))
    n = hdr.shape[0]
    fp_vals = words[_ragged(wstart + HDR_WORDS, nfp)]
    fix_vals = words[_ragged(wstart + HDR_WORDS + nfp, 2 * nfix)].reshape(-1, 2)
    body_start = wstart + HDR_WORDS + nfp + 2 * nfix
    regs_skip = np.where(delta, 0, NUM_REGS)
    payload_words = body_len // 8 - regs_skip
    payload = words[_ragged(body_start + regs_skip, payload_words)]
    raw_idx = np.flatnonzero(~delta)
    regs_flat = np.zeros((n, NUM_REGS), dtype=np.uint64)
    if raw_idx.size:
        regs_flat[raw_idx] = words[body_start[raw_idx, None] + np.arange(NUM_REGS)]
    regs = pa.FixedSizeListArray.from_arrays(
        pa.array(regs_flat.ravel(), pa.uint64()), NUM_REGS, mask=pa.array(delta))
    payload_arr = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(_list_offsets(payload_words * 8)),
                         pa.py_buffer(payload.tobytes())])
    fp_chain = pa.ListArray.from_arrays(pa.array(_list_offsets(nfp)),
                                        pa.array(fp_vals, pa.uint64()))
    fix_struct = pa.StructArray.from_arrays(
        [pa.array(fix_vals[:, 0], pa.uint64()), pa.array(fix_vals[:, 1], pa.uint64())],
        names=["slot", "value"])
    fixups = pa.ListArray.from_arrays(pa.array(_list_offsets(nfix)), fix_struct)
    pidtid = hdr[:, 3]
    cols = {
        "hash": pa.array(hdr[:, 0]),
        "ref_hash": pa.array(hdr[:, 1]),
        "ts": pa.array(hdr[:, 2]),
        "pid": pa.array((pidtid & np.uint64(0xFFFFFFFF)).astype(np.uint32)),
        "tid": pa.array((pidtid >> np.uint64(32)).astype(np.uint32)),
        "sp": pa.array(hdr[:, 4]),
        "copy_len": pa.array(copy_len.astype(np.uint32)),
        "truncated": pa.array((flags & FLAG_TRUNCATED) != 0),
        "encoding": pa.array(np.where(delta, StackEncoding.DELTA, StackEncoding.RAW)
                             .astype(np.uint8)),
        "regs": regs,
        "payload": payload_arr,
        "fp_chain": fp_chain,
        "ret_fixups": fixups,
    }
    batch = pa.RecordBatch.from_arrays([cols[f.name] for f in STACKS], schema=STACKS)
    return batch, bad
