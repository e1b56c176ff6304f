"""The anon replay: anonymous RSS rebuilt from --track-faults page faults, without the
kernel's folio-rmap hooks. Write faults in private mappings make pages resident
(transparent huge pages where the mapping is eligible and a whole 2 MiB window took a
single fault), munmap / madvise(DONTNEED) / mremap / brk shrink / exec take them away,
a fork copies the parent's map. It keeps a resident page set per process and cannot
see swap-out, reclaim of MADV_FREE'd pages, MADV_PAGEOUT or KSM merging; the result
names the caveats that apply to each process.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from memtrack.process.lifecycle import Lifecycle, fork_depths
from memtrack.process.lookup import key_bounds
from memtrack.schema.enums import (
    FAULT_PRESENT,
    FAULT_WRITE,
    MADV_COLLAPSE,
    MADV_DONTNEED,
    MADV_DONTNEED_LOCKED,
    MADV_FREE,
    MADV_HUGEPAGE,
    MADV_MERGEABLE,
    MADV_NOHUGEPAGE,
    MADV_PAGEOUT,
    MADV_POPULATE_WRITE,
    MADV_REMOVE,
    MAP_ANONYMOUS,
    MAP_POPULATE,
    MAP_SHARED,
    MAP_SHARED_VALIDATE,
    MAP_TYPE,
    MREMAP_DONTUNMAP,
    PROT_WRITE,
    EventKind,
    RssMember,
)
from memtrack.schema.manifest import Manifest

THP_ORDER = 9  # 2 MiB of 4 KiB pages
_DROPS = (MADV_DONTNEED, MADV_DONTNEED_LOCKED, MADV_REMOVE)


def thp_mode(manifest: Manifest) -> str:
    """The traced host's transparent-hugepage mode, as capture recorded it in the
    manifest's host (format 2.6; before, in options.extra); "madvise" when unknown."""
    old = manifest.options.get("extra") or {}
    return str(manifest.host.thp_enabled or old.get("thp_enabled") or "madvise")


class PageRanges:
    """A set of disjoint page ranges [start, end) as two sorted numpy arrays."""

    def __init__(self, starts: np.ndarray | None = None, ends: np.ndarray | None = None) -> None:
        self.starts = np.empty(0, np.int64) if starts is None else starts
        self.ends = np.empty(0, np.int64) if ends is None else ends

    def copy(self) -> PageRanges:
        return PageRanges(self.starts.copy(), self.ends.copy())

    def remove(self, a: int, b: int) -> None:
        if b <= a or not len(self.starts):
            return
        keep_s = [self.starts[self.ends <= a], self.starts[self.starts >= b]]
        keep_e = [self.ends[self.ends <= a], self.ends[self.starts >= b]]
        cut = (self.starts < b) & (self.ends > a)
        cs, ce = self.starts[cut], self.ends[cut]
        left = cs < a
        right = ce > b
        s = np.concatenate(keep_s + [cs[left], np.full(int(right.sum()), b, np.int64)])
        e = np.concatenate(keep_e + [np.full(int(left.sum()), a, np.int64), ce[right]])
        o = np.argsort(s, kind="stable")
        self.starts, self.ends = s[o], e[o]

    def add(self, a: int, b: int) -> None:
        if b <= a:
            return
        touch = (self.starts <= b) & (self.ends >= a)
        if touch.any():
            a = min(a, int(self.starts[touch].min()))
            b = max(b, int(self.ends[touch].max()))
        s = np.append(self.starts[~touch], a)
        e = np.append(self.ends[~touch], b)
        o = np.argsort(s, kind="stable")
        self.starts, self.ends = s[o], e[o]

    def pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        cut = (self.starts < b) & (self.ends > a)
        return [(max(int(s), a), min(int(e), b))
                for s, e in zip(self.starts[cut], self.ends[cut], strict=True)]

    def contains(self, pages: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.starts, pages, side="right") - 1
        ok = i >= 0
        inside = np.zeros(len(pages), bool)
        inside[ok] = pages[ok] < self.ends[i[ok]]
        return inside

    def end_of(self, pages: np.ndarray) -> np.ndarray:
        """End of the range holding each page (0 where none)."""
        i = np.searchsorted(self.starts, pages, side="right") - 1
        out = np.zeros(len(pages), np.int64)
        ok = i >= 0
        ok[ok] = pages[ok] < self.ends[i[ok]]
        out[ok] = self.ends[i[ok]]
        return out


