"""Inherited blocks: a forked child's copies of the blocks alive in its parent at the
fork. Which forks' children inherit (`inheriting`: a copying fork whose child touches
its heap in the image the fork starts), and, once every bucket is matched, the
inherited blocks' rows and ids (`inherited_rows`, `InheritedIds`). The matcher
(memtrack.process.match) makes them, fork by fork.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memtrack.process.lifecycle import Images
from memtrack.process.lookup import find_sorted
from memtrack.process.match import BLOCK_ROWS, allocation_rows
from memtrack.schema.enums import CLONE_VM


@dataclass
class Forks:
    """The forks whose children inherit their parent's blocks, in event order."""

    ev: np.ndarray
    ts: np.ndarray
    parent: np.ndarray
    child: np.ndarray


def inheriting(forks: pa.Table, images: Images, t_pid: np.ndarray, t_ev: np.ndarray
               ) -> Forks:
    """The forks whose children inherit their parent's blocks: those that copy the
    address space (not a vfork: CLONE_VM shares it) and whose child touches its heap
    before the end of the image the fork starts (`t_pid`, `t_ev`: the heap operations
    EventSpill.heap_touches kept)."""
    ev = forks["event_id"].to_numpy().astype(np.int64)
    child = forks["child"].to_numpy().astype(np.int64)
    touches = np.sort(t_pid * images.stride + t_ev)
    j = images.next_boundary(child, ev)
    until = np.where(j >= 0, images.eid[np.maximum(j, 0)] if len(images.eid) else 0,
                     images.stride)
    first = np.searchsorted(touches, child * images.stride + ev, side="right")
    touched = first < len(touches)
    touched[touched] = touches[first[touched]] < child[touched] * images.stride + until[touched]
    keep = ((forks["flags"].to_numpy() & CLONE_VM) == 0) & touched
    parent = forks["parent"].to_numpy().astype(np.int64)
    return Forks(ev[keep], forks["ts"].to_numpy()[keep], parent[keep], child[keep])


def inherited_rows(parts: list[pa.Table], allocations: int) -> tuple[pa.Table, InheritedIds]:
    """The inherited blocks' ALLOCATIONS rows, by alloc_id (after the allocations: by
    fork, then generation, then the allocation copied), each inherited_from its source
    (the first generation: the parent's allocation; a later one: the inherited block it
    was copied from)."""
    t = pa.concat_tables([BLOCK_ROWS.empty_table(), *parts])
    fork, gen = t.column("fork").to_numpy(), t.column("gen").to_numpy()
    origin = t.column("origin").to_numpy()
    order = np.lexsort((origin, gen, fork))
    t, fork, gen, origin = t.take(pa.array(order)), fork[order], gen[order], origin[order]
    own = np.arange(allocations, allocations + len(fork), dtype=np.int64)
    ids = InheritedIds(fork, origin, own, allocations + 1)  # origin < allocations
    src = np.where(gen > 1, t.column("src_fork").fill_null(-1).to_numpy(), -1)
    parent = np.where(gen == 1, -1, ids.of(src, origin))
    # the first generation, or one inherited from a prelude's (in no table): the
    # allocation copied
    parent = np.where(parent < 0, origin.astype(np.int64), parent)
    t = t.set_column(0, "alloc_id", pa.array(own.astype(np.uint64)))
    return allocation_rows(t, pa.nulls(t.num_rows, pa.uint64()),
                            pa.array(parent.astype(np.uint64))), ids


class InheritedIds:
    """The inherited blocks' ids by key (fork, origin): fork * stride + origin, sorted."""

    def __init__(self, fork: np.ndarray, origin: np.ndarray, ids: np.ndarray,
                 stride: int) -> None:
        self.stride = stride
        key = fork.astype(np.int64) * stride + origin.astype(np.int64)
        order = np.argsort(key)
        self.key, self.ids = key[order], ids[order]

    def of(self, fork: np.ndarray, origin: np.ndarray) -> np.ndarray:
        """Each (fork, origin)'s inherited block's id, -1 where there is none."""
        out = np.full(len(fork), -1, np.int64)
        if not len(self.key) or not len(fork):
            return out
        key = fork.astype(np.int64) * self.stride + origin.astype(np.int64)
        j, hit = find_sorted(self.key, key)
        hit &= fork >= 0
        out[hit] = self.ids[j[hit]]
        return out


