"""The events of a run on their way from read to pair and load, never held whole.

Read hands the events over a batch at a time, in time order; the spill numbers them
(event_id, and alloc_id: an allocation's rank among the allocations) and writes:
- every event to one staged stream when read had to sort them (`stage_events`; events
  that came in time order are read from the artifact again by load instead);
- every heap operation (an allocation's block, a free's or a realloc's freed address)
  to one of `buckets` streams chosen by a hash of its address, with what pairing needs
  of it: every operation of an address falls in one bucket, so that pair matches the
  buckets one at a time (memtrack.process.pair);
- and keeps what is small: the other events (lifecycle, address space, regions: a few
  per process), each pid's first time, counts, each thread's last allocation and free
  before each of its exits (`exits`: glibc's thread-exit frees), and each pid's first
  heap operation between two lifecycle events (`heap_touches`: only a forked child
  that touches its heap before its next exec or exit inherits its parent's blocks).

For each free it also records the previous heap event of its thread (`prev`): a block
is temporary (heaptrack's definition) when the free that ends it comes straight after it
in its thread. The streams are uncompressed Arrow IPC files in a scratch directory next
to the run database being written (removed when process ends, however it ends), or
lists in memory for a table already in memory (`pair` on a table, the tests).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.process.lookup import Carry, group_bounds
from memtrack.process.streams import Stream
from memtrack.schema import EVENTS
from memtrack.schema.enums import EventKind

# What the run database's events table is made of (the artifact's columns, event_id first).
STAGED_EVENTS = pa.schema([("event_id", pa.uint64()), *EVENTS])
# A heap operation: a block (alloc_id >= 0, addr its address) or a free (alloc_id -1, addr
# the address it frees, prev the previous heap event of its thread or -1).
OPS = pa.schema([
    ("event_id", pa.int64()), ("pid", pa.int64()), ("tid", pa.uint32()), ("ts", pa.uint64()),
    ("kind", pa.uint8()), ("allocator", pa.uint8()), ("addr", pa.uint64()),
    ("size", pa.uint64()), ("stack_hash", pa.uint64()), ("alloc_id", pa.int64()),
    ("prev", pa.int64()),
])  # fmt: skip
OPS_PER_BUCKET = 1 << 20  # the heap operations pair holds at a time, about
MAX_BUCKETS = 256  # each an open file while read writes it
_HASHES = [np.uint64(m) for m in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0xFF51AFD7ED558CCD)]
_LIFECYCLE = (EventKind.FORK, EventKind.EXEC, EventKind.EXIT)


class OutOfOrder(Exception):
    """The events are not in time order (read sorts them and starts again)."""


def buckets_for(ops: int) -> int:
    """A power of two near ops / OPS_PER_BUCKET, at most MAX_BUCKETS."""
    want = max(1, min(MAX_BUCKETS, -(-ops // OPS_PER_BUCKET)))
    return 1 << (want - 1).bit_length()


def bucket_of(addr: np.ndarray, buckets: int, level: int = 0) -> np.ndarray:
    """Each address's bucket: a multiplicative hash of addr >> 4 (blocks are 16-byte
    aligned), its top bits; `level` > 0: another hash, to split a bucket again."""
    if buckets == 1:
        return np.zeros(len(addr), np.uint16)
    shift = np.uint64(64 - (buckets.bit_length() - 1))
    return ((addr >> np.uint64(4)) * _HASHES[level % len(_HASHES)] >> shift).astype(np.uint16)


def split(stream: Stream, spill: EventSpill, level: int = 1) -> list[Stream]:
    """A bucket the estimate made too big (a file that compressed far better than
    most), split again by another hash of the address into buckets of about
    OPS_PER_BUCKET, each of them split again if it is still too big; read a batch at
    a time."""
    if stream.rows <= 2 * OPS_PER_BUCKET or level >= len(_HASHES):
        return [stream]
    n = buckets_for(stream.rows)
    parts = spill.streams(OPS, f"{stream.path.stem if stream.path else 'ops'}.{level}", n)
    for batch in stream.batches():
        order, at = group_bounds(bucket_of(batch.column("addr").to_numpy(), n, level), n)
        batch = batch.take(pa.array(order))
        for k in np.flatnonzero(np.diff(at)).tolist():
            parts[k].write(batch.slice(at[k], at[k + 1] - at[k]))
    stream.remove()
    return [s for p in parts for s in split(p, spill, level + 1)]


class _Threads:
    """Each thread's last heap event so far (thread key pid << 32 | tid)."""

    def __init__(self) -> None:
        self.last = Carry()

    def previous(self, key: np.ndarray, eid: np.ndarray) -> np.ndarray:
        """For heap events (thread keys, event ids, in event order): each one's previous
        heap event in its thread, -1 for none; remembers the last of each thread."""
        order = np.argsort(key, kind="stable")
        k, e = key[order], eid[order]
        prev = np.full(len(k), -1, np.int64)
        same = np.zeros(len(k), bool)
        same[1:] = k[1:] == k[:-1]
        prev[1:][same[1:]] = e[:-1][same[1:]]
        first = np.flatnonzero(~same)
        before, found = self.last.get(k[first])
        prev[first[found]] = before[found]
        self.last.update(k, e)
        out = np.empty(len(k), np.int64)
        out[order] = prev
        return out


