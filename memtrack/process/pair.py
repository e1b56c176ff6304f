"""Pairing allocations with the frees that end them, vectorized with numpy.

Rules (docs/DESIGN.md, Process):
- every event of an allocation kind with a non-null address is one allocation;
- a realloc is the free of its old block (old_addr) followed, in the same event, by a
  new allocation linked to the old one (`realloc_of`);
- a forked child that allocates or frees before its exec or exit inherits a copy of
  every block alive in its parent at the fork (`inherited_from`: the parent's block):
  its frees end the copies, the parent's frees the originals;
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
from memtrack.schema.enums import CLONE_VM, EndReason, EventKind
from memtrack.schema.stages import ALLOCATIONS, HEAP_TIMELINE

END_FREE, END_REALLOC, END_REUSED, END_EXEC, END_EXIT, END_END = EndReason
BUCKET_OPS = 1 << 20  # blocks and frees matched at a time (by address)

@dataclass
class Pairing:
    allocations: pa.Table  # ALLOCATIONS: the allocations in event order, then the copies
    heap_timeline: pa.Table  # HEAP_TIMELINE: heap bytes per process after each change
    counters: dict[str, int] = field(default_factory=dict)


def pair(events: pa.Table, life: Lifecycle, end_ts: int | None = None) -> Pairing:
    """Pair the allocations and frees of `events` (time-ordered, memtrack.process.read) within
    the process lives of `life` (memtrack.process.lifecycle of the same events).

    `end_ts` is the capture's end (CLOCK_MONOTONIC ns); the last event's time if None.
    """
    n = events.num_rows
    # Columns read at every event as numpy; the others are only taken at the blocks.
    col = {name: events.column(name).to_numpy() for name in (
        "ts", "pid", "tid", "kind", "addr", "old_addr")}  # fmt: skip
    kind = col["kind"]
    addr = col["addr"]
    old = col["old_addr"]
    pid = col["pid"].astype(np.int64)
    if end_ts is None or (n and end_ts < int(col["ts"][-1])):
        end_ts = int(col["ts"][-1]) if n else 0

    is_alloc_kind = (kind >= EventKind.MALLOC) & (kind <= EventKind.ALIGNED_ALLOC)
    a_eid = np.flatnonzero(is_alloc_kind & (addr != 0))
    f_eid = np.flatnonzero((kind == EventKind.FREE) & (addr != 0))
    r_eid = np.flatnonzero((kind == EventKind.REALLOC) & (old != 0))
    n_alloc, n_free = len(a_eid), len(f_eid)
    failed = int((is_alloc_kind & (addr == 0)).sum())
    del is_alloc_kind
    m = _Matcher(life, n, pid)
    m.frees(np.concatenate([f_eid, r_eid]), np.concatenate([addr[f_eid], old[r_eid]]),
            np.concatenate([np.zeros(n_free, bool), np.ones(len(r_eid), bool)]))
    del f_eid, r_eid
    m.allocations(a_eid, pid[a_eid], addr[a_eid])
    m.inherit(life.forks)
    lone = ~m.f_matched & ~m.f_rf
    at_exit = int(thread_exit_frees(m.f_ev[lone], m.f_after_free[lone], col["pid"],
                                    col["tid"], kind, addr, life).sum())
    frees_unmatched = int((~m.f_matched).sum()) - at_exit
    del lone

    # The allocations in event order, then the copies forked children inherited (in
    # fork order): the rows and their alloc_id.
    b = m.gathered()
    del m
    nb = len(b.ev)
    b_ev, b_pid, end_eid, free_eid, reason = b.ev, b.pid, b.end, b.free, b.reason
    src = b.src  # the block each copies, -1 for an allocation
    inherited = src >= 0
    n_inherited = int(inherited.sum())
    # the allocation each block is or copies (index into a_eid)
    o_eid = a_eid[b.origin] if n_inherited else a_eid
    del b

    ts = col["ts"]
    b_ts = ts[b_ev]
    has_free = free_eid >= 0
    has_end = end_eid >= 0
    free_ts = np.where(has_free, ts[np.where(has_free, free_eid, 0)], 0)
    end_ts_a = np.where(has_end, ts[np.where(has_end, end_eid, 0)], np.uint64(end_ts))
    free_tid = np.where(has_free, col["tid"][np.where(has_free, free_eid, 0)], 0)

    # realloc_of: the block a realloc event freed.
    realloc_of = np.full(nb, -1, np.int64)
    by_free_event = np.full(n, -1, np.int64)
    rr = reason == END_REALLOC
    by_free_event[free_eid[rr]] = np.flatnonzero(rr)
    is_realloc_alloc = (kind[b_ev] == EventKind.REALLOC) & ~inherited
    realloc_of[is_realloc_alloc] = by_free_event[b_ev[is_realloc_alloc]]
    n_realloc = int(is_realloc_alloc.sum())
    del by_free_event, rr, is_realloc_alloc

    # temporary (heaptrack's definition, per thread): the thread's next allocator event
    # after the allocation is the one that freed it.
    h_eid = np.flatnonzero((kind <= EventKind.FREE) & ((addr != 0) | (old != 0)))
    thread = pid[h_eid].astype(np.uint64) << np.uint64(32) | col["tid"][h_eid]
    h_order = np.argsort(thread, kind="stable")  # by thread, each in event order
    h_sorted = h_eid[h_order]
    thread = thread[h_order]
    same_thread = thread[1:] == thread[:-1]
    del thread, h_order, h_eid
    next_eid = np.full(n, -1, np.int64)
    next_eid[h_sorted[:-1][same_thread]] = h_sorted[1:][same_thread]
    del h_sorted, same_thread
    temporary = has_free & ~inherited & (next_eid[b_ev] == free_eid)
    del next_eid

    def nullable(values: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
        dtype = np.uint32 if typ == pa.uint32() else np.uint64
        return pa.array(values.astype(dtype), type=typ, mask=~valid)

    at_block, at_origin = pa.array(b_ev), pa.array(o_eid)
    size = events.column("size").take(at_origin)
    table = pa.table(
        {
            "alloc_id": pa.array(np.arange(nb, dtype=np.uint64)),
            "event_id": events.column("event_id").take(at_block),
            "pid": pa.array(b_pid.astype(np.uint32)),
            "tid": pa.array(np.where(inherited, b_pid, col["tid"][b_ev]).astype(np.uint32)),
            "ts": pa.array(b_ts),
            "kind": pa.array(kind[o_eid]),
            "allocator": events.column("allocator").take(at_origin),
            "addr": pa.array(addr[o_eid]),
            "size": size,
            "stack_hash": events.column("stack_hash").take(at_origin),
            "free_ts": nullable(free_ts, has_free, pa.uint64()),
            "free_event_id": nullable(free_eid, has_free, pa.uint64()),
            "free_tid": nullable(free_tid, has_free, pa.uint32()),
            "end_ts": pa.array(end_ts_a.astype(np.uint64)),
            "end_event_id": nullable(end_eid, has_end, pa.uint64()),
            "end_reason": pa.array(reason),
            "lifetime_ns": nullable(
                free_ts.astype(np.int64) - b_ts.astype(np.int64), has_free, pa.uint64()
            ),
            "realloc_of": nullable(realloc_of, realloc_of >= 0, pa.uint64()),
            "temporary": pa.array(temporary),
            "inherited_from": nullable(src, inherited, pa.uint64()),
        },
        schema=ALLOCATIONS,
    )
    del free_ts, end_ts_a, free_tid, realloc_of, temporary, has_free, has_end, b_ts
    del at_block, at_origin, o_eid, src
    counters = {
        "allocations": n_alloc,
        "allocations_inherited": n_inherited,
        "frees": n_free,
        "reallocs": n_realloc,
        "frees_unmatched": frees_unmatched,
        "frees_at_thread_exit": at_exit,
        "allocations_reused_without_free": int((reason == END_REUSED).sum()),
        "allocations_not_freed": int((reason[~inherited] >= END_EXEC).sum()),
        "failed_allocations": failed,
    }
    del inherited, reason, free_eid, col, kind, addr, old, pid  # the timeline needs ts
    timeline = _heap_timeline(b_pid, b_ev, end_eid, size.to_numpy().astype(np.int64), ts)
    return Pairing(table, timeline, counters)


@dataclass
class _Blocks:
    """Blocks to match: the allocations, or the copies one child inherits at one fork;
    `base` is the index of the first among all (allocations first, then the copies in
    the order they were made)."""

    ev: np.ndarray  # event index where the block starts in its process
    pid: np.ndarray
    addr: np.ndarray
    inst: np.ndarray  # process instance (_Matcher.instance)
    src: np.ndarray  # index of the block copied, -1 for an allocation
    origin: np.ndarray  # index of the allocation copied (itself for an allocation)
    base: int
    end: np.ndarray = field(init=False)  # event index where the block's life ends, -1
    free: np.ndarray = field(init=False)  # event index of the free that ended it, -1
    reason: np.ndarray = field(init=False)  # EndReason

    def __post_init__(self) -> None:
        self.end = np.full(len(self.ev), -1, np.int64)
        self.free = np.full(len(self.ev), -1, np.int64)
        self.reason = np.full(len(self.ev), END_END, np.uint8)


class _Matcher:
    """Blocks (allocations, and the copies a forked child inherits) matched with the
    frees that end them, process life by process life.

    A block's life in its process ends at the first later free of its address in the
    same process instance (a process instance is bounded by fork: a child starts,
    exec and exit), or where that address is handed out again (`reused`: a free that
    was not recorded), else at the instance's next exec or exit (a leak), else at the
    capture's end. Events are indexed by their position."""

    def __init__(self, life: Lifecycle, n: int, pid: np.ndarray) -> None:
        forks, execs, exits = life.forks, life.execs, life.process_exits
        b_pid = np.concatenate([forks["child"].to_numpy(), execs["pid"].to_numpy(),
                                exits["pid"].to_numpy()]).astype(np.int64)
        b_eid = np.concatenate([forks["event_id"].to_numpy(), execs["event_id"].to_numpy(),
                                exits["event_id"].to_numpy()]).astype(np.int64)
        b_reason = np.concatenate([
            np.full(forks.num_rows, END_EXIT), np.full(execs.num_rows, END_EXEC),
            np.full(exits.num_rows, END_EXIT)])  # fmt: skip
        self.stride = n + 1
        key = b_pid * self.stride + b_eid
        order = np.argsort(key, kind="stable")
        self.bound_key, self.bound_pid = key[order], b_pid[order]
        self.bound_eid, self.bound_reason = b_eid[order], b_reason[order]
        self.n, self.pid = n, pid
        self.groups = len(key) + 1  # instances of a process are fewer: (pid, instance) key
        self.copies: dict[int, list[_Blocks]] = {}  # child pid -> its copies, by fork
        self.chunks: list[_Blocks] = []  # every copy, in the order made

    def instance(self, p: np.ndarray, e: np.ndarray) -> np.ndarray:
        """How many boundaries of process p came at or before event e."""
        return np.searchsorted(self.bound_key, p * self.stride + e, side="right") - \
            np.searchsorted(self.bound_key, p * self.stride, side="left")

    def next_boundary(self, p: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Index into the boundaries of process p's first one after event e, -1: none."""
        if not len(self.bound_key):
            return np.full(len(p), -1, np.int64)
        j = np.searchsorted(self.bound_key, p * self.stride + e, side="right")
        jc = np.minimum(j, len(self.bound_key) - 1)
        return np.where((j < len(self.bound_key)) & (self.bound_pid[jc] == p), jc, -1)

    def frees(self, ev: np.ndarray, addr: np.ndarray, by_realloc: np.ndarray) -> None:
        self.f_ev, self.f_addr, self.f_rf = ev, addr, by_realloc
        self.f_pid = self.pid[ev]
        self.f_inst = self.instance(self.f_pid, ev)
        self.f_matched = np.zeros(len(ev), bool)
        self.f_after_free = np.zeros(len(ev), bool)  # the address's last op was a free

    def allocations(self, ev: np.ndarray, pid: np.ndarray, addr: np.ndarray) -> None:
        n = len(ev)
        self.real = _Blocks(ev, pid, addr, self.instance(pid, ev), np.full(n, -1, np.int64),
                            np.arange(n, dtype=np.int64), 0)
        self.size = n
        self.by_pid: np.ndarray | None = None  # made by of_pid, only for forks
        self.match([(self.real, None)], np.arange(len(self.f_ev)))

    def of_pid(self, p: int) -> tuple[list[tuple[_Blocks, np.ndarray]], np.ndarray]:
        """The blocks of process p (its allocations and copies) and its frees."""
        if self.by_pid is None:
            self.by_pid = np.lexsort((self.real.ev, self.real.pid))
            self.pid_sorted = self.real.pid[self.by_pid]
            self.f_by_pid = np.lexsort((self.f_ev, self.f_pid))
            self.f_pid_sorted = self.f_pid[self.f_by_pid]
        lo, hi = np.searchsorted(self.pid_sorted, [p, p + 1])
        parts = [(self.real, self.by_pid[lo:hi])]
        parts += [(c, np.arange(len(c.ev))) for c in self.copies.get(p, [])]
        flo, fhi = np.searchsorted(self.f_pid_sorted, [p, p + 1])
        return parts, self.f_by_pid[flo:fhi]

    def match(self, parts: list[tuple[_Blocks, np.ndarray | None]], frees: np.ndarray) -> None:
        """Match these blocks (an index into each, None: all of it) with these frees
        (all of their processes' ones). The operations of one address all fall in one
        bucket: the buckets match independently, and their sorts hold a bucket's
        operations, not all of them, at a time."""
        def gather(name: str) -> np.ndarray:
            if len(parts) == 1 and parts[0][1] is None:
                return getattr(parts[0][0], name)  # the whole of one: no copy
            return np.concatenate([getattr(blk, name)[slice(None) if i is None else i]
                                   for blk, i in parts])

        b_pid, b_inst, b_addr, b_ev = (gather(name) for name in ("pid", "inst", "addr", "ev"))
        nb = len(b_ev)
        end = np.full(nb, -1, np.int64)
        free = np.full(nb, -1, np.int64)
        reason = np.full(nb, END_END, np.uint8)
        buckets = max(1, (nb + len(frees)) // BUCKET_OPS)
        if buckets == 1:
            self.match_ops(b_pid, b_inst, b_addr, b_ev, np.arange(nb), frees, end, free, reason)
        else:
            b_bucket = ((b_addr >> np.uint64(4)) % np.uint64(buckets)).astype(np.int32)
            f_bucket = ((self.f_addr[frees] >> np.uint64(4)) % np.uint64(buckets)).astype(
                np.int32)
            for k in range(buckets):
                bi = np.flatnonzero(b_bucket == k)
                self.match_ops(b_pid[bi], b_inst[bi], b_addr[bi], b_ev[bi], bi,
                               frees[f_bucket == k], end, free, reason)
                del bi
            del b_bucket, f_bucket
        # Never freed: bounded by the next exec/exit of the process instance, if any.
        open_ = np.flatnonzero(end < 0)
        j = self.next_boundary(b_pid[open_], b_ev[open_])
        hit = j >= 0
        end[open_[hit]] = self.bound_eid[j[hit]]
        reason[open_[hit]] = self.bound_reason[j[hit]]
        del open_, j, hit
        o = 0
        for blk, i in parts:
            if i is None:
                blk.end, blk.free, blk.reason = end, free, reason
                continue
            blk.end[i], blk.free[i], blk.reason[i] = (
                end[o:o + len(i)], free[o:o + len(i)], reason[o:o + len(i)])
            o += len(i)

    def match_ops(self, b_pid: np.ndarray, b_inst: np.ndarray, b_addr: np.ndarray,
                  b_ev: np.ndarray, b_ref: np.ndarray, frees: np.ndarray, end: np.ndarray,
                  free: np.ndarray, reason: np.ndarray) -> None:
        """Match blocks with frees that hold every operation of their addresses: each
        block ends at the next operation on its (pid, instance, address), a free (or a
        realloc's free) or another block (reused). b_ref: each block's index into end,
        free and reason, which this fills, with f_matched and f_after_free."""
        nb = len(b_ev)
        op_ev = np.concatenate([b_ev, self.f_ev[frees]])
        op_sub = np.concatenate([np.ones(nb, np.int8), np.zeros(len(frees), np.int8)])
        # event order first (a free before the block of its event), then a stable sort
        # by (pid, instance, address): one or two sorts, not five
        order = np.argsort(op_ev * 2 + op_sub, kind="stable")
        s_ev, s_sub = op_ev[order], op_sub[order]
        del op_ev, op_sub
        group = np.concatenate([b_pid * self.groups + b_inst,
                                self.f_pid[frees] * self.groups + self.f_inst[frees]])[order]
        s_addr = np.concatenate([b_addr, self.f_addr[frees]])[order]
        if len(group) and (group == group[0]).all():
            by = np.argsort(s_addr, kind="stable")
        else:
            by = np.lexsort((s_addr, group))
        order, s_ev, s_sub, group, s_addr = order[by], s_ev[by], s_sub[by], group[by], s_addr[by]
        del by
        s_ref = np.concatenate([b_ref, frees])[order]
        del order
        k = len(s_ev)
        same_next = np.zeros(k, bool)
        if k > 1:
            same_next[:-1] = (group[1:] == group[:-1]) & (s_addr[1:] == s_addr[:-1])
        del group, s_addr
        is_a = s_sub == 1
        nxt = np.minimum(np.arange(k) + 1, max(k - 1, 0))
        freed = is_a & same_next & (s_sub[nxt] == 0)
        reused = is_a & same_next & (s_sub[nxt] == 1)
        # Frees that end nothing (block allocated before tracking, by an untracked
        # allocator, inherited across a vfork, or a double free).
        prev_is_alloc = np.zeros(k, bool)
        prev_free = np.zeros(k, bool)
        if k > 1:
            prev_is_alloc[1:] = same_next[:-1] & is_a[:-1]
            prev_free[1:] = same_next[:-1] & ~is_a[:-1]
        self.f_matched[s_ref[~is_a]] = prev_is_alloc[~is_a]
        self.f_after_free[s_ref[~is_a]] = prev_free[~is_a]
        del prev_is_alloc, prev_free, same_next
        b = s_ref[is_a]
        f_rows, u_rows = freed[is_a], reused[is_a]
        nx_ev = s_ev[nxt][is_a]
        free[b[f_rows]] = nx_ev[f_rows]
        end[b[f_rows | u_rows]] = nx_ev[f_rows | u_rows]
        reason[b[f_rows]] = np.where(self.f_rf[s_ref[nxt][is_a][f_rows]], END_REALLOC,
                                     END_FREE)
        reason[b[u_rows]] = END_REUSED

    def inherit(self, forks: pa.Table) -> None:
        """A forked child (not a vfork: CLONE_VM shares the parent's memory) gets a copy
        of every block alive in its parent at the fork, in its own heap: its frees end
        those copies, the parent's end the parent's blocks. Only a child that allocates
        or frees before its exec or exit inherits (a fork + exec child's copy of its
        parent's heap is never used: listing it would put the parent's heap in every
        such child's peak and leaks). Forks go in event order, each child matched
        again with its copies, so that a grandchild inherits its parent's copies as
        they were at its own fork."""
        if forks.num_rows == 0:
            return
        fv = forks.filter(pa.array((forks["flags"].to_numpy() & CLONE_VM) == 0))
        f_ev = fv["event_id"].to_numpy().astype(np.int64)
        parent = fv["parent"].to_numpy().astype(np.int64)
        child = fv["child"].to_numpy().astype(np.int64)
        # the child's heap events before its next boundary (exec, exit, a reused pid)
        j = self.next_boundary(child, f_ev)
        until = np.where(j >= 0, self.bound_eid[np.maximum(j, 0)], self.n)
        h_key = np.sort(np.concatenate([self.real.pid * self.stride + self.real.ev,
                                        self.f_pid * self.stride + self.f_ev]))
        busy = np.searchsorted(h_key, child * self.stride + until, side="left") > \
            np.searchsorted(h_key, child * self.stride + f_ev, side="right")
        for e, p, c in zip(f_ev[busy].tolist(), parent[busy].tolist(), child[busy].tolist(),
                           strict=True):
            parts, _ = self.of_pid(p)
            alive = [(blk, i[(blk.ev[i] < e) & ((blk.end[i] < 0) | (blk.end[i] > e))])
                     for blk, i in parts]
            k = sum(len(i) for _, i in alive)
            if not k:
                continue
            copy = _Blocks(
                np.full(k, e, np.int64), np.full(k, c, np.int64),
                np.concatenate([blk.addr[i] for blk, i in alive]),
                self.instance(np.full(k, c, np.int64), np.full(k, e, np.int64)),
                np.concatenate([blk.base + i for blk, i in alive]),
                np.concatenate([blk.origin[i] for blk, i in alive]), self.size)
            self.size += k
            self.chunks.append(copy)
            self.copies.setdefault(c, []).append(copy)
            self.match(*self.of_pid(c))

    def gathered(self) -> _Blocks:
        """Every block, the allocations first, then the copies in the order made."""
        if not self.chunks:
            return self.real
        every = [self.real, *self.chunks]
        out = _Blocks(*(np.concatenate([getattr(b, f) for b in every])
                        for f in ("ev", "pid", "addr", "inst", "src", "origin")), 0)
        out.end = np.concatenate([b.end for b in every])
        out.free = np.concatenate([b.free for b in every])
        out.reason = np.concatenate([b.reason for b in every])
        return out


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
    at = free_eid.astype(np.int64)
    if not len(at):
        return np.zeros(0, bool)
    at_key = tid[at].astype(np.int64) * stride + at

    def following(mask: np.ndarray, side: str) -> np.ndarray:
        """For each event `at`, the next event of its thread in `mask` (n if none)."""
        idx = np.flatnonzero(mask)
        keys = tid[idx].astype(np.int64) * stride + idx
        keys.sort(kind="stable")
        del idx
        if not len(keys):
            return np.full(len(at), n, np.int64)
        j = np.searchsorted(keys, at_key, side=side)
        jc = np.minimum(j, len(keys) - 1)
        hit = (j < len(keys)) & (keys[jc] // stride == at_key // stride)
        return np.where(hit, keys[jc] % stride, n)

    is_exit = np.zeros(n, bool)
    is_exit[life.exits["event_id"].to_numpy().astype(np.int64)] = True
    exit_at = following(is_exit, "left")
    del is_exit
    in_tail = (exit_at < n) & (following(
        (kind >= EventKind.MALLOC) & (kind <= EventKind.ALIGNED_ALLOC), "right") > exit_at) & (
        tid[at] != pid[at])
    last_free = following((kind == EventKind.FREE) & (addr != 0), "right") > exit_at
    return in_tail & (freed_before | last_free)


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
    key = np.concatenate([a_pid, a_pid[ended]]).astype(np.int64, copy=False)
    key *= stride
    key += e
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
    # in event order (already so with one process)
    by_event = np.argsort(ge, kind="stable") if gp[0] != gp[-1] else slice(None)
    return pa.table({
        "pid": pa.array(gp[by_event].astype(np.uint32)),
        "event_id": pa.array(ge[by_event].astype(np.uint64)),
        "ts": pa.array(ts[ge[by_event]]),
        "delta": pa.array(gd[by_event]),
        "heap_bytes": pa.array(heap[by_event]),
    }, schema=HEAP_TIMELINE)
