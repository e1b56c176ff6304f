"""Matching: blocks (the allocations, and the blocks forked children inherit) with the
frees that end them, image by image (memtrack.process.lifecycle.Images), one bucket of
heap operations (memtrack.process.spill) at a time; the rules are memtrack.process.pair's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.process.lifecycle import Images
from memtrack.process.lookup import group_bounds, key_bounds
from memtrack.process.spill import OPS, OPS_PER_BUCKET
from memtrack.process.streams import Stream, as_pieces
from memtrack.schema.enums import EndReason, EventKind
from memtrack.schema.stages import ALLOCATIONS

if TYPE_CHECKING:
    from memtrack.process.inherit import Forks

END_FREE, END_REALLOC, END_REUSED, END_EXEC, END_EXIT, END_END = EndReason
BUCKET_OPS = 1 << 20  # blocks and frees sorted at a time within a bucket (by address)

# A bucket's rows: ALLOCATIONS without what crosses buckets; an inherited block has no
# alloc_id yet but the key it is made from: the fork that made it (its index among the
# forks whose children inherit, in event order), its generation (1: inherited from the
# parent's own allocation) and the allocation it descends from (origin); one inherited
# from an inherited block names the fork that made its source (src_fork).
BLOCK_ROWS = pa.schema([
    ("alloc_id", pa.uint64()), *[f for f in ALLOCATIONS if f.name not in (
        "alloc_id", "realloc_of", "inherited_from")],
    ("fork", pa.int64()), ("gen", pa.int32()), ("origin", pa.uint64()),
    ("src_fork", pa.int64()),
])  # fmt: skip


def allocation_rows(t: pa.Table, realloc_of: pa.Array, inherited_from: pa.Array) -> pa.Table:
    cols = {name: t.column(name) for name in ALLOCATIONS.names
            if name not in ("realloc_of", "inherited_from")}
    cols["realloc_of"], cols["inherited_from"] = realloc_of, inherited_from
    return pa.table({name: cols[name] for name in ALLOCATIONS.names}, schema=ALLOCATIONS)



def matched(stream: Stream, images: Images, forks: Forks, exits: np.ndarray,
             end_ts: int) -> Iterator[tuple[pa.Table, dict[str, int]]]:
    """The BLOCK_ROWS of one bucket and their counters: matched whole when children
    inherit (the inherited blocks need their parent's whole history), else a piece of time at a
    time (about OPS_PER_BUCKET operations: an address handed out again and again, as a
    malloc/free loop's, is in one bucket however many its operations), the blocks still
    open and each address's last free carried from one piece to the next."""
    if len(forks.ev) or stream.rows <= 2 * OPS_PER_BUCKET:
        ops = stream.table()
        stream.remove()
        if ops.num_rows:
            rows, got, _ = match_bucket(ops, images, forks, exits, end_ts)
            yield rows, got
        return
    carry = OPS.empty_table()
    pieces = as_pieces(stream.batches(), OPS, OPS_PER_BUCKET)  # the batches are in time order
    piece = next(pieces, None)
    while piece is not None:
        after = next(pieces, None)
        until = None if after is None else int(pc.min(after.column("event_id")).as_py())
        rows, got, carry = match_bucket(pa.concat_tables([carry, piece]), images, forks,
                                         exits, end_ts, carried=carry.num_rows, until=until)
        yield rows, got
        piece = after
    stream.remove()


def match_bucket(ops: pa.Table, images: Images, forks: Forks, exits: np.ndarray,
                  end_ts: int, carried: int = 0, until: int | None = None
                  ) -> tuple[pa.Table, dict[str, int], pa.Table]:
    """The BLOCK_ROWS of one bucket's operations (memtrack.process.spill.OPS), its
    counters, and what the next piece of time needs (OPS rows). Matched a piece at a time
    (no forks whose children inherit): the first `carried` rows are the previous piece's
    open blocks and last frees, `until` the next piece's first event (None: the last);
    a block still open that may end after it is carried on, not a row yet."""
    col = {c: ops.column(c).to_numpy() for c in (
        "event_id", "pid", "tid", "ts", "kind", "addr", "alloc_id", "prev")}  # fmt: skip
    ev, is_block = col["event_id"], col["alloc_id"] >= 0
    bi = np.flatnonzero(is_block)
    bi = bi[np.argsort(ev[bi], kind="stable")]
    fi = np.flatnonzero(~is_block)
    fi = fi[np.argsort(ev[fi], kind="stable")]
    f_ev, f_rf = ev[fi], col["kind"][fi] == EventKind.REALLOC
    old_f = fi < carried  # a carried free: its address's last operation so far
    m = Matcher(images, f_ev, col["pid"][fi], col["addr"][fi], f_rf)
    m.allocations(ev[bi], col["pid"][bi], col["addr"][bi])
    m.inherit(forks)
    lone = ~m.f_matched & ~f_rf & ~old_f
    at_exit = _thread_exit_frees(f_ev[lone], m.f_after_free[lone], col["tid"][fi][lone],
                                 col["pid"][fi][lone], exits)
    # a free of an address no operation of the run touched, in a heap older than the run
    unknown = ~m.f_after_free[lone] & ~at_exit & images.before_attach(
        col["pid"][fi][lone], m.f_image[lone])
    counters = {"frees_unmatched": int((~m.f_matched & ~old_f).sum()),
                "frees_at_thread_exit": int(at_exit.sum()),
                "frees_before_attach": int(unknown.sum())}
    del lone
    b, fork = m.gathered()
    nr = len(bi)
    final = np.ones(len(b.ev), bool)
    carry = ops.slice(0, 0)
    if until is not None:  # the blocks that may end after this piece, the last frees
        final = (b.free >= 0) | (b.reason == END_REUSED) | ((b.end >= 0) & (b.end < until))
        j = images.next_boundary(col["pid"][fi], f_ev)
        goes_on = j < 0  # no boundary ends the free's image, or one after
        if len(images.eid):
            goes_on |= images.eid[np.maximum(j, 0)] >= until
        live = m.f_last & goes_on
        carry = ops.take(pa.array(np.concatenate([bi[~final], fi[live]])))
    del m
    inherited = b.src >= 0
    o = bi[b.origin]  # each block's allocation, as a row of ops
    # an event's time: the frees', the allocations', the boundaries' and the forks'
    t_key = np.concatenate([f_ev, ev[bi], images.eid, forks.ev])
    t_val = np.concatenate([col["ts"][fi], col["ts"][bi], images.ts, forks.ts])
    t_key, first = np.unique(t_key, return_index=True)
    t_val = t_val[first]

    def ts_of(e: np.ndarray) -> np.ndarray:
        return t_val[np.searchsorted(t_key, e)]

    b_ts = np.where(inherited, ts_of(b.ev), col["ts"][o])
    has_free, has_end = b.free >= 0, b.end >= 0
    free_ts = np.where(has_free, ts_of(np.where(has_free, b.free, t_key[0])), 0)
    end_ts_a = np.where(has_end, ts_of(np.where(has_end, b.end, t_key[0])), np.uint64(end_ts))
    at_free = np.searchsorted(f_ev, np.where(has_free, b.free, 0))
    at_free = np.minimum(at_free, max(len(fi) - 1, 0))
    free_tid = np.where(has_free, col["tid"][fi][at_free] if len(fi) else 0, 0)
    temporary = has_free & ~inherited & (col["prev"][fi][at_free] == b.ev if len(fi)
                                         else False)
    # a prelude's blocks (its own and those it inherited) are in no process's figures
    kept = final & ~images.in_prelude(b.pid, b.ev)
    counters.update({
        "allocations_inherited": int((inherited & kept).sum()),
        "allocations_before_exec": int((final[:nr] & ~kept[:nr]).sum()),
        "reallocs": int(((col["kind"][bi] == EventKind.REALLOC) & (bi >= carried)).sum()),
        "allocations_reused_without_free": int(((b.reason == END_REUSED) & final).sum()),
        "allocations_not_freed": int(((b.reason[:nr] >= END_EXEC) & kept[:nr]).sum()),
    })

    def nullable(values: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
        dtype = {pa.uint64(): np.uint64, pa.uint32(): np.uint32, pa.int64(): np.int64,
                 pa.int32(): np.int32}[typ]
        return pa.array(np.asarray(values).astype(dtype), type=typ, mask=~valid)

    at_origin = pa.array(o)
    rows = pa.table({
        "alloc_id": nullable(col["alloc_id"][o], ~inherited, pa.uint64()),
        "event_id": pa.array(b.ev.astype(np.uint64)),
        "pid": pa.array(b.pid.astype(np.uint32)),
        "tid": pa.array(np.where(inherited, b.pid, col["tid"][o]).astype(np.uint32)),
        "ts": pa.array(b_ts.astype(np.uint64)),
        "kind": pa.array(col["kind"][o]),
        "allocator": ops.column("allocator").take(at_origin),
        "addr": pa.array(col["addr"][o]),
        "size": ops.column("size").take(at_origin),
        "stack_hash": ops.column("stack_hash").take(at_origin),
        "free_ts": nullable(free_ts, has_free, pa.uint64()),
        "free_event_id": nullable(b.free, has_free, pa.uint64()),
        "free_tid": nullable(free_tid, has_free, pa.uint32()),
        "end_ts": pa.array(end_ts_a.astype(np.uint64)),
        "end_event_id": nullable(b.end, has_end, pa.uint64()),
        "end_reason": pa.array(b.reason),
        "lifetime_ns": nullable(free_ts.astype(np.int64) - b_ts.astype(np.int64), has_free,
                                pa.uint64()),
        "temporary": pa.array(np.asarray(temporary, bool)),
        "fork": nullable(fork, inherited, pa.int64()),
        "gen": nullable(b.gen, inherited, pa.int32()),
        "origin": nullable(col["alloc_id"][o], inherited, pa.uint64()),
        "src_fork": nullable(b.src_fork, b.gen > 1, pa.int64()),
    }, schema=BLOCK_ROWS)
    return (rows if kept.all() else rows.filter(pa.array(kept))), counters, carry


def _thread_exit_frees(free_eid: np.ndarray, freed_before: np.ndarray, tid: np.ndarray,
                       pid: np.ndarray, exits: np.ndarray) -> np.ndarray:
    """Which unmatched frees (events `free_eid`; `freed_before`: the block's last
    operation was a recorded free) are glibc's at thread exit.

    A thread other than the main one ends in __libc_thread_freeres ->
    tcache_thread_shutdown, which frees through the public `free` every chunk still in
    the thread's tcache (blocks the program freed already: freed again) and then the
    tcache itself (allocated inside malloc, never returned by a malloc call: never
    seen). So: after the thread's last allocation and before its exit, a free of a
    block freed before, or the thread's very last free of a block never seen.
    `exits`: memtrack.process.spill.EventSpill.exits."""
    if not len(free_eid) or not exits.shape[1]:
        return np.zeros(len(free_eid), bool)
    x_tid, x_eid, x_alloc, x_free = exits
    stride = int(max(x_eid.max(), free_eid.max())) + 1
    key = x_tid * stride + x_eid
    at = tid.astype(np.int64) * stride + free_eid
    j = np.searchsorted(key, at)  # the thread's next exit
    jc = np.minimum(j, len(key) - 1)
    hit = (j < len(key)) & (x_tid[jc] == tid)
    in_tail = hit & (x_alloc[jc] < free_eid) & (tid != pid)
    return in_tail & (freed_before | (x_free[jc] == free_eid))


@dataclass
class Blocks:
    """Blocks to match: the allocations, or the blocks one child inherits at one fork;
    `base` is the index of the first among all (allocations first, then the inherited in
    the order they were made)."""

    ev: np.ndarray  # event index where the block starts in its process
    pid: np.ndarray
    addr: np.ndarray
    image: np.ndarray  # the image of the block's pid (Images.image)
    src: np.ndarray  # index of the block copied, -1 for an allocation
    origin: np.ndarray  # index of the allocation copied (itself for an allocation)
    base: int
    gen: np.ndarray  # 0 for an allocation, else its source's + 1
    src_fork: np.ndarray  # the fork that made the block copied (-1: an allocation)
    fork: int = -1  # the fork that made these inherited blocks (-1: allocations)
    end: np.ndarray = field(init=False)  # event index where the block's lifetime ends, -1
    free: np.ndarray = field(init=False)  # event index of the free that ended it, -1
    reason: np.ndarray = field(init=False)  # EndReason

    def __post_init__(self) -> None:
        self.end = np.full(len(self.ev), -1, np.int64)
        self.free = np.full(len(self.ev), -1, np.int64)
        self.reason = np.full(len(self.ev), END_END, np.uint8)


class Matcher:
    """Blocks (allocations, and the blocks a forked child inherits) matched with the
    frees that end them, image by image.

    A block's lifetime ends at the first later free of its address in the same image
    (lifecycle.Images), or where that address is handed out again (`reused`: a free
    that was not recorded), else at the image's end: an exec or exit (a leak), else at
    the capture's end. Events are indexed by their position."""

    def __init__(self, images: Images, f_ev: np.ndarray, f_pid: np.ndarray,
                 f_addr: np.ndarray, by_realloc: np.ndarray) -> None:
        self.images = images
        self.inherited: dict[int, list[Blocks]] = {}  # child pid -> its inherited, by fork
        self.made: list[Blocks] = []  # every inherited block, in the order made
        self.f_ev, self.f_pid, self.f_addr, self.f_rf = f_ev, f_pid, f_addr, by_realloc
        self.f_image = images.image(f_pid, f_ev)
        self.f_matched = np.zeros(len(f_ev), bool)
        self.f_after_free = np.zeros(len(f_ev), bool)  # the address's last op was a free
        self.f_last = np.zeros(len(f_ev), bool)  # the last operation of its address

    def allocations(self, ev: np.ndarray, pid: np.ndarray, addr: np.ndarray) -> None:
        n = len(ev)
        self.real = Blocks(ev, pid, addr, self.images.image(pid, ev),
                            np.full(n, -1, np.int64), np.arange(n, dtype=np.int64), 0,
                            np.zeros(n, np.int32), np.full(n, -1, np.int64))
        self.size = n
        self.by_pid: np.ndarray | None = None  # made by of_pid, only for forks
        self.match([(self.real, None)], np.arange(len(self.f_ev)))

    def of_pid(self, p: int) -> tuple[list[tuple[Blocks, np.ndarray]], np.ndarray]:
        """The blocks of pid p (its allocations and inherited blocks) and its frees."""
        if self.by_pid is None:
            self.by_pid = np.lexsort((self.real.ev, self.real.pid))
            self.pid_sorted = self.real.pid[self.by_pid]
            self.f_by_pid = np.lexsort((self.f_ev, self.f_pid))
            self.f_pid_sorted = self.f_pid[self.f_by_pid]
        lo, hi = key_bounds(self.pid_sorted, p)
        parts = [(self.real, self.by_pid[lo:hi])]
        parts += [(c, np.arange(len(c.ev))) for c in self.inherited.get(p, [])]
        flo, fhi = key_bounds(self.f_pid_sorted, p)
        return parts, self.f_by_pid[flo:fhi]

    def match(self, parts: list[tuple[Blocks, np.ndarray | None]], frees: np.ndarray) -> None:
        """Match these blocks (an index into each, None: all of it) with these frees
        (all of their processes' ones). The operations of one address all fall in one
        bucket: the buckets match independently, and their sorts hold a bucket's
        operations, not all of them, at a time."""
        def gather(name: str) -> np.ndarray:
            if len(parts) == 1 and parts[0][1] is None:
                return getattr(parts[0][0], name)  # the whole of one: no copy
            return np.concatenate([getattr(blk, name)[slice(None) if i is None else i]
                                   for blk, i in parts])

        b_pid, b_image, b_addr, b_ev = (gather(name) for name in ("pid", "image", "addr", "ev"))
        nb = len(b_ev)
        end = np.full(nb, -1, np.int64)
        free = np.full(nb, -1, np.int64)
        reason = np.full(nb, END_END, np.uint8)
        buckets = max(1, (nb + len(frees)) // BUCKET_OPS)
        if buckets == 1:
            self.match_ops(b_pid, b_image, b_addr, b_ev, np.arange(nb), frees, end, free, reason)
        else:
            # by address (16-byte aligned), not by the spill's hash: that one's top bits
            # are the same for every address of the spill's bucket
            b_order, b_at = group_bounds(
                ((b_addr >> np.uint64(4)) % np.uint64(buckets)).astype(np.int32), buckets)
            f_order, f_at = group_bounds(
                ((self.f_addr[frees] >> np.uint64(4)) % np.uint64(buckets)).astype(np.int32),
                buckets)
            for k in range(buckets):
                bi = b_order[b_at[k]:b_at[k + 1]]
                self.match_ops(b_pid[bi], b_image[bi], b_addr[bi], b_ev[bi], bi,
                               frees[f_order[f_at[k]:f_at[k + 1]]], end, free, reason)
                del bi
            del b_order, f_order
        # Never freed: bounded by the end of the image, if any.
        open_ = np.flatnonzero(end < 0)
        j = self.images.next_boundary(b_pid[open_], b_ev[open_])
        hit = j >= 0
        end[open_[hit]] = self.images.eid[j[hit]]
        reason[open_[hit]] = self.images.reason[j[hit]]
        del open_, j, hit
        o = 0
        for blk, i in parts:
            if i is None:
                blk.end, blk.free, blk.reason = end, free, reason
                continue
            blk.end[i], blk.free[i], blk.reason[i] = (
                end[o:o + len(i)], free[o:o + len(i)], reason[o:o + len(i)])
            o += len(i)

    def match_ops(self, b_pid: np.ndarray, b_image: np.ndarray, b_addr: np.ndarray,
                  b_ev: np.ndarray, b_ref: np.ndarray, frees: np.ndarray, end: np.ndarray,
                  free: np.ndarray, reason: np.ndarray) -> None:
        """Match blocks with frees that hold every operation of their addresses: each
        block ends at the next operation on its (pid, image, address), a free (or a
        realloc's free) or another block (reused). b_ref: each block's index into end,
        free and reason, which this fills, with f_matched and f_after_free."""
        nb = len(b_ev)
        op_ev = np.concatenate([b_ev, self.f_ev[frees]])
        op_sub = np.concatenate([np.ones(nb, np.int8), np.zeros(len(frees), np.int8)])
        # event order first (a free before the block of its event), then a stable sort
        # by (pid, image, address): one or two sorts, not five
        order = np.argsort(op_ev * 2 + op_sub, kind="stable")
        s_ev, s_sub = op_ev[order], op_sub[order]
        del op_ev, op_sub
        groups = self.images.groups
        group = np.concatenate([b_pid * groups + b_image,
                                self.f_pid[frees] * groups + self.f_image[frees]])[order]
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
        self.f_last[s_ref[~is_a]] = ~same_next[~is_a]
        del prev_is_alloc, prev_free, same_next
        b = s_ref[is_a]
        f_rows, u_rows = freed[is_a], reused[is_a]
        nx_ev = s_ev[nxt][is_a]
        free[b[f_rows]] = nx_ev[f_rows]
        end[b[f_rows | u_rows]] = nx_ev[f_rows | u_rows]
        reason[b[f_rows]] = np.where(self.f_rf[s_ref[nxt][is_a][f_rows]], END_REALLOC,
                                     END_FREE)
        reason[b[u_rows]] = END_REUSED

    def inherit(self, forks: Forks) -> None:
        """A forked child (not a vfork: CLONE_VM shares the parent's memory) gets a blocks
        of every block alive in its parent at the fork, in its own heap: its frees end
        those, the parent's end the parent's blocks. Only a child that allocates
        or frees before its exec or exit inherits (`forks` are those: a fork + exec
        child's blocks of its parent's heap is never used: listing it would put the
        parent's heap in every such child's peak and leaks). Forks go in event order,
        each child matched again with its inherited blocks, so that a grandchild
        inherits its parent's inherited blocks as they were at its own fork."""
        for no, (e, p, c) in enumerate(zip(forks.ev.tolist(), forks.parent.tolist(),
                                           forks.child.tolist(), strict=True)):
            parts, _ = self.of_pid(p)
            alive = [(blk, i[(blk.ev[i] < e) & ((blk.end[i] < 0) | (blk.end[i] > e))])
                     for blk, i in parts]
            k = sum(len(i) for _, i in alive)
            if not k:
                continue
            blocks = Blocks(
                np.full(k, e, np.int64), np.full(k, c, np.int64),
                np.concatenate([blk.addr[i] for blk, i in alive]),
                self.images.image(np.full(k, c, np.int64), np.full(k, e, np.int64)),
                np.concatenate([blk.base + i for blk, i in alive]),
                np.concatenate([blk.origin[i] for blk, i in alive]), self.size,
                np.concatenate([blk.gen[i] + 1 for blk, i in alive]),
                np.concatenate([np.full(len(i), blk.fork, np.int64) for blk, i in alive]),
                no)
            self.size += k
            self.made.append(blocks)
            self.inherited.setdefault(c, []).append(blocks)
            self.match(*self.of_pid(c))

    def gathered(self) -> tuple[Blocks, np.ndarray]:
        """Every block, the allocations first, then the inherited blocks in the order made, and
        the fork that made each (-1: an allocation)."""
        every = [self.real, *self.made]
        fork = np.concatenate([np.full(len(b.ev), b.fork, np.int64) for b in every])
        if not self.made:
            return self.real, fork
        out = Blocks(*(np.concatenate([getattr(b, f) for b in every])
                        for f in ("ev", "pid", "addr", "image", "src", "origin")), 0,
                      *(np.concatenate([getattr(b, f) for b in every])
                        for f in ("gen", "src_fork")))
        out.end = np.concatenate([b.end for b in every])
        out.free = np.concatenate([b.free for b in every])
        out.reason = np.concatenate([b.reason for b in every])
        return out, fork