class OtherEvents:
    """What read keeps of the events beside the heap's (a sink of its own, or part of
    the spill's and `info`'s): the events of the other kinds (lifecycle, address space,
    regions: a few per process) with their event_id, and each pid's first time (the
    lifecycle stage's `first_seen`), gathered a batch at a time."""

    def __init__(self) -> None:
        self.parts: list[pa.Table] = []
        self.first_seen: dict[int, int] = {}  # pid -> its first event's time
        self.n = 0

    def add(self, batch: pa.RecordBatch) -> None:
        kind = batch.column("kind").to_numpy()
        other = np.flatnonzero(kind >= EventKind.MMAP)
        if len(other):
            self.parts.append(pa.Table.from_batches([batch]).take(pa.array(other)).add_column(
                0, "event_id", pa.array((other + self.n).astype(np.uint64))))
        pid, ts = batch.column("pid").to_numpy(), batch.column("ts").to_numpy()
        if len(pid):  # each pid's earliest (`info` reads events in file order, not time)
            order = np.argsort(pid, kind="stable")
            ps = pid[order]
            start = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
            earliest = np.minimum.reduceat(ts[order], start)
            for p, t in zip(ps[start].tolist(), earliest.tolist(), strict=True):
                self.first_seen[p] = min(self.first_seen.get(p, t), t)
        self.n += batch.num_rows

    def other_events(self) -> pa.Table:
        """In event order (STAGED_EVENTS)."""
        return pa.concat_tables(self.parts).cast(STAGED_EVENTS) if self.parts \
            else STAGED_EVENTS.empty_table()

    def close(self) -> None:
        pass


class _LastOf:
    """Per thread id, the last event of some kind so far."""

    def __init__(self) -> None:
        self.last = Carry()

    def before(self, tid: np.ndarray, eid: np.ndarray, at_tid: np.ndarray,
               at_eid: np.ndarray) -> np.ndarray:
        """Events (tid, eid in event order) of this batch; for each (at_tid, at_eid): the
        last of its thread's events before it, this batch's or an earlier one's, -1 for
        none. Then remembers the batch's."""
        base = int(eid[0]) if len(eid) else 0
        low = np.uint64(0xFFFFFFFF)
        key = np.sort(tid.astype(np.uint64) << np.uint64(32) | (eid - base).astype(np.uint64))
        at = at_tid.astype(np.uint64) << np.uint64(32) | (at_eid - base).astype(np.uint64)
        out = np.full(len(at), -1, np.int64)
        if len(key):
            j = np.searchsorted(key, at) - 1
            jc = np.maximum(j, 0)
            hit = (j >= 0) & (key[jc] >> np.uint64(32) == at_tid)
            out[hit] = (key[jc][hit] & low).astype(np.int64) + base
        miss = np.flatnonzero(out < 0)
        earlier, found = self.last.get(at_tid[miss].astype(np.int64))
        out[miss[found]] = earlier[found]
        self.last.update((key >> np.uint64(32)).astype(np.int64),
                         (key & low).astype(np.int64) + base)
        return out


