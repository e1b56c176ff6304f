"""Synthetic artifacts and run databases with known allocations: the data the process,
report and export tests share. Every figure they check derives from this."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from memtrack.process.lifecycle import lifecycle
from memtrack.process.load import StageTables, load, meta_rows
from memtrack.process.pair import pair
from memtrack.process.read import sort_events
from memtrack.process.rss import effective_rss
from memtrack.schema import EVENTS, MAPPINGS, PROCESSES, RSS, Allocator, EventKind
from memtrack.schema.artifact import ArtifactWriter
from memtrack.schema.enums import CLONE_VFORK, CLONE_VM
from memtrack.schema.stages import (
    MODULES,
    SYMBOLIZED_FRAMES,
    UNWOUND_STACK_FRAMES,
    UNWOUND_STACKS,
)

K = EventKind
LIBC = int(Allocator.LIBC)
END_NS = 3000

# The children are vforks (CLONE_VM): they share pid 100's memory, so they inherit no
# copy of its blocks (tests/test_process.py pairs the same events with plain forks).
VFORK = CLONE_VM | CLONE_VFORK
# (ts, pid, tid, kind, flags, addr, old_addr, size, stack_hash)
EVENT_ROWS = [
    (1000, 100, 100, K.MALLOC, 0, 0xA0, 0, 512, 11),  # A: temporary
    (1100, 100, 100, K.FREE, 0, 0xA0, 0, 0, 0),
    (1200, 100, 100, K.MALLOC, 0, 0xB0, 0, 1024, 12),  # B: realloc'd into D
    (1250, 100, 101, K.MALLOC, 0, 0xF0, 0, 300, 13),  # F: thread 101, freed by 100
    (1300, 100, 100, K.MALLOC, 0, 0xC0, 0, 2048, 15),  # C: make_big, another line
    (1400, 100, 100, K.REALLOC, 0, 0xD0, 0xB0, 4096, 14),  # D: realloc of B (peak here)
    (1500, 100, 100, K.FREE, 0, 0xC0, 0, 0, 0),
    (1600, 100, 100, K.CALLOC, 0, 0xE0, 0, 1000, 11),  # E: leaked
    (1700, 100, 100, K.FREE, 0, 0xF0, 0, 0, 0),
    (1800, 100, 100, K.FORK, VFORK, 200, 0, 0, 0),  # child 200
    (1900, 200, 200, K.MALLOC, 0, 0x60, 0, 64, 13),  # G: child, ends at its exit
    (1950, 200, 200, K.FREE, 0, 0xE0, 0, 0, 0),  # pid 100's block: unmatched
    (2000, 200, 200, K.EXIT, 1, 0, 0, 3 << 8, 0),
    (2100, 100, 100, K.ALIGNED_ALLOC, 0, 0x80, 0, 512, 14),  # H: temporary
    (2200, 100, 100, K.FREE, 0, 0x80, 0, 0, 0),
    (2250, 100, 100, K.FREE, 0, 0xDEAD, 0, 0, 0),  # never allocated: unmatched
    (2300, 100, 100, K.FORK, VFORK, 200, 0, 0, 0),  # pid 200 reused
    (2400, 200, 200, K.FREE, 0, 0x60, 0, 0, 0),  # G's address, other instance: unmatched
    (2500, 200, 200, K.MALLOC, 0, 0x70, 0, 128, 0),  # X: leaked by the second 200
    (2600, 200, 200, K.EXIT, 1, 0, 0, 9, 0),  # killed by SIGKILL
]
# alloc_id order: A B F C D E G H X
SIZES = [512, 1024, 300, 2048, 4096, 1000, 64, 512, 128]
PEAK = {"pid": 100, "ts": 1400, "bytes": 300 + 2048 + 4096, "alive": [2, 3, 4]}
LEAKS = {5: ("end", 1000), 4: ("end", 4096), 6: ("exit", 64), 8: ("exit", 128)}
TEMPORARY = [0, 7]
UNMATCHED_FREES = 3


def events_table(rows: list[tuple] | None = None) -> pa.Table:
    """EVENT_ROWS (or `rows` in their layout) as an events table."""
    cols = list(zip(*(rows or EVENT_ROWS), strict=True))
    data = {
        "ts": cols[0], "pid": cols[1], "tid": cols[2], "kind": [int(k) for k in cols[3]],
        "allocator": [LIBC if k in (1, 2, 3, 4, 5) else 0 for k in cols[3]],
        "flags": cols[4], "addr": cols[5], "old_addr": cols[6], "size": cols[7],
        "stack_hash": cols[8],
    }  # fmt: skip
    return pa.table(data, schema=EVENTS)


def write_artifact(path: Path, events: pa.Table | None = None, *,
                   command: tuple[str, ...] = ("p", "-x"), comm: str = "parent") -> Path:
    w = ArtifactWriter(path)
    w.write("events", events if events is not None else events_table())
    w.write("processes", pa.table({
        "ts": [900, 1800, 2300], "pid": [100, 200, 200], "ppid": [1, 100, 100],
        "comm": [comm, "child", "child2"], "exe": ["/bin/p", "/bin/p", "/bin/p"],
        "cmdline": [["p", "-x"], ["p"], ["p"]], "ns_pid": [100, 200, 200]},
        schema=PROCESSES))  # fmt: skip
    w.write("rss", pa.table({
        "ts": [1000, 1400, 1500], "pid": [100, 100, 100], "member": [1, 1, 0],
        "bytes": [4096, 65536, 8192], "external": [False] * 3}, schema=RSS))  # fmt: skip
    w.write("mappings", MAPPINGS.empty_table())
    w.manifest.root_pid = 100
    w.manifest.start_ns = 900
    w.manifest.end_ns = END_NS
    w.manifest.command = list(command)
    w.close()
    return path


def write_storm(path: Path, processes: int) -> Path:
    """A fork/exec storm: pid 100 (a shell) forks `processes` children one after
    another, 1 ms apart, each of which execs, allocates three blocks (its RSS growing
    with each), frees one and exits (the others leaked at its exit)."""
    rows, rss, procs = [], [], [(900, 100, 1, "sh", "/bin/sh", ["sh"], 100)]
    ts = 1000
    for i in range(processes):
        pid = 1000 + i
        rows += [(ts, 100, 100, K.FORK, 0, pid, 0, 0, 0), (ts + 1, pid, pid, K.EXEC, 0, 0, 0, 0, 0)]
        procs.append((ts + 1, pid, 100, f"job{i}", "/bin/job", ["job", str(i)], pid))
        for j in range(3):
            rows.append((ts + 2 + j, pid, pid, K.MALLOC, 0, 0x1000 + 64 * j, 0, 100 + j, 11))
            rss.append((ts + 2 + j, pid, 1, 4096 * (j + 1), False))
        rows += [(ts + 5, pid, pid, K.FREE, 0, 0x1000, 0, 0, 0),
                 (ts + 6, pid, pid, K.EXIT, 1, 0, 0, 0, 0)]
        ts += 1_000_000
    w = ArtifactWriter(path)
    w.write("events", events_table(rows))
    w.write("processes", pa.table(dict(zip(PROCESSES.names, zip(*procs, strict=True),
                                           strict=True)), schema=PROCESSES))
    w.write("rss", pa.table(dict(zip(RSS.names, zip(*rss, strict=True), strict=True)),
                            schema=RSS))
    w.write("mappings", MAPPINGS.empty_table())
    w.manifest.root_pid = 100
    w.manifest.start_ns = 900
    w.manifest.end_ns = ts
    w.manifest.command = ["sh", "storm"]
    w.close()
    return path


# Hand-built unwinding and symbolization results for the stack hashes above, so that
# report and export tests control every frame: hash -> frames innermost first
# (depth 0 is the allocator itself); NAME:LINE is NAME at another line of its file.
STACKS = {
    11: ["malloc", "make_small", "work", "main"],
    12: ["malloc", "make_big", "work", "main"],
    13: ["malloc", "thread_fn"],
    14: ["realloc", "grow", "main"],
    15: ["malloc", "make_big:31", "work", "main"],
}
CUT = {13}  # stacks cut short: unwinding needed more than the copy (no outermost frame)
ALLOCATORS = ["calloc", "free", "malloc", "realloc"]  # what capture probed


BUILD_ID = "ab" * 20
MAPPED = (0x5500_0000, 0x5501_0000)  # where /bin/p lies in pid 100
NAMES = sorted({n for fr in STACKS.values() for n in fr if ":" not in n})
ENTRIES = NAMES + sorted({n for fr in STACKS.values() for n in fr if ":" in n})


def vaddr_of(entry: str) -> int:
    return 0x1000 + 0x100 * ENTRIES.index(entry)


def name_line(entry: str) -> tuple[str, int]:
    """A frame's function and line: NAME at 10 + its index, or NAME:LINE."""
    name, _, line = entry.partition(":")
    return name, int(line) if line else 10 + NAMES.index(name)