@dataclass
class _Space:
    """One process's replayed address space: resident anon pages and mapping kinds."""

    resident: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    shared: PageRanges = field(default_factory=PageRanges)
    anon: PageRanges = field(default_factory=PageRanges)  # private anonymous mappings
    huge: PageRanges = field(default_factory=PageRanges)  # MADV_HUGEPAGE ranges

    def copy(self) -> _Space:
        return _Space(self.resident.copy(), self.shared.copy(), self.anon.copy(),
                      self.huge.copy())

    def drop(self, a: int, b: int) -> None:
        lo, hi = np.searchsorted(self.resident, [a, b])
        if hi > lo:
            self.resident = np.concatenate([self.resident[:lo], self.resident[hi:]])

    def unmap(self, a: int, b: int) -> None:
        self.drop(a, b)
        for r in (self.shared, self.anon, self.huge):
            r.remove(a, b)

    def populate(self, a: int, b: int) -> None:
        pages = [np.arange(s, e, dtype=np.int64) for s, e in self._private(a, b)]
        if pages:
            self.resident = np.union1d(self.resident, np.concatenate(pages))

    def _private(self, a: int, b: int) -> list[tuple[int, int]]:
        out = [(a, b)]
        for s, e in self.shared.pieces(a, b):
            nxt = []
            for x, y in out:
                if e <= x or s >= y:
                    nxt.append((x, y))
                    continue
                if x < s:
                    nxt.append((x, s))
                if e < y:
                    nxt.append((e, y))
            out = nxt
        return out

    def move(self, old: int, old_len: int, new: int, new_len: int, dontunmap: bool) -> None:
        keep = min(old_len, new_len)
        lo, hi = np.searchsorted(self.resident, [old, old + keep])
        moving = self.resident[lo:hi] - old + new
        ranges = []
        for r in (self.shared, self.anon, self.huge):
            ranges.append([(s - old + new, e - old + new) for s, e in r.pieces(old, old + keep)])
        self.unmap(old, old + old_len)
        if dontunmap:
            self.anon.add(old, old + old_len)
        self.unmap(new, new + new_len)
        self.resident = np.union1d(self.resident, moving)
        for r, pieces in zip((self.shared, self.anon, self.huge), ranges, strict=True):
            for s, e in pieces:
                r.add(s, e)
        if new_len > old_len:
            grown = (new + old_len, new + new_len)
            if self.anon.contains(np.array([new + old_len - 1]))[0]:
                self.anon.add(*grown)
            if self.shared.contains(np.array([new + old_len - 1]))[0]:
                self.shared.add(*grown)


@dataclass
class AnonReplay:
    """Result of reconstruct_anon."""

    timeline: pa.Table  # ts u64, pid u32, bytes i64: replayed anon RSS after each change
    peaks: dict[int, dict[str, int]]  # pid -> {"bytes", "ts"}
    caveats: dict[int, list[str]]  # pid -> what the replay cannot see in that process
    huge_windows: int = 0  # 2 MiB windows taken as transparent huge pages


_ADDRESS_SPACE = (EventKind.MMAP, EventKind.MUNMAP, EventKind.BRK, EventKind.MADVISE,
                  EventKind.MREMAP)
_SNAPSHOT = 100  # op kind of a /proc/PID/maps snapshot


def _ops_by_pid(events: pa.Table, mappings: pa.Table, lifecycle: Lifecycle
                ) -> dict[int, list[tuple]]:
    """Each pid's operations in time order (then event order, a snapshot after the
    events of its time): its address-space events, its clones, execs and exits (the
    lifecycle's: a FORK's addr is the new task; a FORK's or an EXIT's flags 1 when it
    starts or ends a whole process), its snapshots. (ts, event_id, kind, pid, flags,
    addr, old_addr, size)."""
    kind = events["kind"].to_numpy()
    sel = np.flatnonzero(np.isin(kind, [int(k) for k in _ADDRESS_SPACE]))
    cols = {c: events[c].to_numpy()[sel] for c in ("ts", "pid", "kind", "flags", "addr",
                                                    "old_addr", "size")}
    eid = events["event_id"].to_numpy()[sel] if "event_id" in events.column_names else sel
    ops: dict[int, list[tuple]] = defaultdict(list)
    for row in zip(cols["ts"].tolist(), eid.tolist(), cols["kind"].tolist(),
                   cols["pid"].tolist(), cols["flags"].tolist(), cols["addr"].tolist(),
                   cols["old_addr"].tolist(), cols["size"].tolist(), strict=True):
        ops[row[3]].append(row)
    clones, execs, exits = lifecycle.clones, lifecycle.execs, lifecycle.exits
    for t, e, p, c, thread in zip(clones["ts"].to_pylist(), clones["event_id"].to_pylist(),
                                  clones["pid"].to_pylist(), clones["child"].to_pylist(),
                                  clones["thread"].to_pylist(), strict=True):
        ops[p].append((t, e, EventKind.FORK, p, int(not thread), c, 0, 0))
    for t, e, p in zip(execs["ts"].to_pylist(), execs["event_id"].to_pylist(),
                       execs["pid"].to_pylist(), strict=True):
        ops[p].append((t, e, EventKind.EXEC, p, 0, 0, 0, 0))
    for t, e, p, whole in zip(exits["ts"].to_pylist(), exits["event_id"].to_pylist(),
                              exits["pid"].to_pylist(), exits["process"].to_pylist(),
                              strict=True):
        ops[p].append((t, e, EventKind.EXIT, p, int(whole), 0, 0, 0))
    if mappings.num_rows:
        keys = pa.table({"ts": mappings["ts"], "pid": mappings["pid"]}).group_by(
            ["ts", "pid"]).aggregate([]).to_pylist()
        for k in keys:
            ops[k["pid"]].append((k["ts"], 0, _SNAPSHOT, k["pid"], 0, 0, 0, 0))
    for v in ops.values():
        v.sort(key=lambda r: (r[0], r[2] == _SNAPSHOT, r[1]))
    return ops


