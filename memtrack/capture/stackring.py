"""The stack ring's variable-size records (memtrack.schema.stackrecord) as stacks.arrow
(and stack_copies.arrow) batches, parsed for many records at once with numpy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memtrack.capture.ringbuf import Records
from memtrack.schema import NUM_REGS, STACK_COPIES, STACKS
from memtrack.schema.stackrecord import (
    FLAG_COPY,
    FLAG_CUT,
    FLAG_NEW,
    FLAG_PYTHON_CUT,
    FLAG_SKELETON,
    HDR_WORDS,
    MAX_BUDGET,
    ngroups,
    offsets_of,
    ragged,
)

_U64 = np.dtype("<u8")


def _list(values: np.ndarray, offsets: np.ndarray, typ: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, typ))


def _binary(data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """Words laid end to end as a binary array (offsets in words)."""
    return pa.Array.from_buffers(pa.binary(), offsets.size - 1, [
        None, pa.py_buffer((offsets * 8).astype(np.int32)),
        pa.py_buffer(np.ascontiguousarray(data, dtype=_U64))])  # no copy: Arrow holds it


def skeleton_batch(*, hash: np.ndarray, ts: np.ndarray, pid: np.ndarray, tid: np.ndarray,
                   sp: np.ndarray, nwords: np.ndarray, cut: np.ndarray, regs: np.ndarray,
                   payload: tuple[np.ndarray, np.ndarray], fp: tuple[np.ndarray, np.ndarray],
                   fixups: tuple[np.ndarray, np.ndarray],
                   python_cut: np.ndarray) -> pa.RecordBatch:
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
        "python_cut": pa.array(np.asarray(python_cut, dtype=bool)),
    }
    return pa.RecordBatch.from_arrays([cols[f.name] for f in STACKS], schema=STACKS)


@dataclass
class RingBatches:
    stacks: pa.RecordBatch  # the records new to the kernel's dedupe set
    copies: pa.RecordBatch | None  # every record's raw copy (records with FLAG_COPY)
    malformed: int  # records that do not parse


def records_to_batches(records: Records | Sequence[bytes], *, copies: bool = False
                       ) -> RingBatches:
    """Ring records as a STACKS batch (and a STACK_COPIES batch). Their layout is
    checked, not their hashes: `process` verifies those when it decodes (capture keeps
    its drain loop short). The words are read where the ring put them (`Records`), with
    no copy per record."""
    if not isinstance(records, Records):
        records = Records.of(records)
    lens = records.lengths
    ok = (lens >= HDR_WORDS * 8) & (lens % 8 == 0) & (records.starts % 8 == 0)
    words = np.frombuffer(records.blob, dtype=_U64, count=len(records.blob) // 8)
    wstart = records.starts[ok] // 8
    lens = lens[ok]
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
    bm = words[ragged(bstart, nb)]
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
    cut = (flags & FLAG_CUT) != 0
    pycut = (flags & FLAG_PYTHON_CUT) != 0
    pidtid = hdr[:, 2]
    pid = (pidtid & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    tid = (pidtid >> np.uint64(32)).astype(np.uint32)

    def take(sel: np.ndarray, starts: np.ndarray, lengths: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
        """The rows `sel`'s runs of words (each from its start in the records), end to
        end, and their offsets: one gather, straight from the ring's words."""
        return words[ragged(starts[sel], lengths[sel])], offsets_of(lengths[sel])

    def fixups(sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pairs, offs = take(sel, wstart + HDR_WORDS + nfp, 2 * nfix)
        return pairs.reshape(-1, 2), offs // 2

    s = np.flatnonzero((flags & FLAG_NEW) != 0)
    stacks = skeleton_batch(
        hash=hdr[s, 0], ts=hdr[s, 1], pid=pid[s], tid=tid[s], sp=hdr[s, 3], nwords=n[s],
        cut=cut[s], regs=regs[s], payload=take(s, body + NUM_REGS, nb + nkept),
        fp=take(s, wstart + HDR_WORDS, nfp), fixups=fixups(s), python_cut=pycut[s])
    copy_batch = None
    if copies:
        c = np.flatnonzero(has_copy)
        raw, raw_off = take(c, body + NUM_REGS + nb + nkept, n)
        fpv, fpo = take(c, wstart + HDR_WORDS, nfp)
        copy_batch = pa.RecordBatch.from_pydict({
            "hash": pa.array(hdr[c, 0]), "pid": pa.array(pid[c]), "tid": pa.array(tid[c]),
            "ts": pa.array(hdr[c, 1]), "sp": pa.array(hdr[c, 3]),
            "copy_len": pa.array((n[c] * 8).astype(np.uint32)), "truncated": pa.array(cut[c]),
            "regs": pa.FixedSizeListArray.from_arrays(pa.array(regs_raw[c].ravel()), NUM_REGS),
            "stack": _binary(raw, raw_off),
            "fp_chain": _list(fpv, fpo, pa.uint64()),
            "python_cut": pa.array(pycut[c]),
        }, schema=STACK_COPIES)
    return RingBatches(stacks, copy_batch, bad)