def stage_tables(events: pa.Table, stacks: dict[int, list[str]] = STACKS,
                 end_ns: int = END_NS) -> StageTables:
    """The stages' tables with `stacks` (STACKS' names) as unwound (one module, every
    frame normalized), for a capture that ended at `end_ns`."""
    ev = sort_events(events)
    life = lifecycle(ev, pa.table({
        "ts": [900, 1800], "pid": pa.array([100, 200], pa.uint32()),
        "ppid": pa.array([1, 100], pa.uint32()), "comm": ["parent", "child"],
        "exe": ["/bin/p", "/bin/p"], "cmdline": [["p", "-x"], ["p"]],
        "ns_pid": pa.array([100, 200], pa.uint32())}, schema=PROCESSES),
        root_pid=100, start_ns=900)
    pairing = pair(ev, life, end_ns)
    st_rows: dict[str, list] = {k: [] for k in UNWOUND_STACKS.names}
    sf: dict[str, list] = {k: [] for k in UNWOUND_STACK_FRAMES.names}
    for h, fr in sorted(stacks.items()):
        cut = h in CUT
        for k, v in zip(st_rows, (h, 100, len(fr), cut, not cut,
                                  "truncated" if cut else "complete"), strict=True):
            st_rows[k].append(v)
        for d, n in enumerate(fr):
            vaddr = vaddr_of(n)
            for k, v in zip(sf, (h, 100, d, MAPPED[0] + vaddr, "cfi" if d else "regs",
                                 BUILD_ID, "/bin/p", vaddr, None), strict=True):
                sf[k].append(v)
    modules = pa.table({
        "module_id": pa.array([0], pa.int32()), "build_id": [BUILD_ID], "path": ["/bin/p"],
        "elf_path": ["/bin/p"], "has_debuginfo": [True], "in_artifact": [True]},
        schema=MODULES)  # fmt: skip
    return StageTables(
        events=ev, allocations=pairing.allocations, heap_timeline=pairing.heap_timeline,
        life=life, mappings=pa.table({
            "ts": [900], "pid": pa.array([100], pa.uint32()), "start": [MAPPED[0]],
            "end": [MAPPED[1]], "offset": [0], "perms": ["r-xp"], "dev": ["fd:01"],
            "inode": [42], "path": ["/bin/p"], "build_id": [BUILD_ID]}, schema=MAPPINGS),
        rss=effective_rss(pa.table({
            "ts": [1000, 1400, 1500], "pid": [100, 100, 100], "member": [1, 1, 0],
            "bytes": [4096, 65536, 8192], "external": [False] * 3}, schema=RSS), life),
        modules=modules,
        stacks=pa.table(st_rows, schema=UNWOUND_STACKS),
        stack_frames=pa.table(sf, schema=UNWOUND_STACK_FRAMES),
    )  # fmt: skip