def _snapshot(space: _Space, maps: pa.Table, shift: int) -> None:
    start = maps["start"].to_numpy().astype(np.int64) >> shift
    end = (maps["end"].to_numpy().astype(np.int64) + (1 << shift) - 1) >> shift
    perms = maps["perms"].to_pylist()
    paths = maps["path"].to_pylist()
    shared, anon, mapped = PageRanges(), PageRanges(), PageRanges()
    for s, e, p, path in zip(start.tolist(), end.tolist(), perms, paths, strict=True):
        mapped.add(s, e)
        if p.endswith("s"):
            shared.add(s, e)
        elif not path or path in ("[heap]", "[stack]") or path.startswith("[anon"):
            anon.add(s, e)
    space.shared, space.anon = shared, anon
    space.resident = space.resident[mapped.contains(space.resident)]


def reconstruct_anon(faults: pa.Table, events: pa.Table, mappings: pa.Table, lifecycle: Lifecycle,
                     *, page_size: int = 4096, thp: str = "madvise",
                     rss: pa.Table | None = None) -> AnonReplay:
    """Replay page faults and address-space events into anon RSS per process."""
    shift = page_size.bit_length() - 1
    order = np.argsort(faults["ts"].to_numpy(), kind="stable")
    f_ts = faults["ts"].to_numpy()[order]
    f_pid = faults["pid"].to_numpy()[order]
    f_page = (faults["address"].to_numpy()[order] >> np.uint64(shift)).astype(np.int64)
    f_ec = faults["error_code"].to_numpy()[order]
    ops = _ops_by_pid(events, mappings, lifecycle)
    pids = sorted(set(np.unique(f_pid).tolist()) | set(ops))
    depth = fork_depths(lifecycle.forks)
    pids.sort(key=lambda p: depth.get(p, 0))
    inherited: dict[int, list[tuple[int, _Space]]] = defaultdict(list)
    out_ts: list[np.ndarray] = []
    out_pid: list[np.ndarray] = []
    out_bytes: list[np.ndarray] = []
    caveats: dict[int, list[str]] = {}
    huge_windows = 0
    maps_by_pid: dict[int, pa.Table] = {}
    if mappings.num_rows:
        mp = mappings["pid"].to_numpy()
        for p in np.unique(mp).tolist():
            maps_by_pid[p] = mappings.filter(pa.array(mp == p))
    by_pid = np.argsort(f_pid, kind="stable")
    bounds, ends = key_bounds(f_pid[by_pid], np.array(pids, dtype=f_pid.dtype))
    for pid, lo, hi in zip(pids, bounds.tolist(), ends.tolist(), strict=True):
        idx = by_pid[lo:hi]
        ts, page, ec = f_ts[idx], f_page[idx], f_ec[idx]
        notes: set[str] = set()
        space = _Space()
        seeds = inherited.get(pid, [])
        # A child inherits at its fork; the fork is its first op.
        if seeds:
            space = seeds[0][1].copy()
        plist = ops.get(pid, [])
        op_ts = np.array([o[0] for o in plist], dtype=np.uint64)
        cut = np.searchsorted(ts, op_ts, side="left").tolist() + [len(ts)]
        pos = 0
        rows = _Rows(shift)
        if seeds:
            rows.add(np.array([seeds[0][0]], np.uint64), np.array([len(space.resident)]))
        for k in range(len(plist) + 1):
            seg = slice(pos, cut[k])
            pos = cut[k]
            if seg.stop > seg.start:
                n_huge = _replay_faults(space, ts[seg], page[seg], ec[seg], thp, rows)
                huge_windows += n_huge
                if n_huge:
                    notes.add(THP_NOTE)
            if k == len(plist):
                break
            t, _, kind, _, flags, addr, old_addr, size = plist[k]
            before = len(space.resident)
            if kind == _SNAPSHOT:
                m = maps_by_pid[pid]
                _snapshot(space, m.filter(pa.array(m["ts"].to_numpy() == t)), shift)
            else:
                _apply(space, kind, flags, addr, old_addr, size, shift, thp, notes)
                if kind == EventKind.FORK and flags:
                    inherited[addr].append((t, space))
                    space = space.copy()
                if kind == EventKind.EXIT and flags:
                    space.resident = space.resident[:0]
            if len(space.resident) != before or kind in (EventKind.EXEC, EventKind.EXIT):
                rows.add(np.array([t], np.uint64), np.array([len(space.resident)]))
        if rows.ts:
            t_all = np.concatenate(rows.ts)
            out_ts.append(t_all)
            out_pid.append(np.full(len(t_all), pid, np.uint32))
            out_bytes.append(np.concatenate(rows.bytes))
        caveats[pid] = sorted(notes)
    if rss is not None and rss.num_rows:
        swap = rss.filter(pa.array((rss["member"].to_numpy() == RssMember.SWAP)
                                   & (rss["bytes"].to_numpy() > 0)))
        for p in set(swap["pid"].to_pylist()):
            caveats.setdefault(p, []).append("swap: pages swapped out are still counted")
    timeline = pa.table({
        "ts": pa.array(np.concatenate(out_ts) if out_ts else np.empty(0, np.uint64)),
        "pid": pa.array(np.concatenate(out_pid) if out_pid else np.empty(0, np.uint32)),
        "bytes": pa.array(np.concatenate(out_bytes) if out_bytes else np.empty(0, np.int64)),
    })
    peaks: dict[int, dict[str, int]] = {}
    if timeline.num_rows:
        p_all = timeline["pid"].to_numpy()
        b_all = timeline["bytes"].to_numpy()
        t_all = timeline["ts"].to_numpy()
        for p in np.unique(p_all).tolist():
            sel = np.flatnonzero(p_all == p)
            i = sel[int(np.argmax(b_all[sel]))]
            peaks[p] = {"bytes": int(b_all[i]), "ts": int(t_all[i])}
    return AnonReplay(timeline, peaks, caveats, huge_windows)


