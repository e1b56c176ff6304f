"""What a forked child's inherited blocks cost the pairing stage.

Synthetic events (no capture): a parent allocates LIVE blocks, then forks CHILDREN
children that each free one of them and exit. The same events are paired twice in the
same run: as plain forks (every child inherits a copy of the LIVE blocks) and as vforks
(CLONE_VM: nothing is inherited, the children's frees are unmatched). Printed: the rows
of each and the time ratio; per copy, the time the copies added.

    .venv/bin/python bench/bench_inherit.py [--live 100000] [--children 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa

from memtrack.process.lifecycle import lifecycle
from memtrack.process.pair import pair
from memtrack.schema import EVENTS, EventKind
from memtrack.schema.enums import CLONE_VM


def events(live: int, children: int, fork_flags: int) -> pa.Table:
    n = live + 3 * children
    kind = np.empty(n, np.uint8)
    pid = np.full(n, 100, np.uint32)
    flags = np.zeros(n, np.uint64)
    addr = np.zeros(n, np.uint64)
    size = np.zeros(n, np.uint64)
    kind[:live] = EventKind.MALLOC
    addr[:live] = 0x10000 + 32 * np.arange(live, dtype=np.uint64)
    size[:live] = 24
    c = 1000 + np.arange(children, dtype=np.uint32)
    f, fr, ex = live + 3 * np.arange(children), live + 3 * np.arange(children) + 1, \
        live + 3 * np.arange(children) + 2
    kind[f], addr[f], flags[f] = EventKind.FORK, c, fork_flags
    kind[fr], pid[fr], addr[fr] = EventKind.FREE, c, 0x10000
    kind[ex], pid[ex], flags[ex] = EventKind.EXIT, c, 1
    return pa.table({
        "ts": np.arange(1, n + 1, dtype=np.uint64), "pid": pid, "tid": pid, "kind": kind,
        "allocator": np.ones(n, np.uint8), "flags": flags, "addr": addr,
        "old_addr": np.zeros(n, np.uint64), "size": size,
        "stack_hash": np.zeros(n, np.uint64)}, schema=EVENTS).append_column(
        "event_id", pa.array(np.arange(n, dtype=np.uint64)))


def timed(ev: pa.Table) -> tuple[float, int, int]:
    lc = lifecycle(ev)
    t0 = time.perf_counter()
    p = pair(ev, lc)
    return time.perf_counter() - t0, p.allocations.num_rows, p.counters["frees_unmatched"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", type=int, default=100_000)
    ap.add_argument("--children", type=int, default=20)
    a = ap.parse_args()
    timed(events(1000, 2, 0))  # warm up
    t_fork, rows_fork, unmatched_fork = timed(events(a.live, a.children, 0))
    t_vfork, rows_vfork, unmatched_vfork = timed(events(a.live, a.children, CLONE_VM))
    copies = rows_fork - rows_vfork
    print(f"{a.live} live blocks, {a.children} children freeing one each")
    print(f"  fork : {t_fork:.2f} s, {rows_fork} rows ({copies} inherited copies), "
          f"{unmatched_fork} frees unmatched")
    print(f"  vfork: {t_vfork:.2f} s, {rows_vfork} rows, {unmatched_vfork} frees unmatched")
    print(f"  ratio {t_fork / t_vfork:.1f}x; "
          f"{(t_fork - t_vfork) / max(copies, 1) * 1e9:.0f} ns per inherited copy")


if __name__ == "__main__":
    main()
