"""Bulk reading of BPF ring buffers through their memory mapping.

A BPF ring buffer map is mmap'able: page 0 holds the consumer position (read-write),
the next page the producer position, followed by the data area mapped twice in a row
so that a record that wraps around is still contiguous. Each record has an 8-byte
header: its length with a busy bit (31, still being written) and a discard bit (30).

`read_fixed` turns every committed record of a ring whose records all have one size
into one numpy array in a handful of vectorized operations; `read_records` returns the
records of a ring with variable-size records as `Records`: one bytes copy of the span
read and where each record lies in it.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memtrack.schema.stackrecord import offsets_of

BUSY = 1 << 31
DISCARD = 1 << 30
HEADER = 8


@dataclass(frozen=True)
class Records:
    """Variable-size records laid out as in a ring: record i is
    blob[starts[i]:starts[i] + lengths[i]], every start 8-aligned. Arrays, not a
    Python object per record: the stack ring carries one record per new call path,
    which is nearly one per allocation in a recursive program (the binary tree's
    262 k), and a view and a length per record cost the drain and the writer ~0.5 µs
    each."""

    blob: bytes
    starts: np.ndarray  # int64
    lengths: np.ndarray  # int64

    @classmethod
    def of(cls, records: Sequence[bytes | memoryview]) -> Records:
        """Records from separate bytes (each padded to 8 bytes, as the ring does)."""
        lengths = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
        padded = (lengths + 7) & ~7
        starts = offsets_of(padded)[:-1]
        blob = b"".join(bytes(r) + b"\0" * (int(p) - len(r))
                        for r, p in zip(records, padded.tolist(), strict=True))
        return cls(blob, starts, lengths)

    @classmethod
    def concat(cls, parts: Sequence[Records]) -> Records:
        if len(parts) == 1:
            return parts[0]
        sizes = np.array([len(p.blob) for p in parts], dtype=np.int64)
        shift = np.repeat(offsets_of(sizes)[:-1], [len(p) for p in parts])
        return cls(b"".join(p.blob for p in parts),
                   np.concatenate([p.starts for p in parts]) + shift,
                   np.concatenate([p.lengths for p in parts]))

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __iter__(self) -> Iterator[memoryview]:
        view = memoryview(self.blob)
        for start, length in zip(self.starts.tolist(), self.lengths.tolist(), strict=True):
            yield view[start:start + length]


_NO_RECORDS = Records(b"", np.zeros(0, np.int64), np.zeros(0, np.int64))


def _gather(base: np.ndarray, n: int, stride: int, rec: int) -> np.ndarray:
    """The n record bodies after their headers, copied into one contiguous block
    (as whole 8-byte words when the sizes allow: far faster than a structured copy).
    Always a copy: one record's body is contiguous already, and a view of the ring
    would be overwritten once the consumer position moves past it."""
    if stride % 8 == 0 and rec % 8 == 0:
        words = np.ndarray((n, stride // 8), dtype=np.uint64, buffer=base)
        return words[:, HEADER // 8:HEADER // 8 + rec // 8].copy()
    raw = np.ndarray((n, stride), dtype=np.uint8, buffer=base)
    return raw[:, HEADER:HEADER + rec].copy()


class RingReader:
    """Consumes one BPF_RINGBUF_OUTPUT map of a loaded bcc program."""

    def __init__(self, bpf: Any, map_name: str) -> None:
        table = bpf[map_name]
        self.name = map_name
        self.fd: int = table.map_fd
        self.size: int = int(table.max_entries)
        if self.size <= 0 or self.size & (self.size - 1):
            raise ValueError(f"ring {map_name}: size {self.size} is not a power of two")
        self.mask = self.size - 1
        page = mmap.PAGESIZE
        self._cons_map = mmap.mmap(self.fd, page, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod_map = mmap.mmap(self.fd, page + 2 * self.size, mmap.MAP_SHARED,
                                   mmap.PROT_READ, offset=page)
        self._cons = np.frombuffer(self._cons_map, dtype=np.uint64, count=1)
        self._prod = np.frombuffer(self._prod_map, dtype=np.uint64, count=1)
        self._data = np.frombuffer(self._prod_map, dtype=np.uint8, offset=page)
        self._bytes = memoryview(self._prod_map)[page:]
        self._hdrs = self._bytes.cast("I")  # u32 words: record headers are 8-aligned

    def pending(self) -> int:
        """Bytes written by producers and not consumed yet."""
        return int(self._prod[0]) - int(self._cons[0])

    def _advance(self, pos: int) -> None:
        self._cons[0] = pos

    def read_fixed(self, dtype: np.dtype) -> np.ndarray:
        """Every committed record, each exactly dtype.itemsize bytes, as one array.

        Stops at the first record still being written, and at what was produced when
        it started (records written meanwhile are the next call's: chasing a busy
        producer would make many small copies). A record of another size or a
        discarded one is skipped through the slow path (never produced by memtrack's
        programs, handled for safety)."""
        dtype = np.dtype(dtype)
        rec = dtype.itemsize
        stride = (rec + HEADER + 7) & ~7
        out: list[np.ndarray] = []
        end = int(self._prod[0])
        while True:
            cons = int(self._cons[0])
            span = end - cons
            if span <= 0:
                break
            start = cons & self.mask
            n = span // stride
            if n == 0:
                if not self._read_one_odd(rec, out, dtype, end):
                    break
                continue
            base = self._data[start:start + n * stride]
            hdr = np.ndarray((n,), dtype=np.uint32, buffer=base, strides=(stride,))
            bad = np.flatnonzero(hdr != rec)
            good = int(bad[0]) if bad.size else n
            if good:
                out.append(_gather(base, good, stride, rec).view(dtype).reshape(good))
                self._advance(cons + good * stride)
            if good < n or span % stride:
                if not self._read_one_odd(rec, out, dtype, end):
                    break
        if not out:
            return np.empty(0, dtype=dtype)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _read_one_odd(self, rec: int, out: list[np.ndarray], dtype: np.dtype,
                      end: int) -> bool:
        """Handle the record at the consumer position one by one; False if busy."""
        cons = int(self._cons[0])
        if end - cons < HEADER:
            return False
        start = cons & self.mask
        hdr = int(self._data[start:start + 4].view(np.uint32)[0])
        if hdr & BUSY:
            return False
        length = hdr & ~(BUSY | DISCARD)
        if not hdr & DISCARD and length == rec:
            body = self._data[start + HEADER:start + HEADER + rec]
            out.append(np.frombuffer(body.tobytes(), dtype=dtype))
        self._advance(cons + ((length + HEADER + 7) & ~7))
        return True

    def read_records(self) -> Records:
        """Every committed record (rings with variable-size records), up to what was
        produced when it started (as read_fixed). The headers are walked one by one (a
        record's length says where the next starts) through a memoryview (a numpy
        scalar read per header costs ~4x as much); the span is copied once, not record
        by record (a bytes object per record meant a malloc, and so a trap into the
        probed allocator, for each)."""
        cons = first = int(self._cons[0])
        prod = int(self._prod[0])
        hdrs, mask = self._hdrs, self.mask
        starts: list[int] = []
        lengths: list[int] = []
        while prod - cons >= HEADER:
            hdr = hdrs[(cons & mask) >> 2]
            if hdr & BUSY:
                break
            length = hdr & ~(BUSY | DISCARD)
            if not hdr & DISCARD:
                starts.append(cons - first + HEADER)
                lengths.append(length)
            cons += (length + HEADER + 7) & ~7
        if cons == first:
            return _NO_RECORDS
        start = first & mask
        blob = bytes(self._bytes[start:start + cons - first])
        self._advance(cons)
        return Records(blob, np.array(starts, dtype=np.int64),
                       np.array(lengths, dtype=np.int64))

    def close(self) -> None:
        self._hdrs.release()
        self._bytes.release()
        self._cons = self._prod = self._data = None  # type: ignore[assignment]
        self._cons_map.close()
        self._prod_map.close()