# What the fault replay cannot see in any process (memory_metadata.json lists these).
REPLAY_LIMITS = (
    "swap-out and reclaim take pages away without a fault (the rss swap member shows it)",
    "KSM merging and MADV_PAGEOUT lower RSS without an event",
    "MADV_FREE'd pages stay counted until reclaim takes them",
    "pages the kernel fills without a user fault in this process (mlock, another "
    "process's process_vm_writev) are missed; MAP_POPULATE and MADV_POPULATE_WRITE are "
    "counted",
    "a write fault the kernel refuses (SIGSEGV on a guard page) is counted as a page",
)
THP_NOTE = "thp-inferred: a 2 MiB window that took a single fault is counted as a huge page"
_CAVEAT = {
    MADV_FREE: "madv-free: lazily freed pages leave RSS only on reclaim, which faults miss",
    MADV_PAGEOUT: "madv-pageout: paged-out pages are still counted",
    MADV_MERGEABLE: "ksm: merged pages are still counted",
    MADV_COLLAPSE: "madv-collapse: collapsed huge pages are not counted",
}


def _apply(space: _Space, kind: int, flags: int, addr: int, old_addr: int, size: int,
           shift: int, thp: str, notes: set[str]) -> None:
    """Apply one address-space event to `space`."""
    page = 1 << shift
    a = addr >> shift
    b = (addr + size + page - 1) >> shift
    if kind == EventKind.MMAP:
        space.unmap(a, b)
        mflags = flags & 0xFFFFFFFF
        prot = flags >> 32
        shared = (mflags & MAP_TYPE) in (MAP_SHARED, MAP_SHARED_VALIDATE)
        anonymous = bool(mflags & MAP_ANONYMOUS) or old_addr in (2**64 - 1, 2**32 - 1)
        if shared:
            space.shared.add(a, b)
        elif anonymous:
            space.anon.add(a, b)
        if mflags & MAP_POPULATE and prot & PROT_WRITE and not shared:
            space.populate(a, b)
    elif kind == EventKind.MUNMAP:
        space.unmap(a, b)
    elif kind == EventKind.BRK:
        new, old = addr, old_addr
        lo, hi = (new + page - 1) >> shift, (old + page - 1) >> shift
        if new < old:
            space.unmap(lo, hi)
        else:
            space.anon.add(hi, lo)
    elif kind == EventKind.MADVISE:
        if flags in _DROPS:
            space.drop(a, b)
        elif flags == MADV_POPULATE_WRITE:
            space.populate(a, b)
        elif flags == MADV_HUGEPAGE:
            space.huge.add(a, b)
        elif flags == MADV_NOHUGEPAGE:
            space.huge.remove(a, b)
        elif flags in _CAVEAT:
            notes.add(_CAVEAT[flags])
    elif kind == EventKind.MREMAP:
        old_len = ((flags >> 8) + page - 1) >> shift
        new_len = (size + page - 1) >> shift
        space.move(old_addr >> shift, old_len, a, new_len, bool(flags & MREMAP_DONTUNMAP))
    elif kind == EventKind.EXEC:
        space.resident = space.resident[:0]
        space.shared, space.anon, space.huge = PageRanges(), PageRanges(), PageRanges()