class EventSpill:
    """Events handed over in time order (`add`), staged for pair and load."""

    def __init__(self, directory: Path | None, buckets: int) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir()
        self.buckets = buckets
        # events put in order by read: staged (else read again from the artifact)
        self.stage_events = False
        self.staged = Stream(STAGED_EVENTS, directory / "events.arrow" if directory else None)
        self.ops = [Stream(OPS, directory / f"ops-{k}.arrow" if directory else None)
                    for k in range(buckets)]
        self.others = OtherEvents()
        self.n = 0
        self.allocations = 0
        self.frees = 0
        self.failed_allocations = 0
        self.last_ts = 0
        self._threads = _Threads()
        self._last_alloc, self._last_free = _LastOf(), _LastOf()
        # per EXIT: tid, event_id, the thread's last allocation and last free before it
        self.exit_tails: list[np.ndarray] = []
        self.touches: list[np.ndarray] = []  # per batch: (pid, event_id) (_touches)

    def add(self, batch: pa.RecordBatch) -> None:
        """The next events in time order (OutOfOrder if they are not)."""
        n = batch.num_rows
        if not n:
            return
        col = {c: batch.column(c).to_numpy() for c in (
            "ts", "pid", "tid", "kind", "flags", "addr", "old_addr")}  # fmt: skip
        ts, kind, addr, old = col["ts"], col["kind"], col["addr"], col["old_addr"]
        if ts[0] < self.last_ts or (n > 1 and not bool((ts[1:] >= ts[:-1]).all())):
            raise OutOfOrder
        eid = np.arange(self.n, self.n + n, dtype=np.int64)
        if self.stage_events:
            self.staged.write(pa.RecordBatch.from_arrays(
                [pa.array(eid.astype(np.uint64)), *batch.columns], schema=STAGED_EVENTS))

        is_alloc_kind = (kind >= EventKind.MALLOC) & (kind <= EventKind.ALIGNED_ALLOC)
        a = np.flatnonzero(is_alloc_kind & (addr != 0))
        self.failed_allocations += int((is_alloc_kind & (addr == 0)).sum())
        f = np.flatnonzero(((kind == EventKind.FREE) & (addr != 0))
                           | ((kind == EventKind.REALLOC) & (old != 0)))
        heap = np.flatnonzero((kind <= EventKind.FREE) & ((addr != 0) | (old != 0)))
        thread = col["pid"][heap].astype(np.uint64) << np.uint64(32) | col["tid"][heap]
        prev_h = self._threads.previous(thread, eid[heap])
        prev = np.full(n, -1, np.int64)
        prev[heap] = prev_h
        self._touches(col, eid, np.sort(np.concatenate([a, f])))
        x = np.flatnonzero(kind == EventKind.EXIT)
        tid = col["tid"]
        ak = np.flatnonzero(is_alloc_kind)
        fk = np.flatnonzero((kind == EventKind.FREE) & (addr != 0))
        self.frees += len(fk)
        la = self._last_alloc.before(tid[ak], eid[ak], tid[x], eid[x])
        lf = self._last_free.before(tid[fk], eid[fk], tid[x], eid[x])
        if len(x):
            self.exit_tails.append(np.stack([tid[x].astype(np.int64), eid[x], la, lf]))

        alloc_id = np.arange(self.allocations, self.allocations + len(a), dtype=np.int64)
        self.allocations += len(a)
        at = np.concatenate([a, f])
        op_addr = np.concatenate([addr[a], np.where(kind[f] == EventKind.FREE, addr[f], old[f])])
        op_id = np.concatenate([alloc_id, np.full(len(f), -1, np.int64)])
        op_prev = np.concatenate([np.full(len(a), -1, np.int64), prev[f]])
        bounds = [0, len(at)]
        if self.buckets > 1:  # in bucket order
            # a radix sort: uint16
            order, at_bucket = group_bounds(bucket_of(op_addr, self.buckets), self.buckets)
            bounds = at_bucket.tolist()
            at, op_addr, op_id, op_prev = at[order], op_addr[order], op_id[order], op_prev[order]
        take = pa.array(at)
        ops = pa.RecordBatch.from_arrays([
            pa.array(eid[at]), pa.array(col["pid"][at].astype(np.int64)),
            pa.array(col["tid"][at]), pa.array(ts[at]), pa.array(kind[at]),
            batch.column("allocator").take(take), pa.array(op_addr),
            batch.column("size").take(take), batch.column("stack_hash").take(take),
            pa.array(op_id), pa.array(op_prev),
        ], schema=OPS)
        for k in range(len(bounds) - 1):
            if bounds[k + 1] > bounds[k]:
                self.ops[k].write(ops.slice(bounds[k], bounds[k + 1] - bounds[k]))
        self.others.add(batch)
        self.n += n
        self.last_ts = int(ts[-1])

    def _touches(self, col: dict[str, np.ndarray], eid: np.ndarray, heap_ops: np.ndarray
                 ) -> None:
        """Keep each pid's first heap operation (an allocation or a free) between two
        lifecycle events: whether a forked child touches its heap before the end of
        the image its fork starts is then a lookup (pair, once the lifecycle is
        known), whatever events lie between."""
        lc = np.flatnonzero(np.isin(col["kind"], _LIFECYCLE))
        pid = col["pid"][heap_ops].astype(np.int64)
        stretch = np.searchsorted(lc, heap_ops)
        _, first = np.unique(stretch << 32 | pid, return_index=True)
        self.touches.append(np.stack([pid[first], eid[heap_ops][first]]))

    def heap_touches(self) -> tuple[np.ndarray, np.ndarray]:
        """The heap operations `_touches` kept: (pid, event_id)."""
        t = np.concatenate(self.touches, axis=1) if self.touches \
            else np.zeros((2, 0), np.int64)
        return t[0], t[1]

    def streams(self, schema: pa.Schema, name: str, count: int) -> list[Stream]:
        """`count` more streams of `schema`, in the spill's directory (NAME-K.arrow)."""
        d = self.directory
        return [Stream(schema, d / f"{name}-{k}.arrow" if d else None) for k in range(count)]

    def exits(self) -> np.ndarray:
        """Every EXIT as (tid, event_id, the thread's last allocation before it, its
        last free before it; -1: none), rows sorted by (tid, event_id)."""
        t = np.concatenate(self.exit_tails, axis=1) if self.exit_tails \
            else np.zeros((4, 0), np.int64)
        return t[:, np.lexsort((t[1], t[0]))]

    def other_events(self) -> pa.Table:
        """The events of kinds other than the heap's, with event_id, in event order."""
        return self.others.other_events()

    def close(self) -> None:
        self.staged.close()
        for s in self.ops:
            s.close()

    def reset(self) -> None:
        """Start again, empty (read found the events out of time order)."""
        self.remove()
        self.__init__(self.directory, self.buckets)  # type: ignore[misc]

    def remove(self) -> None:
        """Delete the scratch files."""
        self.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
