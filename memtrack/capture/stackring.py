"""The stack ring's variable-size records (memtrack.schema.stackrecord) as stacks.arrow
batches, parsed for many records at once with numpy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from memtrack.schema import NUM_REGS, STACKS, StackEncoding
from memtrack.schema.stackrecord import FLAG_DELTA, FLAG_TRUNCATED, HDR_WORDS, MAX_BUDGET

_U64 = np.dtype("<u8")


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
