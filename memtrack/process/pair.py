"""Pairing allocations with the frees that end them, vectorized with numpy.

Rules (docs/DESIGN.md, Process):
- every event of an allocation kind with a non-null address is one allocation;
- a realloc is the free of its old block (old_addr) followed, in the same event, by a
  new allocation linked to the old one (`realloc_of`);
- an allocation's lifetime ends at the first later free of the same address in the same
  process; a process instance is bounded by fork (a child starts), exec and exit, so a
  reused pid never pairs with its predecessor's blocks;
- an allocation never freed ends at its process's exec or exit, or at the capture's end
  (a leak); one whose address is handed out again before any free ends there ("reused":
  a free that was not recorded, counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from memtrack.process.lifecycle import Lifecycle
from memtrack.schema.enums import EndReason, EventKind
from memtrack.schema.stages import ALLOCATIONS, HEAP_TIMELINE

END_FREE, END_REALLOC, END_REUSED, END_EXEC, END_EXIT, END_END = EndReason
BUCKET_OPS = 1 << 20  # allocations and frees paired at a time (by address)

@dataclass
class Pairing:
    allocations: pa.Table  # ALLOCATIONS, one row per allocation in event order
    heap_timeline: pa.Table  # HEAP_TIMELINE: heap bytes per process after each change
    counters: dict[str, int] = field(default_factory=dict)


def pair(events: pa.Table, life: Lifecycle, end_ts: int | None = None) -> Pairing:
    """Pair the allocations and frees of `events` (time-ordered, memtrack.process.read) within
    the process lives of `life` (memtrack.process.lifecycle of the same events).

    `end_ts` is the capture's end (CLOCK_MONOTONIC ns); the last event's time if None.
    """
    n = events.num_rows
    # Columns read at every event as numpy; the others are only taken at allocations.
    col = {name: events.column(name).to_numpy() for name in (
        "ts", "pid", "tid", "kind", "addr", "old_addr")}  # fmt: skip
    kind = col["kind"]
    addr = col["addr"]
    old = col["old_addr"]
    pid = col["pid"].astype(np.int64)
    if end_ts is None or (n and end_ts < int(col["ts"][-1])):
        end_ts = int(col["ts"][-1]) if n else 0

    # Process-instance boundaries: (pid, event index, kind of boundary).
    forks, execs, exits = life.forks, life.execs, life.process_exits
    b_pid = np.concatenate([forks["child"].to_numpy(), execs["pid"].to_numpy(),
                            exits["pid"].to_numpy()]).astype(np.int64)
    b_eid = np.concatenate([forks["event_id"].to_numpy(), execs["event_id"].to_numpy(),
                            exits["event_id"].to_numpy()]).astype(np.int64)
    b_reason = np.concatenate([
        np.full(forks.num_rows, END_EXIT), np.full(execs.num_rows, END_EXEC),
        np.full(exits.num_rows, END_EXIT)])  # fmt: skip
    stride = n + 1
    b_key = b_pid * stride + b_eid
    border = np.argsort(b_key, kind="stable")
    b_key, b_pid, b_eid, b_reason = b_key[border], b_pid[border], b_eid[border], b_reason[border]

    def instance(p: np.ndarray, e: np.ndarray) -> np.ndarray:
        """How many boundaries of process p came at or before event e."""
        return np.searchsorted(b_key, p * stride + e, side="right") - np.searchsorted(
            b_key, p * stride, side="left"
        )

    is_alloc_kind = (kind >= EventKind.MALLOC) & (kind <= EventKind.ALIGNED_ALLOC)
    a_mask = is_alloc_kind & (addr != 0)
    f_mask = (kind == EventKind.FREE) & (addr != 0)
    r_mask = (kind == EventKind.REALLOC) & (old != 0)
    a_eid, f_eid, r_eid = (np.flatnonzero(m) for m in (a_mask, f_mask, r_mask))
    n_alloc = len(a_eid)

    # Operations: frees (sub 0) before the allocation (sub 1) of the same event.
    op_eid = np.concatenate([a_eid, f_eid, r_eid])
    op_addr = np.concatenate([addr[a_mask], addr[f_mask], old[r_mask]])
    op_sub = np.concatenate([np.ones(n_alloc, np.int8), np.zeros(len(f_eid) + len(r_eid),
                                                                 np.int8)])
    op_is_realloc_free = np.concatenate([np.zeros(n_alloc + len(f_eid), bool),
                                         np.ones(len(r_eid), bool)])
    free_eid = np.full(n_alloc, -1, np.int64)
    end_eid = np.full(n_alloc, -1, np.int64)
    reason = np.full(n_alloc, END_END, np.uint8)
    unmatched_frees = 0
    # The ops of one address all fall in one bucket: the buckets pair independently,
    # and their sorts hold a bucket's ops, not all of them, at a time.
    buckets = max(1, len(op_eid) // BUCKET_OPS)
    bucket = (op_addr >> np.uint64(4)) % np.uint64(buckets) if buckets > 1 else None
    for b in range(buckets):
        sel = np.flatnonzero(bucket == b) if bucket is not None else np.arange(len(op_eid))
        e = op_eid[sel]
        p = pid[e]
        unmatched_frees += _pair_ops(p, instance(p, e), op_addr[sel], e, op_sub[sel],
                                     op_is_realloc_free[sel], sel, free_eid, end_eid, reason)
        del sel, e, p
    del op_eid, op_addr, op_sub, op_is_realloc_free, bucket

    # Never freed: bounded by the next exec/exit of the process instance, if any.
    open_ = end_eid < 0
    a_pid = pid[a_eid]
    if len(b_key) and open_.any():
        j = np.searchsorted(b_key, a_pid[open_] * stride + a_eid[open_], side="right")
        jc = np.minimum(j, len(b_key) - 1)
        hit = (j < len(b_key)) & (b_pid[jc] == a_pid[open_])
        idx = np.flatnonzero(open_)[hit]
        end_eid[idx] = b_eid[jc[hit]]
        reason[idx] = b_reason[jc[hit]]

    ts = col["ts"]
    a_ts = ts[a_eid]
    has_free = free_eid >= 0
    has_end = end_eid >= 0
    free_ts = np.where(has_free, ts[np.where(has_free, free_eid, 0)], 0)
    end_ts_a = np.where(has_end, ts[np.where(has_end, end_eid, 0)], np.uint64(end_ts))
    free_tid = np.where(has_free, col["tid"][np.where(has_free, free_eid, 0)], 0)

    # realloc_of: the allocation whose block a realloc event freed.
    realloc_of = np.full(n_alloc, -1, np.int64)
    by_free_event = np.full(n, -1, np.int64)
    rr = reason == END_REALLOC
    by_free_event[free_eid[rr]] = np.flatnonzero(rr)
    is_realloc_alloc = kind[a_eid] == EventKind.REALLOC
    realloc_of[is_realloc_alloc] = by_free_event[a_eid[is_realloc_alloc]]
    del by_free_event, rr

    # temporary (heaptrack's definition, per thread): the thread's next allocator event
    # after the allocation is the one that freed it.
    h_eid = np.flatnonzero((kind <= EventKind.FREE) & ((addr != 0) | (old != 0)))
    thread = pid[h_eid].astype(np.uint64) << np.uint64(32) | col["tid"][h_eid]
    h_order = np.argsort(thread, kind="stable")  # by thread, each in event order
    h_sorted = h_eid[h_order]
    thread = thread[h_order]
    same_thread = thread[1:] == thread[:-1]
    del thread, h_order
    next_eid = np.full(n, -1, np.int64)
    next_eid[h_sorted[:-1][same_thread]] = h_sorted[1:][same_thread]
    temporary = has_free & (next_eid[a_eid] == free_eid)
    del next_eid, h_eid, h_sorted, same_thread

    def nullable(values: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
        dtype = np.uint32 if typ == pa.uint32() else np.uint64
        return pa.array(values.astype(dtype), type=typ, mask=~valid)

    at_alloc = pa.array(a_eid)
    size = events.column("size").take(at_alloc)
    table = pa.table(
        {
            "alloc_id": pa.array(np.arange(n_alloc, dtype=np.uint64)),
            "event_id": events.column("event_id").take(at_alloc),
            "pid": pa.array(col["pid"][a_eid]),
            "tid": pa.array(col["tid"][a_eid]),
            "ts": pa.array(a_ts),
            "kind": pa.array(kind[a_eid]),
            "allocator": events.column("allocator").take(at_alloc),
            "addr": pa.array(addr[a_eid]),
            "size": size,
            "stack_hash": events.column("stack_hash").take(at_alloc),
            "free_ts": nullable(free_ts, has_free, pa.uint64()),
            "free_event_id": nullable(free_eid, has_free, pa.uint64()),
            "free_tid": nullable(free_tid, has_free, pa.uint32()),
            "end_ts": pa.array(end_ts_a.astype(np.uint64)),
            "end_event_id": nullable(end_eid, has_end, pa.uint64()),
            "end_reason": pa.array(reason),
            "lifetime_ns": nullable(
                free_ts.astype(np.int64) - a_ts.astype(np.int64), has_free, pa.uint64()
            ),
            "realloc_of": nullable(realloc_of, realloc_of >= 0, pa.uint64()),
            "temporary": pa.array(temporary),
        },
        schema=ALLOCATIONS,
    )
    del free_ts, end_ts_a, free_tid, realloc_of, temporary, has_free, has_end, a_ts
    counters = {
        "allocations": n_alloc,
        "frees": len(f_eid),
        "reallocs": int(is_realloc_alloc.sum()),
        "frees_unmatched": unmatched_frees,
        "allocations_reused_without_free": int((reason == END_REUSED).sum()),
        "allocations_not_freed": int((reason >= END_EXEC).sum()),
        "failed_allocations": int((is_alloc_kind & (addr == 0)).sum()),
    }
    del a_mask, f_mask, r_mask, is_alloc_kind, is_realloc_alloc
    timeline = _heap_timeline(a_pid, a_eid, end_eid, size.to_numpy().astype(np.int64), ts)
    return Pairing(table, timeline, counters)


def _pair_ops(pid: np.ndarray, inst: np.ndarray, addr: np.ndarray, eid: np.ndarray,
              sub: np.ndarray, realloc_free: np.ndarray, op_index: np.ndarray,
              free_eid: np.ndarray, end_eid: np.ndarray, reason: np.ndarray) -> int:
    """Pair a set of operations holding every operation of their addresses: each
    allocation ends at the next operation on its (pid, instance, address), a free (or a
    realloc's free) or another allocation (reused). op_index: each operation's index
    among all (allocations first, so an allocation's index is its allocation index).
    Fills free_eid, end_eid and reason; returns the frees that end nothing."""
    # event order first (a free before the allocation of its event: the keys are
    # unique), then a stable sort by (pid, instance, address): one or two sorts, not five
    order = np.argsort(eid * 2 + sub)
    group = pid[order] * (int(inst.max(initial=0)) + 1) + inst[order]
    if len(group) and (group == group[0]).all():
        order = order[np.argsort(addr[order], kind="stable")]
    else:
        order = order[np.lexsort((addr[order], group))]
    del group
    s_eid, s_sub, s_rf = eid[order], sub[order], realloc_free[order]
    same_next = np.zeros(len(order), bool)
    if len(order) > 1:
        s_pid, s_inst, s_addr = pid[order], inst[order], addr[order]
        same_next[:-1] = (s_pid[1:] == s_pid[:-1]) & (s_inst[1:] == s_inst[:-1]) & (
            s_addr[1:] == s_addr[:-1])
        del s_pid, s_inst, s_addr
    is_a = s_sub == 1
    nxt = np.minimum(np.arange(len(order)) + 1, max(len(order) - 1, 0))
    freed = is_a & same_next & (s_sub[nxt] == 0)
    reused = is_a & same_next & (s_sub[nxt] == 1)

    # Frees that end nothing (block allocated before tracking, by an untracked
    # allocator, inherited across fork, or a double free).
    prev_is_alloc = np.zeros(len(order), bool)
    if len(order) > 1:
        prev_is_alloc[1:] = same_next[:-1] & is_a[:-1]
    unmatched = int(((~is_a) & ~prev_is_alloc).sum())

    ai = op_index[order][is_a]  # allocation index of each sorted alloc op
    f_rows = freed[is_a]
    u_rows = reused[is_a]
    nx_eid = s_eid[nxt][is_a]
    free_eid[ai[f_rows]] = nx_eid[f_rows]
    end_eid[ai[f_rows | u_rows]] = nx_eid[f_rows | u_rows]
    reason[ai[f_rows]] = np.where(s_rf[nxt][is_a][f_rows], END_REALLOC, END_FREE)
    reason[ai[u_rows]] = END_REUSED
    return unmatched


def _heap_timeline(a_pid: np.ndarray, a_eid: np.ndarray, end_eid: np.ndarray,
                   size: np.ndarray, ts: np.ndarray) -> pa.Table:
    """Heap bytes in use per process after each event that changed them: +size at the
    allocation, -size where its lifetime ended (free, realloc, exec, exit, reuse)."""
    ended = end_eid >= 0
    e = np.concatenate([a_eid, end_eid[ended]])
    if len(e) == 0:
        return HEAP_TIMELINE.empty_table()
    # one int64 key per change, (pid, event): the arrays below are the changes' few
    # columns, each freed once the next is made
    stride = int(e.max()) + 1
    key = np.concatenate([a_pid, a_pid[ended]]).astype(np.int64) * stride + e
    del e
    d = np.concatenate([size, -size[ended]])
    order = np.argsort(key, kind="stable")
    key, d = key[order], d[order]
    del order
    first = np.ones(len(key), bool)
    first[1:] = key[1:] != key[:-1]
    starts = np.flatnonzero(first)
    del first
    gkey, gd = key[starts], np.add.reduceat(d, starts)
    del key, d, starts
    gp, ge = gkey // stride, gkey % stride
    del gkey
    run = np.cumsum(gd)
    new_pid = np.ones(len(gp), bool)
    new_pid[1:] = gp[1:] != gp[:-1]
    pid_start = np.maximum.accumulate(np.where(new_pid, np.arange(len(gp)), 0))
    del new_pid
    heap = run - np.where(pid_start > 0, run[np.maximum(pid_start - 1, 0)], 0)
    del run, pid_start
    by_event = np.argsort(ge, kind="stable")
    return pa.table({
        "pid": pa.array(gp[by_event].astype(np.uint32)),
        "event_id": pa.array(ge[by_event].astype(np.uint64)),
        "ts": pa.array(ts[ge[by_event]]),
        "delta": pa.array(gd[by_event]),
        "heap_bytes": pa.array(heap[by_event]),
    }, schema=HEAP_TIMELINE)
