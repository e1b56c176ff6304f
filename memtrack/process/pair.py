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
  a free that was not recorded, counted);
- a free that ends nothing is unmatched (the block was allocated before tracking, by an
  untracked allocator, or inherited across fork), except glibc's own frees at thread
  exit (thread_exit_frees), counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from memtrack.process.lifecycle import Lifecycle
from memtrack.schema.enums import EndReason, EventKind
from memtrack.schema.stages import ALLOCATIONS, HEAP_TIMELINE

END_FREE, END_REALLOC, END_REUSED, END_EXEC, END_EXIT, END_END = EndReason

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
    col = {name: events.column(name).to_numpy() for name in (
        "event_id", "ts", "pid", "tid", "kind", "allocator", "flags", "addr", "old_addr",
        "size", "stack_hash")}  # fmt: skip
    kind = col["kind"]
    addr = col["addr"]
    old = col["old_addr"]
    pid = col["pid"].astype(np.int64)
    eid = np.arange(n, dtype=np.int64)
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
    a_eid, f_eid, r_eid = eid[a_mask], eid[f_mask], eid[r_mask]
    n_alloc = len(a_eid)

    # Operations: frees (sub 0) before the allocation (sub 1) of the same event.
    op_eid = np.concatenate([a_eid, f_eid, r_eid])
    op_addr = np.concatenate([addr[a_mask], addr[f_mask], old[r_mask]])
    op_sub = np.concatenate([np.ones(n_alloc, np.int8), np.zeros(len(f_eid) + len(r_eid),
                                                                 np.int8)])
    op_is_realloc_free = np.concatenate([np.zeros(n_alloc + len(f_eid), bool),
                                         np.ones(len(r_eid), bool)])
    op_pid = pid[op_eid]
    op_inst = instance(op_pid, op_eid)
    order = np.lexsort((op_sub, op_eid, op_addr, op_inst, op_pid))
    s_eid, s_addr, s_sub = op_eid[order], op_addr[order], op_sub[order]
    s_pid, s_inst, s_rf = op_pid[order], op_inst[order], op_is_realloc_free[order]
    s_alloc_index = order  # < n_alloc: index of the allocation (ops are allocs first)

    same_next = np.zeros(len(order), bool)
    if len(order) > 1:
        same_next[:-1] = (s_pid[1:] == s_pid[:-1]) & (s_inst[1:] == s_inst[:-1]) & (
            s_addr[1:] == s_addr[:-1])
    is_a = s_sub == 1
    nxt = np.minimum(np.arange(len(order)) + 1, max(len(order) - 1, 0))
    freed = is_a & same_next & (s_sub[nxt] == 0)
    reused = is_a & same_next & (s_sub[nxt] == 1)

    # Frees that end nothing (block allocated before tracking, by an untracked
    # allocator, inherited across fork, or a double free).
    prev_is_alloc = np.zeros(len(order), bool)
    if len(order) > 1:
        prev_is_alloc[1:] = same_next[:-1] & is_a[:-1]
    unmatched_free = (~is_a) & ~prev_is_alloc

    ai = s_alloc_index[is_a]  # allocation index of each sorted alloc op
    free_eid = np.full(n_alloc, -1, np.int64)
    end_eid = np.full(n_alloc, -1, np.int64)
    reason = np.full(n_alloc, END_END, np.uint8)
    f_rows = freed[is_a]
    u_rows = reused[is_a]
    nx_eid = s_eid[nxt][is_a]
    free_eid[ai[f_rows]] = nx_eid[f_rows]
    end_eid[ai[f_rows | u_rows]] = nx_eid[f_rows | u_rows]
    reason[ai[f_rows]] = np.where(s_rf[nxt][is_a][f_rows], END_REALLOC, END_FREE)
    reason[ai[u_rows]] = END_REUSED

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

    # temporary (heaptrack's definition, per thread): the thread's next allocator event
    # after the allocation is the one that freed it.
    heap_ev = (kind <= EventKind.FREE) & ((addr != 0) | (old != 0))
    h_eid = eid[heap_ev]
    h_order = np.lexsort((h_eid, col["tid"][heap_ev], pid[heap_ev]))
    h_sorted = h_eid[h_order]
    same_thread = (pid[h_sorted][1:] == pid[h_sorted][:-1]) & (
        col["tid"][h_sorted][1:] == col["tid"][h_sorted][:-1])
    next_eid = np.full(n, -1, np.int64)
    next_eid[h_sorted[:-1][same_thread]] = h_sorted[1:][same_thread]
    temporary = has_free & (next_eid[a_eid] == free_eid)

    def nullable(values: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
        dtype = np.uint32 if typ == pa.uint32() else np.uint64
        return pa.array(values.astype(dtype), type=typ, mask=~valid)

    table = pa.table(
        {
            "alloc_id": pa.array(np.arange(n_alloc, dtype=np.uint64)),
            "event_id": pa.array(col["event_id"][a_eid]),
            "pid": pa.array(col["pid"][a_eid]),
            "tid": pa.array(col["tid"][a_eid]),
            "ts": pa.array(a_ts),
            "kind": pa.array(kind[a_eid]),
            "allocator": pa.array(col["allocator"][a_eid]),
            "addr": pa.array(addr[a_eid]),
            "size": pa.array(col["size"][a_eid]),
            "stack_hash": pa.array(col["stack_hash"][a_eid]),
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
    prev_op = np.zeros(len(order), bool)  # an earlier op on the same block address
    if len(order) > 1:
        prev_op[1:] = same_next[:-1]
    lone = unmatched_free & ~s_rf
    at_exit = thread_exit_frees(s_eid[lone], prev_op[lone] & ~prev_is_alloc[lone],
                                col["pid"], col["tid"], kind, addr, life)
    counters = {
        "allocations": n_alloc,
        "frees": len(f_eid),
        "reallocs": int(is_realloc_alloc.sum()),
        "frees_unmatched": int(unmatched_free.sum()) - int(at_exit.sum()),
        "frees_at_thread_exit": int(at_exit.sum()),
        "allocations_reused_without_free": int((reason == END_REUSED).sum()),
        "allocations_not_freed": int((reason >= END_EXEC).sum()),
        "failed_allocations": int((is_alloc_kind & (addr == 0)).sum()),
    }
    timeline = _heap_timeline(a_pid, a_eid, end_eid, col["size"][a_eid].astype(np.int64), ts)
    return Pairing(table, timeline, counters)


def thread_exit_frees(free_eid: np.ndarray, freed_before: np.ndarray, pid: np.ndarray,
                      tid: np.ndarray, kind: np.ndarray, addr: np.ndarray,
                      life: Lifecycle) -> np.ndarray:
    """Which unmatched frees (events `free_eid`; `freed_before`: the block's last
    operation was a recorded free) are glibc's at thread exit.

    A thread other than the main one ends in __libc_thread_freeres ->
    tcache_thread_shutdown, which frees through the public `free` every chunk still in
    the thread's tcache (blocks the program freed already: freed again) and then the
    tcache itself (allocated inside malloc, never returned by a malloc call: never
    seen). So: after the thread's last allocation and before its exit, a free of a
    block freed before, or the thread's very last free of a block never seen."""
    n = len(kind)
    stride = n + 1
    t64 = tid.astype(np.int64)
    eid = np.arange(n, dtype=np.int64)

    def following(mask: np.ndarray, at: np.ndarray, side: str) -> np.ndarray:
        """For each event `at`, the next event of its thread in `mask` (n if none)."""
        keys = t64[mask] * stride + eid[mask]  # ascending: events are in time order
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        if not len(keys):
            return np.full(len(at), n, np.int64)
        j = np.searchsorted(keys, t64[at] * stride + at, side=side)
        jc = np.minimum(j, len(keys) - 1)
        hit = (j < len(keys)) & (keys[jc] // stride == t64[at])
        return np.where(hit, keys[jc] % stride, n)

    at = free_eid.astype(np.int64)
    is_exit = np.zeros(n, bool)
    is_exit[life.exits["event_id"].to_numpy().astype(np.int64)] = True
    is_alloc = (kind >= EventKind.MALLOC) & (kind <= EventKind.ALIGNED_ALLOC)
    is_free = (kind == EventKind.FREE) & (addr != 0)
    exit_at = following(is_exit, at, "left")
    in_tail = (exit_at < n) & (following(is_alloc, at, "right") > exit_at) & (
        tid[at] != pid[at])
    last_free = following(is_free, at, "right") > exit_at
    return in_tail & (freed_before | last_free)


def _heap_timeline(a_pid: np.ndarray, a_eid: np.ndarray, end_eid: np.ndarray,
                   size: np.ndarray, ts: np.ndarray) -> pa.Table:
    """Heap bytes in use per process after each event that changed them: +size at the
    allocation, -size where its lifetime ended (free, realloc, exec, exit, reuse)."""
    ended = end_eid >= 0
    p = np.concatenate([a_pid, a_pid[ended]])
    e = np.concatenate([a_eid, end_eid[ended]])
    d = np.concatenate([size, -size[ended]])
    order = np.lexsort((e, p))
    p, e, d = p[order], e[order], d[order]
    if len(p) == 0:
        return HEAP_TIMELINE.empty_table()
    first = np.ones(len(p), bool)
    first[1:] = (p[1:] != p[:-1]) | (e[1:] != e[:-1])
    starts = np.flatnonzero(first)
    gp, ge, gd = p[starts], e[starts], np.add.reduceat(d, starts)
    run = np.cumsum(gd)
    new_pid = np.ones(len(gp), bool)
    new_pid[1:] = gp[1:] != gp[:-1]
    pid_start = np.maximum.accumulate(np.where(new_pid, np.arange(len(gp)), 0))
    before = np.where(pid_start > 0, run[np.maximum(pid_start - 1, 0)], 0)
    heap = run - before
    by_event = np.argsort(ge, kind="stable")
    return pa.table({
        "pid": pa.array(gp[by_event].astype(np.uint32)),
        "event_id": pa.array(ge[by_event].astype(np.uint64)),
        "ts": pa.array(ts[ge[by_event]]),
        "delta": pa.array(gd[by_event]),
        "heap_bytes": pa.array(heap[by_event]),
    }, schema=HEAP_TIMELINE)
