"""A synthetic artifact of any size, written through the artifact writer, that `process`
must work on as on a capture: real modules (python3.11, libc, libstdc++, libsqlite3,
copied into the artifact), stack records whose skeletons unwind with the modules' own
CFI to real return addresses (so unwind and symbolize do real work), and a realistic
event mix (malloc/calloc/aligned_alloc, realloc chains, frees after a heavy-tailed
lifetime, leaks, large blocks by mmap/munmap, RSS updates) over several threads.

    .venv/bin/python bench/synth_artifact.py OUT.memtrack --events 10M --stacks 100k \
        [--threads 8] [--depth 24] [--seed 1]

Each stack is a chain of frames built from CFI rows that take the CFA from rsp (99.76 %
of the rows in common binaries): frame 0 is malloc's or operator new's entry (registers
only), each caller's return address sits at its callee's CFA - 8 and the caller's CFA is
rsp + its row's offset, and the outermost return address is inside _start, whose row
says rip is undefined (the stack is complete). Saved rbp slots hold pointers into the
stack, as a skeleton keeps them. A call path is recorded on one thread (its stack's
address is part of the record's hash, as in capture); every allocation names the
record of its thread.

Events are generated window by window (a million allocations at a time) and written in
time order, so the generator's memory does not grow with --events either.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memtrack.dwarf.cfi import (  # noqa: E402
    CFA_NONE,
    RSP,
    T_RA,
    T_RBP,
    TRACKED,
    CFITable,
    Kind,
    Rule,
    build_table,
)
from memtrack.elf import ElfImage  # noqa: E402
from memtrack.elf.debuglink import find_debug_file  # noqa: E402
from memtrack.schema import (  # noqa: E402
    EVENTS,
    MAPPINGS,
    NUM_REGS,
    PROCESSES,
    RSS,
    STACKS,
    Allocator,
    EventKind,
)
from memtrack.schema.artifact import ArtifactWriter  # noqa: E402
from memtrack.schema.stackrecord import GROUP_WORDS, skeleton_hash  # noqa: E402

LIB = "/usr/lib/x86_64-linux-gnu"
MODULES = ("/usr/bin/python3.11", f"{LIB}/libc.so.6", f"{LIB}/libstdc++.so.6.0.30",
           f"{LIB}/libsqlite3.so.0.8.6")
BASES = (0, 0x7F00_1000_0000, 0x7F00_2000_0000, 0x7F00_3000_0000)  # python3.11 is ET_EXEC
ALLOC_SITES = ((1, "malloc"), (2, "_Znwm"))  # (module index, function): frame 0
PID = 4242
START_NS = 1_000_000_000_000
EVENT_NS = 500  # mean time between two events
MAIN_STACK_TOP = 0x7FFD_F000_0000
THREAD_STACK_TOP = 0x7F10_0000_0000  # thread t's stack ends at this - t * THREAD_STACK
THREAD_STACK = 8 << 20
HEAP = 0x5600_0000_0000
MMAP_AREA = 0x7E00_0000_0000
PAGE = 4096


@dataclass
class Mod:
    path: str
    base: int
    build_id: str
    segments: list[tuple[int, int, int, bool]]  # (vaddr, memsz, offset, executable)
    ras: np.ndarray  # candidate return addresses (vaddr), rsp-based rows
    cfa: np.ndarray  # their rows' CFA offset
    rbp: np.ndarray  # their rows' saved-rbp offset from the CFA, 0 where not saved


def read_module(path: str, base: int, rng: np.random.Generator, pool: int
                ) -> tuple[Mod, CFITable]:
    with ElfImage(path) as img:
        build_id = img.build_id or ""
        s = img.segments
        segs = [(int(v), int(m), int(o), bool(x)) for v, m, o, x in zip(
            s.vaddr, s.memsz, s.offset, s.executable, strict=True)]
    t = build_table(path)
    nxt = np.append(t.pc[1:], t.pc[-1])
    simple = ((t.cfa_reg == RSP) & (t.kind == Kind.CFI) & (t.extra < 0)
              & (t.rule[:, T_RA] == Rule.OFFSET) & (t.off[:, T_RA] == -8)
              & (t.cfa_off >= 16) & (t.cfa_off <= 1024) & (nxt - t.pc >= 2)
              & np.isin(t.rule[:, T_RBP], (Rule.SAME, Rule.OFFSET)))
    for k in range(1, len(TRACKED)):  # other callee-saved registers: same or on the stack
        simple &= np.isin(t.rule[:, k], (Rule.SAME, Rule.OFFSET))
    rows = np.flatnonzero(simple)
    rows = rng.choice(rows, size=min(pool, rows.size), replace=False)
    span = (nxt[rows] - t.pc[rows] - 1).astype(np.int64)
    ras = t.pc[rows] + 1 + (rng.random(rows.size) * span).astype(np.uint64)
    rbp = t.off[rows, T_RBP]
    rbp = np.where((t.rule[rows, T_RBP] == Rule.OFFSET) & (rbp <= -16)
                   & (rbp >= -t.cfa_off[rows]), rbp, 0)  # a slot of its own frame
    return Mod(path, base, build_id, segs, ras, t.cfa_off[rows], rbp), t


def start_return(path: str, t: CFITable) -> int:
    """A return address inside _start whose row says rip is undefined (outermost)."""
    with ElfImage(path) as img:
        start, size = img.functions({"_start"})["_start"]
    for a in range(start + 1, start + size + 1):
        i = int(t.lookup(np.array([a - 1]))[0])
        if i >= 0 and t.cfa_reg[i] != CFA_NONE and t.rule[i, T_RA] == Rule.UNDEFINED:
            return a
    raise SystemExit(f"{path}: _start has no row with rip undefined")


def stack_records(mods: list[Mod], start_ra: int, n: int, threads: int, depth: int,
                  rng: np.random.Generator) -> pa.Table:
    """n distinct stack records (STACKS rows), call paths over the modules' pools, each
    ending at the return address start_ra (in _start)."""
    sites = []
    for m, name in ALLOC_SITES:
        with ElfImage(mods[m].path) as img:
            sites.append(mods[m].base + img.functions({name})[name][0])
    # A Zipf-like pick per depth: outer frames from few call sites, inner ones from many.
    pools = [(np.uint64(m.base) + m.ras, m.cfa, m.rbp) for m in mods]
    tid = np.zeros(n, np.uint32)
    sp = np.zeros(n, np.uint64)
    copy_len = np.zeros(n, np.uint32)
    regs = np.zeros((n, NUM_REGS), np.uint64)
    rows, pos, vals = [], [], []
    depths = np.clip(rng.normal(depth, depth / 3, n).astype(int), 3, 4 * depth)
    for r in range(n):
        d = int(depths[r])
        frames = []
        for k in range(d):
            m = 0 if k >= d - 3 else int(rng.integers(len(mods)))
            ras, cfa, rbp = pools[m]
            width = max(2, int(len(ras) * min(1.0, (k + 1) / d)))
            j = min(int(rng.zipf(1.3)) - 1, width - 1) if k >= d - 3 else \
                int(rng.integers(width))
            frames.append((int(ras[j]), int(cfa[j]), int(rbp[j])))
        frames.append((start_ra, 16, 0))
        size = 8 + sum(f[1] for f in frames[:-1]) + 16
        t = int(rng.integers(threads))
        top = MAIN_STACK_TOP if t == 0 else THREAD_STACK_TOP - t * THREAD_STACK
        s = top - size
        cfa = s + 8  # frame 0: the allocator's entry, CFA = rsp + 8, RA at rsp
        ra_slot, words = s, {}
        for ra, off, rbp in frames:
            words[(ra_slot - s) // 8] = ra
            cfa_next = cfa + off
            if rbp and ra != start_ra:
                words[(cfa_next + rbp - s) // 8] = cfa_next + 16  # a saved frame pointer
            ra_slot, cfa = cfa_next - 8, cfa_next
        for p in sorted(words):
            rows.append(r)
            pos.append(p)
            vals.append(words[p])
        tid[r], sp[r], copy_len[r] = PID + t, s, size
        regs[r, 7] = s
        regs[r, 16] = sites[int(rng.integers(len(sites)))]
        regs[r, 6] = top - 16
    row, p, v = np.array(rows), np.array(pos), np.array(vals, np.uint64)
    nwords = copy_len.astype(np.int64) // 8
    cut = np.zeros(n, bool)
    hashes = skeleton_hash(nwords, row, p, v, regs, sp, cut, np.zeros(n + 1, np.int64),
                           np.zeros(0, np.uint64))
    # the payloads: each copy's kept bitmap (one word per group), then its kept words
    groups = -(-nwords // GROUP_WORDS)
    bits = np.zeros(int(groups.sum()), np.uint64)
    gbase = np.concatenate([[0], np.cumsum(groups)])[:-1]
    np.bitwise_or.at(bits, gbase[row] + p // GROUP_WORDS,
                     np.left_shift(np.uint64(1), (p % GROUP_WORDS).astype(np.uint64)))
    kept = np.bincount(row, minlength=n)
    payload = []
    b0 = k0 = 0
    for r in range(n):
        g, k = int(groups[r]), int(kept[r])
        payload.append(bits[b0:b0 + g].tobytes() + v[k0:k0 + k].tobytes())
        b0, k0 = b0 + g, k0 + k
    return pa.table({
        "hash": hashes, "ts": np.full(n, START_NS, np.uint64), "pid": np.full(n, PID, np.uint32),
        "tid": tid, "sp": sp, "copy_len": copy_len, "truncated": cut,
        "regs": pa.FixedSizeListArray.from_arrays(pa.array(regs.ravel()), NUM_REGS),
        "payload": pa.array(payload, pa.binary()),
        "fp_chain": pa.nulls(n, pa.list_(pa.uint64())),
        "ret_fixups": pa.array([[]] * n, STACKS.field("ret_fixups").type),
        "python_cut": np.zeros(n, bool),
    }, schema=STACKS)


def mappings(mods: list[Mod], threads: int) -> pa.Table:
    rows: dict[str, list] = {k: [] for k in MAPPINGS.names}

    def add(start: int, end: int, offset: int, perms: str, path: str, bid: str | None) -> None:
        for k, v in zip(MAPPINGS.names, (START_NS - 1, PID, start, end, offset, perms,
                                         "fd:01", 0 if bid is None else 1000 + start % 997,
                                         path, bid), strict=True):
            rows[k].append(v)

    for m in mods:
        for vaddr, memsz, offset, x in m.segments:
            lo = vaddr // PAGE * PAGE
            add(m.base + lo, m.base + -(-(vaddr + memsz) // PAGE) * PAGE, offset // PAGE * PAGE,
                "r-xp" if x else "r--p", m.path, m.build_id)
    add(MAIN_STACK_TOP - (8 << 20), MAIN_STACK_TOP, 0, "rw-p", "[stack]", None)
    for t in range(1, threads):
        top = THREAD_STACK_TOP - t * THREAD_STACK
        add(top - THREAD_STACK, top, 0, "rw-p", "", None)
    return pa.table(rows, schema=MAPPINGS)


class Events:
    """The event stream, window by window: allocations of one window, and the frees and
    reallocs they cause whenever they fall (carried to the window that holds them)."""

    def __init__(self, records: pa.Table, rng: np.random.Generator) -> None:
        self.rng = rng
        self.hashes = records.column("hash").to_numpy()
        self.tids = records.column("tid").to_numpy()
        self.next_addr = HEAP
        self.next_map = MMAP_AREA
        self.carry = EVENTS.empty_table()
        self.emitted = 0

    def _stacks(self, n: int) -> np.ndarray:
        """Record of each allocation: half Zipf (hot paths), half uniform (every path)."""
        d = len(self.hashes)
        z = (self.rng.zipf(1.1, n) - 1) % d
        u = self.rng.integers(0, d, n)
        return np.where(self.rng.random(n) < 0.5, z, u)

    def window(self, t0: int, n: int) -> pa.Table:
        rng = self.rng
        ts = t0 + np.sort(rng.integers(0, n * 2 * EVENT_NS, n)).astype(np.uint64)
        rec = self._stacks(n)
        tid = self.tids[rec]
        size = np.minimum(rng.lognormal(4.0, 1.5, n).astype(np.uint64) + 1, 1 << 20)
        big = rng.random(n) < 0.002  # large blocks: mmap'd by the allocator too
        size[big] = (rng.integers(128 << 10, 8 << 20, int(big.sum())) // PAGE * PAGE)
        kind = rng.choice([EventKind.MALLOC, EventKind.CALLOC, EventKind.ALIGNED_ALLOC],
                          n, p=[0.92, 0.06, 0.02]).astype(np.uint8)
        addr = self.next_addr + 16 * np.arange(n, dtype=np.uint64)
        self.next_addr += 16 * n + (n * 64)
        # lifetimes: most blocks die young, some live long, 2 % leak
        life = rng.lognormal(9.5, 2.5, n).astype(np.uint64) + 100
        leaked = rng.random(n) < 0.02
        by_realloc = ~leaked & (rng.random(n) < 0.05)
        cols = [self._rows(ts, tid, kind, np.zeros(n, np.uint64), addr, np.zeros(n, np.uint64),
                           size, self.hashes[rec])]
        end = ts + life
        f = ~leaked & ~by_realloc
        cols.append(self._rows(end[f], tid[f], EventKind.FREE, 0, addr[f], 0, 0, 0))
        r = by_realloc
        nr = int(r.sum())
        raddr = self.next_addr + 16 * np.arange(nr, dtype=np.uint64)
        self.next_addr += 16 * nr + nr * 64
        rec2 = self._stacks(nr)
        cols.append(self._rows(end[r], tid[r], EventKind.REALLOC, 0, raddr, addr[r],
                               size[r] * 2, self.hashes[rec2]))
        cols.append(self._rows(end[r] + rng.lognormal(9.0, 2.0, nr).astype(np.uint64) + 50,
                               tid[r], EventKind.FREE, 0, raddr, 0, 0, 0))
        nb = int(big.sum())  # the allocator's own mmap/munmap of a large block
        maddr = self.next_map + (np.arange(nb, dtype=np.uint64) << np.uint64(24))
        self.next_map += nb << 24
        prot = 3 << 32
        cols.append(self._rows(ts[big] + 1, tid[big], EventKind.MMAP, prot | 0x22, maddr, 0,
                               size[big], 0))
        gone = big & ~leaked
        cols.append(self._rows(end[gone] + 1, tid[gone], EventKind.MUNMAP, 0,
                               maddr[~leaked[big]], 0, size[gone], 0))
        return pa.concat_tables([self.carry, *cols])

    @staticmethod
    def _rows(ts, tid, kind, flags, addr, old, size, stack) -> pa.Table:  # noqa: ANN001
        n = len(ts)

        def col(v, dt) -> np.ndarray:  # noqa: ANN001
            return np.broadcast_to(np.asarray(v, dt), n)

        alloc = np.where(np.isin(col(kind, np.uint8), (EventKind.MMAP, EventKind.MUNMAP)),
                         Allocator.SYSCALL, Allocator.LIBC).astype(np.uint8)
        return pa.table({
            "ts": col(ts, np.uint64), "pid": col(PID, np.uint32), "tid": col(tid, np.uint32),
            "kind": col(kind, np.uint8), "allocator": alloc, "flags": col(flags, np.uint64),
            "addr": col(addr, np.uint64), "old_addr": col(old, np.uint64),
            "size": col(size, np.uint64), "stack_hash": col(stack, np.uint64)}, schema=EVENTS)

    def split(self, table: pa.Table, until: int | None) -> pa.Table:
        """The rows before `until` in time order; the rest is carried (None: all)."""
        ts = table.column("ts").to_numpy()
        order = np.argsort(ts, kind="stable")
        table = table.take(pa.array(order))
        cut = len(order) if until is None else int(np.searchsorted(ts[order], until))
        self.carry = table.slice(cut)
        return table.slice(0, cut)


def generate(out: Path, events: int, stacks: int, threads: int = 8, depth: int = 24,
             seed: int = 1, window: int = 1_000_000, quiet: bool = False) -> dict[str, int]:
    """Write the artifact; returns its row counts."""
    rng = np.random.default_rng(seed)
    t_start = time.perf_counter()
    read = [read_module(p, b, rng, 4000) for p, b in zip(MODULES, BASES, strict=True)]
    mods = [m for m, _ in read]
    start_ra = mods[0].base + start_return(mods[0].path, read[0][1])
    del read
    records = stack_records(mods, start_ra, stacks, threads, depth, rng)
    if not quiet:
        print(f"synth: {stacks} stack records in {time.perf_counter() - t_start:.1f}s",
              file=sys.stderr)
    w = ArtifactWriter(out, overwrite=True)
    for m in mods:
        w.add_module(m.build_id, m.path, Path(m.path), find_debug_file(m.path, m.build_id))
    w.write("stacks", records)
    w.write("mappings", mappings(mods, threads))
    w.write("processes", pa.table({
        "ts": [START_NS - 1], "pid": pa.array([PID], pa.uint32()),
        "ppid": pa.array([1], pa.uint32()), "comm": ["synthetic"], "exe": [MODULES[0]],
        "cmdline": [["python3.11", "synthetic"]], "ns_pid": pa.array([PID], pa.uint32())},
        schema=PROCESSES))
    ev = Events(records, rng)
    written, t0, rss_rows = 0, START_NS, []
    allocs = max(1, events * 1000 // 2032)  # ~2.03 events per allocation
    while allocs > 0:
        n = min(window, allocs)
        allocs -= n
        span = n * 2 * EVENT_NS
        batch = ev.split(ev.window(t0, n), t0 + span if allocs else None)
        w.write("events", batch)
        written += batch.num_rows
        rss_rows.append((t0 + span, written))
        t0 += span
    w.write("rss", pa.table({
        "ts": [t for t, _ in rss_rows], "pid": pa.array([PID] * len(rss_rows), pa.uint32()),
        "member": pa.array([1] * len(rss_rows), pa.uint8()),
        "bytes": [min(n, 1 << 24) * PAGE for _, n in rss_rows],
        "external": [False] * len(rss_rows)}, schema=RSS))
    w.manifest.root_pid = PID
    w.manifest.start_ns = START_NS
    w.manifest.end_ns = t0 + 1
    w.manifest.command = ["synth_artifact", str(events), str(stacks)]
    w.manifest.options = {"synthetic": {"events": events, "stacks": stacks, "threads": threads,
                                        "depth": depth, "seed": seed}}
    w.close()
    if not quiet:
        print(f"synth: {written} events, {stacks} stack records -> {out} in "
              f"{time.perf_counter() - t_start:.1f}s", file=sys.stderr)
    return {"events": written, "stacks": stacks}


def count(text: str) -> int:
    """10M, 100k, 1000 -> int."""
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--events", type=count, default=count("1M"))
    ap.add_argument("--stacks", type=count, default=None, help="default: events / 100")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--depth", type=int, default=24, help="mean frames per stack")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    generate(args.out, args.events, args.stacks or max(1, args.events // 100), args.threads,
             args.depth, args.seed)


if __name__ == "__main__":
    main()
