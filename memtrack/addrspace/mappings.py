"""The address spaces the unwinder reads: the artifact's /proc/PID/maps snapshots, and
for a forked child the one it inherits at its fork.

A fork copies the parent's address space: until a child execs or maps a new executable
file (each of which stops it for a snapshot of its own), its code is its parent's at
the fork. Capture cannot snapshot a child at its fork (the kernel gives no stop
there), so the child's stacks would find no mapping. Here each forked child gets, as
its snapshot at the fork's time, the parent's snapshot in effect then (the last one at
or before the fork, else its first one), a copy of a copy for a grandchild; a vfork
child (CLONE_VM) shares the parent's address space, which is the same rows.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyarrow as pa


def inherited_mappings(mappings: pa.Table, forks: pa.Table, pids: np.ndarray) -> pa.Table:
    """`mappings` and the inherited snapshot of every forked child among `pids` (the
    processes that have stack records): the parent's rows, with the child's pid and the
    fork's ts. `forks` is Lifecycle.forks (in time order)."""
    if forks.num_rows == 0 or mappings.num_rows == 0:
        return mappings
    t = mappings.sort_by([("pid", "ascending"), ("ts", "ascending")])
    pid = t.column("pid").to_numpy().astype(np.int64)
    ts = t.column("ts").to_numpy().astype(np.int64)
    first = np.ones(len(pid), bool)
    first[1:] = (pid[1:] != pid[:-1]) | (ts[1:] != ts[:-1])
    lo = np.flatnonzero(first)
    hi = np.append(lo[1:], len(pid))
    # pid -> its snapshots as (ts, first row, end row), in time order
    snaps: dict[int, list[tuple[int, int, int]]] = {}
    for p, s, a, b in zip(pid[lo].tolist(), ts[lo].tolist(), lo.tolist(), hi.tolist(),
                          strict=True):
        snaps.setdefault(p, []).append((s, a, b))
    wanted = set(np.unique(pids).tolist())
    picked: list[tuple[int, int, int, int]] = []  # child, fork ts, rows
    for f_ts, parent, child in zip(forks.column("ts").to_pylist(),
                                   forks.column("parent").to_pylist(),
                                   forks.column("child").to_pylist(), strict=True):
        ss = snaps.get(parent)
        if not ss:
            continue
        k = bisect.bisect_right(ss, (f_ts, len(pid), len(pid))) - 1
        _, a, b = ss[max(k, 0)]
        bisect.insort(snaps.setdefault(child, []), (f_ts, a, b))
        if child in wanted:
            picked.append((child, f_ts, a, b))
    if not picked:
        return mappings
    rows = np.concatenate([np.arange(a, b) for _, _, a, b in picked])
    lens = np.array([b - a for _, _, a, b in picked])
    extra = t.take(pa.array(rows))
    extra = extra.set_column(extra.schema.get_field_index("pid"), "pid", pa.array(
        np.repeat([c for c, _, _, _ in picked], lens).astype(np.uint32),
        extra.schema.field("pid").type))
    extra = extra.set_column(extra.schema.get_field_index("ts"), "ts", pa.array(
        np.repeat([s for _, s, _, _ in picked], lens).astype(np.uint64),
        extra.schema.field("ts").type))
    return pa.concat_tables([mappings, extra.cast(mappings.schema)])
