"""Pairing allocations with the frees that end them, vectorized with numpy.

Rules (docs/DESIGN.md, Process):
- every event of an allocation kind with a non-null address is one allocation;
- a realloc is the free of its old block (old_addr) followed, in the same event, by a
  new allocation linked to the old one (`realloc_of`);
- a forked child that allocates or frees before its exec or exit inherits a copy of
  every block alive in its parent at the fork (an inherited block, `inherited_from`:
  the parent's block): its frees end the inherited blocks, the parent's the originals;
- a forked child (not a vfork) whose next boundary is an exec runs its parent's program
  until then (its prelude): its inherited and its own blocks there are matched, then left
  out (no rows, no heap changes; counted as allocations_before_exec);
- an allocation's lifetime ends at the first later free of the same address in the same
  image (a process's, from its fork or exec to its next exec or exit; a fork that hands
  the pid out again starts another process), so a reused pid never pairs with its
  predecessor's blocks;
- an allocation never freed ends at its process's exec or exit, or at the capture's end
  (a leak); one whose address is handed out again before any free ends there ("reused":
  a free that was not recorded, counted);
- a free that ends nothing is unmatched (the block was allocated before tracking, by an
  untracked allocator, or inherited across fork), except glibc's own frees at thread
  exit (thread_exit_frees), counted apart.

How: the heap operations come in buckets by address (memtrack.process.spill), and each
bucket is matched on its own with numpy (an address's blocks, frees and inherited blocks
all fall in one); its rows go to streams by event range, which are put in order one
range at a time, where what crosses buckets is joined: a realloc's link to the block it
freed, the inherited blocks' ids, the heap timeline. Memory holds a bucket (a piece of a
bucket too big) or a range at a time, and the inherited blocks (memtrack.process.inherit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.process.heap_timeline import CHANGES, HeapTimeline, write_changes
from memtrack.process.inherit import InheritedIds, inherited_rows, inheriting
from memtrack.process.lifecycle import Lifecycle
from memtrack.process.lookup import find_sorted, group_bounds
from memtrack.process.match import BLOCK_ROWS, END_REALLOC, allocation_rows, matched
from memtrack.process.progress import Advance, no_progress
from memtrack.process.spill import EventSpill, buckets_for, split
from memtrack.process.stage import StageResult
from memtrack.process.streams import Stream
from memtrack.schema.enums import EventKind
from memtrack.schema.stages import ALLOCATIONS, HEAP_TIMELINE

RANGE_EVENTS = 1 << 20  # events whose rows are put in order at a time, at least
MAX_RANGES = 128  # a range's three streams are open files: ranges grow, not their number




@dataclass
class Pairing(StageResult):
    allocations: pa.Table  # ALLOCATIONS: the allocations in event order, then the inherited
    heap_timeline: pa.Table  # HEAP_TIMELINE: heap bytes per process after each change


def pair(events: pa.Table, lifecycle: Lifecycle, end_ts: int | None = None, *,
         buckets: int | None = None) -> Pairing:
    """Pair the allocations and frees of `events` (time-ordered, with event_id their
    position: memtrack.process.read) within the process lives of `life`
    (memtrack.process.lifecycle of the same events), in memory; `buckets`: how many
    (None: by the number of events); the tables do not depend on it.

    `end_ts` is the capture's end (CLOCK_MONOTONIC ns); the last event's time if None.
    """
    spill = EventSpill(None, buckets or buckets_for(events.num_rows))
    for batch in events.drop_columns(["event_id"]).to_batches():
        spill.add(batch)
    allocations: list[pa.Table] = []
    timeline: list[pa.Table] = []
    paired = pair_spilled(spill, lifecycle, end_ts, allocations.append, timeline.append)
    return Pairing(pa.concat_tables([ALLOCATIONS.empty_table(), *allocations]),
                   pa.concat_tables([HEAP_TIMELINE.empty_table(), *timeline]),
                   counters=paired.counters)


def pair_spilled(spill: EventSpill, lifecycle: Lifecycle, end_ts: int | None,
                 allocations: Callable[[pa.Table], None],
                 timeline: Callable[[pa.Table], None], progress: Advance = no_progress,
                 attached: list[int] | None = None
                 ) -> StageResult:
    """Pair the events of `spill`, bucket by bucket; hands the allocations (ALLOCATIONS,
    by alloc_id) to `allocations` and the heap timeline (HEAP_TIMELINE, in event order)
    to `timeline`, a table at a time; returns the counters (the tables went to them).
    `progress` is told after each bucket and each range.

    A bucket's rows go to streams by their event's range (RANGE_EVENTS events or more):
    the allocations and, for each realloc, the block it freed; a range at a time, they are
    put in order and the realloc's link made. The inherited blocks (the blocks alive at
    a fork whose child touches its heap) are kept in memory and given their ids once
    every bucket is matched."""
    if end_ts is None or end_ts < spill.last_ts:
        end_ts = spill.last_ts
    images = lifecycle.images(spill.n)
    forks = inheriting(lifecycle.forks, images, *spill.heap_touches())
    images.heaps_before_attach(attached or [], forks.ev, forks.parent, forks.child)
    exits = spill.exits()
    counters = {"allocations": spill.allocations, "allocations_inherited": 0,
                "frees": spill.frees, "reallocs": 0, "frees_unmatched": 0,
                "frees_at_thread_exit": 0, "frees_before_attach": 0,
                "allocations_reused_without_free": 0, "allocations_before_exec": 0,
                "allocations_not_freed": 0, "failed_allocations": spill.failed_allocations}
    per_range = max(RANGE_EVENTS, -(-spill.n // MAX_RANGES))  # events of a range
    ranges = -(-spill.n // per_range)
    changes = spill.streams(CHANGES, "changes", ranges)
    blocks = spill.streams(BLOCK_ROWS, "blocks", ranges)
    freed = spill.streams(REALLOC_FREED, "freed", ranges)
    inherited: list[pa.Table] = []
    steps = len(spill.ops) + ranges
    for k, bucket in enumerate(spill.ops):
        # a bucket too big is split again by address where children inherit, else
        # matched a piece (of time) at a time
        for stream in (split(bucket, spill) if len(forks.ev) else [bucket]):
            for rows, got in matched(stream, images, forks, exits, end_ts):
                for name, v in got.items():
                    counters[name] += v
                write_changes(rows, changes, per_range)
                real = rows.column("fork").null_count == rows.num_rows
                if not real:
                    is_inherited = pc.is_valid(rows.column("fork"))
                    inherited.append(rows.filter(is_inherited))
                _by_range(rows if real else rows.filter(pc.invert(is_inherited)),
                          rows.column("event_id").to_numpy() if real else None, blocks, per_range)
                _realloc_freed(rows, freed, per_range)
                del rows
        progress(k + 1, steps, buckets=k + 1)
    counters["frees_unmatched"] -= counters["frees_at_thread_exit"] + \
        counters["frees_before_attach"]
    inherited_table, inherited_ids = inherited_rows(inherited, spill.allocations)
    del inherited
    heap = HeapTimeline()
    for k in range(ranges):
        allocations(_range_rows(blocks[k], freed[k], inherited_ids))
        blocks[k].remove()
        freed[k].remove()
        timeline(heap.timeline(changes[k].table()))
        changes[k].remove()
        progress(len(spill.ops) + k + 1, steps, buckets=len(spill.ops), ranges=k + 1)
    if inherited_table.num_rows:
        allocations(inherited_table)
    return StageResult(counters=counters)


# For a realloc: the block its event freed (alloc_id, or an inherited block's key: fork,
# origin).
REALLOC_FREED = pa.schema([("event_id", pa.int64()), ("alloc_id", pa.int64()),
                           ("fork", pa.int64()), ("origin", pa.int64())])


def _by_range(rows: pa.Table, ev: np.ndarray | None, streams: list[Stream], per_range: int
              ) -> None:
    """Rows to the streams of their event's range (`ev`: the rows' event ids)."""
    if not rows.num_rows:
        return
    ev = rows.column("event_id").to_numpy() if ev is None else ev
    order, at = group_bounds((ev // per_range).astype(np.int64), len(streams))
    rows = rows.take(pa.array(order))
    for k in np.flatnonzero(np.diff(at)).tolist():
        for b in rows.slice(at[k], at[k + 1] - at[k]).to_batches():
            streams[k].write(b)


def _realloc_freed(rows: pa.Table, streams: list[Stream], per_range: int) -> None:
    """The blocks of a bucket that a realloc freed, by the realloc's event."""
    reason = rows.column("end_reason").to_numpy()
    i = np.flatnonzero(reason == END_REALLOC)
    if not len(i):
        return
    t = rows.take(pa.array(i))
    out = pa.table({
        "event_id": t.column("free_event_id").cast(pa.int64()),
        "alloc_id": pc.fill_null(t.column("alloc_id").cast(pa.int64()), -1),
        "fork": pc.fill_null(t.column("fork"), -1),
        "origin": pc.fill_null(t.column("origin").cast(pa.int64()), 0),
    }, schema=REALLOC_FREED)
    _by_range(out, None, streams, per_range)


