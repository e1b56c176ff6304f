"""Decode stack records: rebuild each record's skeleton as a canonical stack copy.

A record's payload is its kept bitmap and kept words (memtrack.schema.stackrecord);
decoding lays the kept words at their positions in a copy of zeros, then hashes every
rebuilt copy (vectorized across records) and compares with the kernel's hash. A record
whose payload does not parse (`decode_bad_payload`) or whose skeleton does not hash to
its hash (`decode_mismatch`, counting both) is dropped.

`decode_pieces` rebuilds a bounded number of bytes at a time (the records in file order,
cut into pieces of at most `max_bytes` of copies); records stand alone, so the pieces
decode exactly as the whole table would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.dwarf.cfi import RSP
from memtrack.schema import NUM_REGS, STACKS
from memtrack.schema.artifact import Artifact, ArtifactError
from memtrack.schema.stackrecord import rebuild, skeleton_hash
from memtrack.schema.stages import DECODED_RECORDS


@dataclass
class DecodedRecords:
    table: pa.Table  # DECODED_RECORDS: one row per record that decoded and verified
    counters: dict[str, int] = field(default_factory=dict)
    kept: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # their rows


DEFAULT_MAX_BYTES = 64 << 20  # rebuilt stack bytes per piece (decode_pieces, unwind)


def piece_ends(copy_len: np.ndarray, max_bytes: int, most: int | None = None) -> list[int]:
    """Where consecutive records (their copy lengths) are cut into pieces of at most
    `max_bytes` of rebuilt copies (one record at least) and `most` records: each piece's
    end, the last one len(copy_len)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    ends = np.cumsum(copy_len.astype(np.int64) // 8 * 8)
    out: list[int] = []
    a = 0
    while a < ends.size:
        first = int(ends[a - 1]) if a else 0
        b = max(int(np.searchsorted(ends, first + max_bytes, side="right")), a + 1)
        a = b if most is None else min(b, a + most)
        out.append(a)
    return out


class StackRecords:
    """Stack records (STACKS rows, file order) never held whole: what choosing and
    cutting them needs (`index`: hash, pid, copy_len, truncated; 17 bytes a record) is
    kept, the records themselves are read again, a piece at a time, from `batches` (a
    callable that gives the same record batches each time: an artifact's stacks.arrow
    read again, or a table in memory). A piece's rows are taken out of the batches they
    came in: never one column of more than a piece, whatever the whole adds up to."""

    def __init__(self, batches: Callable[[], Iterable[pa.RecordBatch]],
                 path: Path | None = None) -> None:
        self._batches, self.path = batches, path
        parts: list[pa.Table] = []
        self.payload_bytes = 0
        for b in batches():
            # copied: a column of the batch would hold the batch's buffers
            parts.append(pa.table({n: pa.array(b.column(n).to_numpy(zero_copy_only=False))
                                   for n in INDEX}))
            self.payload_bytes += int(pc.sum(pc.binary_length(b.column("payload"))).as_py()
                                      or 0)
        self.index = pa.concat_tables(parts).combine_chunks() if parts else \
            pa.schema([STACKS.field(n) for n in INDEX]).empty_table()

    @classmethod
    def of(cls, table: pa.Table) -> StackRecords:
        """The records of a STACKS table in memory."""
        return cls(lambda: table.to_batches())

    @property
    def num_rows(self) -> int:
        return self.index.num_rows

    def read(self, rows: np.ndarray, ends: Sequence[int]) -> Iterator[pa.Table]:
        """The records at `rows` (ascending positions in `index`), a piece at a time:
        rows[:ends[0]], rows[ends[0]:ends[1]], ... as STACKS tables, in one pass over
        the batches. A record whose hash is not the index's (the file changed since) is
        an ArtifactError."""
        if not len(ends):
            return
        hashes = self.index.column("hash").to_numpy()
        held: list[pa.RecordBatch] = []
        base = j = piece = 0
        for batch in self._batches():
            upto = int(np.searchsorted(rows, base + batch.num_rows))
            while j < upto:
                stop = min(upto, ends[piece])
                part = batch.take(pa.array(rows[j:stop] - base))
                if not np.array_equal(part.column("hash").to_numpy(), hashes[rows[j:stop]]):
                    raise self._changed()
                held.append(part)
                j = stop
                if j == ends[piece]:
                    yield pa.Table.from_batches(held, schema=STACKS)
                    held, piece = [], piece + 1
            if piece == len(ends):
                return
            base += batch.num_rows
        raise self._changed()

    def _changed(self) -> ArtifactError:
        return ArtifactError(self.path or Path("stacks"),
                             "changed while being processed (its stack records differ)")


INDEX = ("hash", "pid", "copy_len", "truncated")  # StackRecords.index


def decode(artifact: Artifact) -> DecodedRecords:
    """Decode the stacks table of an artifact."""
    return decode_table(artifact.read("stacks", required=False).table)


def decode_pieces(source: Artifact | pa.Table | StackRecords,
                  max_bytes: int = DEFAULT_MAX_BYTES, rows: np.ndarray | None = None
                  ) -> Iterator[DecodedRecords]:
    """Decode an artifact's (or a STACKS table's, or some `rows` of stack records') records
    in pieces of consecutive records whose copies add up to at most `max_bytes` (a piece
    holds one record at least). The pieces' tables, concatenated, are decode_table's
    table and their counters sum to its counters; only one piece's records and rebuilt
    bytes are held at a time. An artifact's records are those process reads
    (memtrack.process.read.ROW_RULES: a copy_len beyond the budget indexed past the
    copy)."""
    from memtrack.process.read import checked

    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    if isinstance(source, Artifact):
        source = checked("stacks", source.read("stacks", required=False).table)[0]
    records = source if isinstance(source, StackRecords) else StackRecords.of(source)
    rows = np.arange(records.num_rows) if rows is None else rows
    if not len(rows):
        yield decode_table(STACKS.empty_table())
        return
    copy_len = records.index.column("copy_len").to_numpy()[rows]
    for piece in records.read(rows, piece_ends(copy_len, max_bytes)):
        out = decode_table(piece)
        del piece
        yield out
        del out  # not held while the next piece is decoded


def _binary_parts(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64, data uint8) of a binary column; one chunk is read without a copy,
    several are joined here (Arrow could not join more than 2 GiB into one binary)."""
    chunks = arr.chunks if isinstance(arr, pa.ChunkedArray) else [arr]
    offs, datas, base = [np.zeros(1, dtype=np.int64)], [], 0
    for c in chunks:
        if len(c) == 0:
            continue
        _, obuf, dbuf = c.buffers()
        o = np.frombuffer(obuf, dtype=np.int32, count=len(c) + 1, offset=c.offset * 4)
        o = o.astype(np.int64)
        d = np.frombuffer(dbuf, dtype=np.uint8)[o[0]:o[-1]] if dbuf is not None else \
            np.zeros(0, np.uint8)
        offs.append(o[1:] - o[0] + base)
        datas.append(d)
        base += int(o[-1] - o[0])
    data = datas[0] if len(datas) == 1 else (np.concatenate(datas) if datas else
                                              np.zeros(0, np.uint8))
    return np.concatenate(offs), data


_CHUNK_BYTES = 1 << 30  # output binary chunks stay well below Arrow's 2 GiB offsets


def _binary_chunks(flat: np.ndarray, lengths: np.ndarray) -> pa.ChunkedArray:
    """The byte strings laid end to end in `flat` (lengths in bytes) as binary chunks."""
    data = flat.view(np.uint8)
    ends = np.cumsum(lengths)
    bounds = [0]
    while bounds[-1] < lengths.size:
        first = int(ends[bounds[-1] - 1]) if bounds[-1] else 0
        nxt = int(np.searchsorted(ends, first + _CHUNK_BYTES, side="right"))
        bounds.append(max(nxt, bounds[-1] + 1))
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        first = int(ends[a - 1]) if a else 0
        off = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(lengths[a:b], out=off[1:])
        chunks.append(pa.Array.from_buffers(
            pa.binary(), b - a, [None, pa.py_buffer(off.astype(np.int32)),
                                 pa.py_buffer(data[first:first + int(off[-1])])]))
    return pa.chunked_array(chunks, pa.binary())


def _payload_words(poff: np.ndarray, pdata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The payloads as one uint64 array and each payload's word offsets. Payloads of a
    length that is not whole words are left out (their offsets give an empty range)."""
    lens = np.diff(poff)
    whole = lens % 8 == 0
    if whole.all() and poff[0] % 8 == 0:
        base = int(poff[0])
        words = pdata[base:int(poff[-1])].view(np.uint64)
        return words, (poff - base) // 8
    keep = np.repeat(whole, lens)
    words = pdata[int(poff[0]):int(poff[-1])][keep].view(np.uint64)
    woff = np.zeros(poff.size, dtype=np.int64)
    np.cumsum(np.where(whole, lens // 8, 0), out=woff[1:])
    return words, woff


def decode_table(stacks: pa.Table) -> DecodedRecords:
    """Decode a STACKS table (as read from stacks.arrow)."""
    n = stacks.num_rows
    counters = {"stack_records": n, "decode_mismatch": 0, "decode_bad_payload": 0}
    if n == 0:
        return DecodedRecords(DECODED_RECORDS.empty_table(), counters, np.zeros(0, np.int64))
    nwords = (stacks.column("copy_len").to_numpy() // 8).astype(np.int64)
    poff, pdata = _binary_parts(stacks.column("payload"))
    P, woff = _payload_words(poff, pdata)
    sk = rebuild(P, woff, nwords)
    counters["decode_bad_payload"] = int((~sk.good).sum())
    regs_col = stacks.column("regs").combine_chunks()
    regs = regs_col.values.to_numpy(zero_copy_only=False)[
        regs_col.offset * NUM_REGS:(regs_col.offset + n) * NUM_REGS].reshape(n, NUM_REGS)
    fpc = pc.fill_null(stacks.column("fp_chain"), pa.scalar([], pa.list_(pa.uint64())))
    fpc = fpc.combine_chunks()
    fp_off = fpc.offsets.to_numpy().astype(np.int64)
    fp_vals = fpc.values.to_numpy(zero_copy_only=False).astype(np.uint64)
    fp_off = fp_off - fp_off[0]
    sp = stacks.column("sp").to_numpy()
    cut = stacks.column("truncated").to_numpy(zero_copy_only=False)
    pycut = stacks.column("python_cut").to_numpy(zero_copy_only=False)
    hashes = stacks.column("hash").to_numpy()
    ok = sk.good & (skeleton_hash(nwords, sk.row, sk.pos, sk.vals, regs,
                                  np.where(pycut, 0, sp).astype(np.uint64), cut, fp_off,
                                  fp_vals) == hashes)
    # a Python cut's record keeps rip alone; the unwinder starts from its own sp
    if pycut.any():
        regs = regs.copy()
        regs[pycut, RSP] = sp[pycut]
    counters["decode_mismatch"] = int(n - ok.sum())

    rows = np.flatnonzero(ok)
    data = sk.flat if rows.size == n else sk.flat[np.repeat(ok, nwords)]
    take = pa.array(rows)
    table = pa.table({
        "stack_hash": pa.array(hashes[rows]),
        "pid": stacks.column("pid").take(take),
        "tid": stacks.column("tid").take(take),
        "ts": stacks.column("ts").take(take),
        "sp": pa.array(sp[rows]),
        "copy_len": stacks.column("copy_len").take(take),
        "copy_truncated": stacks.column("truncated").take(take),
        "regs": pa.FixedSizeListArray.from_arrays(pa.array(regs[rows].ravel()), NUM_REGS),
        "stack": _binary_chunks(data, nwords[rows] * 8),
        "fp_chain": stacks.column("fp_chain").take(take),
        "python_cut": stacks.column("python_cut").take(take),
    }, schema=DECODED_RECORDS)
    return DecodedRecords(table, counters, rows)
