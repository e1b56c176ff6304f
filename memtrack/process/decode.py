"""Decode stack records: rebuild each record's stack bytes and registers.

Records of one thread form chains: a delta record is the XOR of its copy against the
thread's previous record (`ref_hash`), a keyframe (`ref_hash == 0`) or a raw record
stands alone. Records are rebuilt in file order per thread, then every rebuilt copy is
hashed (vectorized across records) and compared with the kernel's hash. A record is
kept when its hash matches, its reference was the thread's previous record, and every
record before it back to its keyframe was kept; otherwise it is dropped and counted in
`decode_mismatch`, and the thread recovers at its next keyframe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from memtrack.process.stackcodec import (
    StackFormatError,
    StackRef,
    decode_delta,
    stack_hash,
)
from memtrack.schema import NUM_REGS, StackEncoding
from memtrack.schema.artifact import Artifact

DECODED = pa.schema(
    [
        ("hash", pa.uint64()),
        ("pid", pa.uint32()),
        ("tid", pa.uint32()),
        ("ts", pa.uint64()),
        ("sp", pa.uint64()),
        ("copy_len", pa.uint32()),
        ("truncated", pa.bool_()),
        ("regs", pa.list_(pa.uint64(), NUM_REGS)),
        ("stack", pa.binary()),
        ("fp_chain", pa.list_(pa.uint64())),
    ]
)

_HASH_ROWS = 4096  # records hashed per vectorized pass (bounds the padded matrix)


@dataclass
class DecodedStacks:
    table: pa.Table  # DECODED: one row per record that decoded and verified
    counters: dict[str, int] = field(default_factory=dict)


def decode(artifact: Artifact) -> DecodedStacks:
    """Decode the stacks table of an artifact."""
    return decode_table(artifact.read("stacks", required=False).table)


def _binary_parts(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64, data uint8) of a binary column, without copying the data."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    _, obuf, dbuf = arr.buffers()
    offsets = np.frombuffer(obuf, dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4)
    data = np.frombuffer(dbuf, dtype=np.uint8) if dbuf is not None else np.zeros(0, np.uint8)
    return offsets.astype(np.int64), data


def _hash_rows(flat: np.ndarray, starts: np.ndarray, nwords: np.ndarray) -> np.ndarray:
    """Stack hashes of the copies flat[starts[i]:starts[i] + nwords[i]]."""
    out = np.zeros(starts.size, dtype=np.uint64)
    for lo in range(0, starts.size, _HASH_ROWS):
        s = starts[lo:lo + _HASH_ROWS]
        n = nwords[lo:lo + _HASH_ROWS]
        width = int(n.max()) if n.size else 0
        mat = np.zeros((s.size, width), dtype=np.uint64)
        col = np.arange(width)
        live = col[None, :] < n[:, None]
        mat[live] = flat[(s[:, None] + col[None, :])[live]]
        out[lo:lo + s.size] = stack_hash(mat, n)
    return out


def decode_table(stacks: pa.Table) -> DecodedStacks:
    """Decode a STACKS table (as read from stacks.arrow)."""
    n = stacks.num_rows
    counters = {"stack_records": n, "stack_keyframes": 0, "stack_deltas": 0, "stack_raw": 0,
                "decode_mismatch": 0, "decode_stale_ref": 0, "decode_bad_payload": 0}
    if n == 0:
        return DecodedStacks(DECODED.empty_table(), counters)
    col = {name: stacks.column(name).to_numpy() for name in
           ("hash", "ref_hash", "sp", "copy_len", "tid", "encoding")}
    hashes, ref_hash, sp = col["hash"], col["ref_hash"], col["sp"]
    nwords = (col["copy_len"] // 8).astype(np.int64)
    encoding = col["encoding"]
    raw = encoding == StackEncoding.RAW
    delta = encoding == StackEncoding.DELTA
    counters["stack_raw"] = int(raw.sum())
    counters["stack_keyframes"] = int((delta & (ref_hash == 0)).sum())
    counters["stack_deltas"] = int((delta & (ref_hash != 0)).sum())

    poff, pdata = _binary_parts(stacks.column("payload"))
    regs_col = stacks.column("regs").combine_chunks()
    # .values keeps the slots of null (delta) rows, so row i is values[i * 17:(i + 1) * 17]
    raw_regs = regs_col.values.to_numpy(zero_copy_only=False)[
        regs_col.offset * NUM_REGS:(regs_col.offset + n) * NUM_REGS].reshape(n, NUM_REGS)

    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(nwords[:-1], out=starts[1:])
    flat = np.zeros(int(nwords.sum()), dtype=np.uint64)
    regs = np.zeros((n, NUM_REGS), dtype=np.uint64)
    usable = np.ones(n, dtype=bool)  # reference and payload were sound

    # Raw records: their payload is the copy (vectorized copy of every raw row).
    raw_rows = np.flatnonzero(raw)
    if raw_rows.size:
        plen = poff[raw_rows + 1] - poff[raw_rows]
        fits = plen == nwords[raw_rows] * 8
        usable[raw_rows[~fits]] = False
        counters["decode_bad_payload"] += int((~fits).sum())
        ok_rows = raw_rows[fits]
        src = _ragged_bytes(poff[ok_rows], plen[fits])
        dst = _ragged_bytes(starts[ok_rows] * 8, plen[fits])
        flat.view(np.uint8)[dst] = pdata[src]
        regs[ok_rows] = raw_regs[ok_rows]

    # Delta records, in file order per thread: each needs the one before it.
    tid = col["tid"]
    order = np.argsort(tid, kind="stable")
    prev = np.full(n, -1, dtype=np.int64)
    same = tid[order[1:]] == tid[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    pbytes = pdata.tobytes() if delta.any() else b""
    for r in order[delta[order]].tolist():
        ref = None
        if ref_hash[r]:
            p = int(prev[r])
            if p < 0 or hashes[p] != ref_hash[r]:
                usable[r] = False
                counters["decode_stale_ref"] += 1
                continue
            ref = StackRef(int(hashes[p]), int(sp[p]),
                           flat[starts[p]:starts[p] + nwords[p]], regs[p])
        try:
            words, rg = decode_delta(pbytes[poff[r]:poff[r + 1]], int(sp[r]), int(nwords[r]), ref)
        except StackFormatError:
            usable[r] = False
            counters["decode_bad_payload"] += 1
            continue
        flat[starts[r]:starts[r] + nwords[r]] = words
        regs[r] = rg

    ok = usable & (_hash_rows(flat, starts, nwords) == hashes)
    ok &= raw | delta
    # A delta record is only as good as every record back to its keyframe.
    seq = order
    chain_start = (ref_hash[seq] == 0) | raw[seq]
    chain_start[1:] |= tid[seq[1:]] != tid[seq[:-1]]
    idx = np.arange(n)
    last_start = np.maximum.accumulate(np.where(chain_start, idx, 0))
    last_bad = np.maximum.accumulate(np.where(~ok[seq], idx, -1))
    keep_sorted = last_bad < last_start
    keep = np.zeros(n, dtype=bool)
    keep[seq] = keep_sorted
    counters["decode_mismatch"] = int(n - keep.sum())

    _apply_fixups(stacks, flat, starts, sp, nwords)
    rows = np.flatnonzero(keep)
    out_len = nwords[rows] * 8
    stack_off = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(out_len, out=stack_off[1:])
    stack_data = flat.view(np.uint8)[_ragged_bytes(starts[rows] * 8, out_len)]
    stack_arr = pa.Array.from_buffers(
        pa.binary(), rows.size,
        [None, pa.py_buffer(stack_off.astype(np.int32)), pa.py_buffer(stack_data)])
    take = pa.array(rows)
    table = pa.table({
        "hash": pa.array(hashes[rows]),
        "pid": stacks.column("pid").take(take),
        "tid": stacks.column("tid").take(take),
        "ts": stacks.column("ts").take(take),
        "sp": pa.array(sp[rows]),
        "copy_len": stacks.column("copy_len").take(take),
        "truncated": stacks.column("truncated").take(take),
        "regs": pa.FixedSizeListArray.from_arrays(pa.array(regs[rows].ravel()), NUM_REGS),
        "stack": stack_arr,
        "fp_chain": stacks.column("fp_chain").take(take),
    }, schema=DECODED)
    return DecodedStacks(table, counters)


def _ragged_bytes(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


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