class _Rows:
    """Replayed anon RSS rows of one process, in pages turned to bytes."""

    def __init__(self, shift: int) -> None:
        self.shift = shift
        self.ts: list[np.ndarray] = []
        self.bytes: list[np.ndarray] = []

    def add(self, ts: np.ndarray, pages: np.ndarray) -> None:
        self.ts.append(ts)
        self.bytes.append(pages.astype(np.int64) << self.shift)


def _replay_faults(space: _Space, ts: np.ndarray, page: np.ndarray, ec: np.ndarray, thp: str,
                   rows: _Rows) -> int:
    """Apply one run of faults with no address-space event between them; returns the
    number of 2 MiB windows taken as huge pages."""
    write = (ec & FAULT_WRITE) != 0
    sel = write & ~space.shared.contains(page)
    ts, page, ec = ts[sel], page[sel], ec[sel]
    if not len(page):
        return 0
    huge = _huge_faults(space, page, ec, thp)
    n_huge = int(huge.sum())
    if n_huge:
        win = 1 << THP_ORDER
        starts = (page[huge] >> THP_ORDER) << THP_ORDER
        extra = (starts[:, None] + np.arange(win, dtype=np.int64)[None, :]).ravel()
        page = np.concatenate([page, extra])
        ts = np.concatenate([ts, np.repeat(ts[huge], win)])
        o = np.argsort(ts, kind="stable")
        page, ts = page[o], ts[o]
    new = ~np.isin(page, space.resident)
    if not new.any():
        return n_huge
    _, first = np.unique(page[new], return_index=True)
    first_mask = np.zeros(int(new.sum()), bool)
    first_mask[first] = True
    count = len(space.resident) + np.cumsum(first_mask)
    t_new = ts[new]
    # one row per distinct timestamp: its last count
    last = np.r_[t_new[1:] != t_new[:-1], True]
    rows.add(t_new[last], count[last])
    space.resident = np.union1d(space.resident, page[new])
    return n_huge


def _huge_faults(space: _Space, page: np.ndarray, ec: np.ndarray, thp: str) -> np.ndarray:
    """Mask of the faults that mapped a whole transparent huge page: a not-present fault
    in an eligible private anonymous mapping whose aligned 2 MiB window lies inside it,
    had no resident page, and took no other not-present fault in this run (a failed
    huge allocation falls back to one fault per small page)."""
    out = np.zeros(len(page), bool)
    if thp not in ("always", "madvise"):
        return out
    win = page >> THP_ORDER
    wstart = win << THP_ORDER
    wend = wstart + (1 << THP_ORDER)
    ok = ((ec & FAULT_PRESENT) == 0) & space.anon.contains(wstart)
    ok &= space.anon.end_of(wstart) >= wend
    if thp == "madvise":
        ok &= space.huge.contains(wstart) & (space.huge.end_of(wstart) >= wend)
    if not ok.any():
        return out
    ok &= ~np.isin(win, np.unique(space.resident >> THP_ORDER))
    np_faults = (ec & FAULT_PRESENT) == 0
    wins, counts = np.unique(win[np_faults], return_counts=True)
    single = np.isin(win, wins[counts == 1])
    return ok & single