def _range_rows(blocks: Stream, freed: Stream, inherited_ids: InheritedIds) -> pa.Table:
    """One range's allocations (ALLOCATIONS, by alloc_id: in event order), each realloc
    linked to the block its event freed."""
    t = blocks.table()
    if not t.num_rows:
        return ALLOCATIONS.empty_table()
    t = t.take(pa.array(np.argsort(t.column("event_id").to_numpy(), kind="stable")))
    f = freed.table()
    realloc_of = np.full(t.num_rows, -1, np.int64)
    if f.num_rows:
        old = f.column("alloc_id").to_numpy()
        inherited = old < 0
        if inherited.any():
            old = old.copy()
            old[inherited] = inherited_ids.of(f.column("fork").to_numpy()[inherited],
                                              f.column("origin").to_numpy()[inherited])
        f_ev = f.column("event_id").to_numpy()
        order = np.argsort(f_ev, kind="stable")
        f_ev, old = f_ev[order], old[order]
        ev = t.column("event_id").to_numpy().astype(np.int64)
        is_r = t.column("kind").to_numpy() == EventKind.REALLOC
        j, hit = find_sorted(f_ev, ev)
        hit &= is_r
        realloc_of[hit] = old[j[hit]]
    return allocation_rows(t, pa.array(realloc_of.astype(np.uint64), mask=realloc_of < 0),
                            pa.nulls(t.num_rows, pa.uint64()))