def symbolize(known: pa.Table) -> pa.Table:
    """The names of ENTRIES' addresses, as if read from the module: file NAME.c, at the
    entry's line (name_line)."""
    found = [name_line(ENTRIES[(v - 0x1000) // 0x100]) for v in known.column("vaddr").to_pylist()]
    names = [name for name, _ in found]
    n = len(names)
    return pa.table({
        "row": pa.array(range(n), pa.uint32()), "inline_depth": pa.array([0] * n, pa.uint8()),
        "function": names, "symbol": names, "offset": pa.array([0] * n, pa.uint64()),
        "file": [f"{x}.c" for x in names],
        "line": pa.array([line for _, line in found], pa.uint32()),
        "column": pa.array([0] * n, pa.uint32()),
        "reason": pa.array([None] * n, pa.string())}, schema=SYMBOLIZED_FRAMES)  # fmt: skip


def write_run(path: Path, events: pa.Table | None = None,
              stacks: dict[int, list[str]] = STACKS) -> Path:
    """A run database of EVENT_ROWS (or `events`) with STACKS (or `stacks`, of the same
    names) as their stacks, written by the load stage as `process` writes it."""
    ev = events if events is not None else events_table()
    load(path, stage_tables(ev, stacks), lambda _: meta_rows(
        start_ns=900, end_ns=END_NS, root_pid=100, command=["p", "-x"], losses={},
        counters={}, allocator_functions=ALLOCATORS), symbolize)
    return path


def random_events(seed: int, n: int = 3000) -> pa.Table:
    """A random stream (time-ordered) over few addresses, so that they are reused: every
    allocation kind, frees of blocks never seen, reallocs (in place, moved, of nothing),
    failed allocations, threads that start and exit, forks (plain and vfork; some pids
    reused) whose children allocate and free before their exec or exit, and
    grandchildren."""
    import numpy as np

    from memtrack.schema.enums import CLONE_THREAD

    rng = np.random.default_rng(seed)
    rows = []
    ts = 1000
    pids, tids = [100], {100: [100]}
    next_pid = 200
    for _ in range(n):
        ts += int(rng.integers(0, 3))
        p = pids[int(rng.integers(len(pids)))]
        t = tids[p][int(rng.integers(len(tids[p])))]
        r = rng.random()
        addr = int(rng.integers(1, 60)) * 16
        size = int(rng.integers(1, 5000))
        if r < 0.35:
            k = (K.MALLOC, K.CALLOC, K.ALIGNED_ALLOC)[int(rng.integers(3))]
            rows.append((ts, p, t, k, 0, 0 if rng.random() < 0.02 else addr, 0, size,
                         int(rng.integers(0, 9))))
        elif r < 0.7:
            rows.append((ts, p, t, K.FREE, 0, addr if rng.random() > 0.03 else 0, 0, 0, 0))
        elif r < 0.85:
            rows.append((ts, p, t, K.REALLOC, 0, addr if rng.random() > 0.1 else 0,
                         int(rng.integers(0, 60)) * 16, size, int(rng.integers(0, 9))))
        elif r < 0.9 and len(pids) < 8:
            child = next_pid if rng.random() < 0.8 or next_pid == 200 else 200
            next_pid += 1
            rows.append((ts, p, t, K.FORK, CLONE_VM if rng.random() < 0.3 else 0, child,
                         0, 0, 0))
            if child not in pids:
                pids.append(child)
            tids[child] = [child]
        elif r < 0.93:
            new = t + 1000 + int(rng.integers(0, 5))
            rows.append((ts, p, t, K.FORK, CLONE_THREAD | CLONE_VM, new, 0, 0, 0))
            if new not in tids[p]:
                tids[p].append(new)
        elif r < 0.95 and p != 100:
            rows.append((ts, p, p, K.EXEC, 0, 0, 0, 0, 0))
        elif r < 0.97 and t != p:
            rows.append((ts, p, t, K.EXIT, 0, 0, 0, 0, 0))
            tids[p].remove(t)
        elif r < 0.97 and p != 100:
            rows.append((ts, p, p, K.EXIT, 1, 0, 0, 0, 0))
            pids.remove(p)
    return events_table(rows)
