"""The heap timeline: each process's heap bytes after each change, from the changes
pair's buckets hand over (+size where a block starts, -size where it ends), put in
order one range of events at a time, each process's bytes carried from range to range.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.process.lookup import Carry, group_bounds
from memtrack.process.streams import Stream
from memtrack.schema.stages import HEAP_TIMELINE

# A change of a process's heap bytes: +size at a block's start, -size where it ends.
CHANGES = pa.schema([("event_id", pa.int64()), ("pid", pa.int64()), ("ts", pa.uint64()),
                     ("delta", pa.int64())])

def write_changes(rows: pa.Table, ranges: list[Stream], per_range: int) -> None:
    """A bucket's changes, each to the stream of its event's range."""
    ev = rows.column("event_id").to_numpy().astype(np.int64)
    end_col = rows.column("end_event_id")
    ended = pc.is_valid(end_col).to_numpy(zero_copy_only=False)
    end = pc.fill_null(end_col, 0).to_numpy()  # not a float array with NaNs
    size = rows.column("size").to_numpy().astype(np.int64)
    pid = rows.column("pid").to_numpy().astype(np.int64)
    e = np.concatenate([ev, end[ended].astype(np.int64)])
    t = np.concatenate([rows.column("ts").to_numpy(),
                        rows.column("end_ts").to_numpy()[ended]])
    d = np.concatenate([size, -size[ended]])
    p = np.concatenate([pid, pid[ended]])
    if len(ranges) == 1:
        ranges[0].write(pa.RecordBatch.from_arrays(
            [pa.array(e), pa.array(p), pa.array(t), pa.array(d)], schema=CHANGES))
        return
    order, bounds = group_bounds(e // per_range, len(ranges))
    for k in np.flatnonzero(np.diff(bounds)).tolist():
        i = order[bounds[k]:bounds[k + 1]]
        ranges[k].write(pa.RecordBatch.from_arrays(
            [pa.array(e[i]), pa.array(p[i]), pa.array(t[i]), pa.array(d[i])], schema=CHANGES))


class HeapTimeline:
    """Each process's heap bytes so far, across the ranges of changes."""

    def __init__(self) -> None:
        self.bytes = Carry()

    def timeline(self, changes: pa.Table) -> pa.Table:
        """HEAP_TIMELINE rows of one range of changes: one per (pid, event) that changed,
        in event order (then pid)."""
        if not changes.num_rows:
            return HEAP_TIMELINE.empty_table()
        e, p = changes.column("event_id").to_numpy(), changes.column("pid").to_numpy()
        d, t = changes.column("delta").to_numpy(), changes.column("ts").to_numpy()
        order = np.lexsort((p, e))
        e, p, d, t = e[order], p[order], d[order], t[order]
        first = np.ones(len(e), bool)
        first[1:] = (e[1:] != e[:-1]) | (p[1:] != p[:-1])
        at = np.flatnonzero(first)
        e, p, t, d = e[at], p[at], t[at], np.add.reduceat(d, at)
        by_pid = np.argsort(p, kind="stable")
        ps, ds = p[by_pid], d[by_pid]
        run = np.cumsum(ds)
        start = np.ones(len(ps), bool)
        start[1:] = ps[1:] != ps[:-1]
        begin = np.maximum.accumulate(np.where(start, np.arange(len(ps)), 0))
        heap = run - np.where(begin > 0, run[np.maximum(begin - 1, 0)], 0)
        heap += self.bytes.get(ps)[0]
        self.bytes.update(ps, heap)
        out = np.empty(len(heap), np.int64)
        out[by_pid] = heap
        return pa.table({"pid": pa.array(p.astype(np.uint32)),
                         "event_id": pa.array(e.astype(np.uint64)), "ts": pa.array(t),
                         "delta": pa.array(d), "heap_bytes": pa.array(out)},
                        schema=HEAP_TIMELINE)


