"""The lifecycle stage: process and thread lifecycle, derived once from the events
(FORK, EXEC, EXIT) and the artifact's processes rows (`of_artifact`, which `process`,
`info` and memory_metadata.json run alike); pairing, the RSS stage, the anon replay, the
inherited address spaces, the processes and threads tables and memory_metadata.json all
read it from there.

The words (docs/DESIGN.md, Process, step 2): a *process* runs from its fork (or
from when it was first seen) to its exit, and a pid the kernel hands out again during
the capture starts another process; a process runs one *image* from its fork to its
first exec, then one after each exec (an image ends at its pid's next boundary: an
exec, the exit, a fork that hands the pid out again); a forked child *inherits* a copy
of its parent's address space, and with it the blocks alive in it. A child that never
exec'd and was never snapshotted carries its parent's identity (a fork copies it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from memtrack.process.stage import StageResult
from memtrack.schema import clones
from memtrack.schema.enums import CLONE_VM, EXIT_PROCESS, EndReason, EventKind

END_EXEC, END_EXIT = EndReason.EXEC, EndReason.EXIT

if TYPE_CHECKING:
    from memtrack.process.read import ArtifactTables
    from memtrack.schema.manifest import Manifest


@dataclass
class Process:
    """One process: a pid from its fork (or first sight) to its exit."""

    pid: int
    start_ns: int | None
    ppid: int | None = None
    exit_ns: int | None = None
    exit_raw: int | None = None  # the kernel's exit_code: status << 8 | signal
    idents: list[dict[str, Any]] = field(default_factory=list)  # processes rows, in time
    execs: list[int] = field(default_factory=list)

    def identity(self, by_pid: dict[int, list[Process]]) -> dict[str, Any]:
        """comm/exe/cmdline of the process: its latest processes row, else its parent's
        at the fork (up the tree until one has a row)."""
        if self.idents:
            return _ident(self.idents[-1])
        seen = {id(self)}
        parent: Process = self
        start = self.start_ns or 0
        while parent.ppid is not None:
            cands = [p for p in by_pid.get(parent.ppid, []) if (p.start_ns or 0) <= start]
            if not cands or id(cands[-1]) in seen:
                break
            parent = cands[-1]
            seen.add(id(parent))
            before = [r for r in parent.idents if r["ts"] <= start] or parent.idents
            if before:
                return _ident(before[-1])
        return {"comm": None, "exe": None, "cmdline": None}


    def ns_pid(self) -> int | None:
        """The process's pid in its own pid namespace: its latest processes row that knows
        it (never its parent's: that is another pid)."""
        known = [r.get("ns_pid") for r in self.idents if r.get("ns_pid") is not None]
        return known[-1] if known else None


def _ident(row: dict[str, Any]) -> dict[str, Any]:
    return {"comm": row["comm"], "exe": row["exe"], "cmdline": row["cmdline"]}


def exit_status(raw: int | None) -> dict[str, int | None] | None:
    """{"code", "signal"} of the kernel's exit_code (status << 8 | signal): a code when
    the process exited, a signal when one killed it; the processes table and
    memory_metadata.json both decode it here."""
    if raw is None:
        return None
    sig = raw & 0x7F
    return {"code": None if sig else (raw >> 8) & 0xFF, "signal": sig or None}


@dataclass
class Lifecycle(StageResult):
    """The lifecycle events as tables (ts-ordered), and the processes."""

    clones: pa.Table  # every FORK: event_id, ts, pid, tid (the parent), child, thread, flags
    execs: pa.Table  # event_id, ts, pid
    exits: pa.Table  # every EXIT: event_id, ts, pid, tid, status, process (whole process)
    processes: list[Process]  # by start, then pid

    @property
    def forks(self) -> pa.Table:
        """Process forks (not new threads): event_id, ts, parent, child, flags (clone
        flags: CLONE_VM, a vfork, shares its parent's memory)."""
        t = self.clones.filter(pa.array(~self.clones["thread"].to_numpy(zero_copy_only=False)))
        return pa.table({"event_id": t["event_id"], "ts": t["ts"], "parent": t["pid"],
                         "child": t["child"], "flags": t["flags"]})

    @property
    def process_exits(self) -> pa.Table:
        """Whole-process exits: event_id, ts, pid, status."""
        t = self.exits.filter(self.exits["process"])
        return t.select(["event_id", "ts", "pid", "status"])

    def images(self, events: int) -> Images:
        """Where each image ends, for event ids below `events` (memtrack.process.pair's
        bounds on a block's lifetime, the spill's forked children that touch their heap)."""
        return Images(self, events)

    def by_pid(self) -> dict[int, list[Process]]:
        out: dict[int, list[Process]] = defaultdict(list)
        for lf in self.processes:
            out[lf.pid].append(lf)
        return out

    def processes_table(self) -> pa.Table:
        """The run database's processes rows, one per pid: its last process, named by its
        latest processes row (any of the pid's processes'), else by its ancestors'."""
        by_pid = self.by_pid()
        last = sorted((ls[-1] for ls in by_pid.values()), key=lambda lf: (lf.start_ns or 0,
                                                                           lf.pid))
        rows = []
        for lf in last:
            named = [x for x in by_pid[lf.pid] if x.idents]
            ident = named[-1].identity(by_pid) if named else lf.identity(by_pid)
            status = exit_status(lf.exit_raw) or {"code": None, "signal": None}
            rows.append({"pid": lf.pid, "ppid": lf.ppid, "name": ident["comm"],
                         "exe": ident["exe"], "cmdline": ident["cmdline"],
                         "start_ts": lf.start_ns, "exit_ts": lf.exit_ns,
                         "exit_status": lf.exit_raw, "exit_code": status["code"],
                         "exit_signal": status["signal"], "ns_pid": lf.ns_pid()})
        return pa.Table.from_pylist(rows, schema=PROCESS_ROWS)


class Images:
    """Where each image ends: a fork that hands its pid out again (a new process
    starts), an exec or an exit, in event order per pid; an image is numbered by the
    boundaries of its pid before it."""

    def __init__(self, lc: Lifecycle, events: int) -> None:
        forks, execs, exits = lc.forks, lc.execs, lc.process_exits
        b_pid = np.concatenate([forks["child"].to_numpy(), execs["pid"].to_numpy(),
                                exits["pid"].to_numpy()]).astype(np.int64)
        b_eid = np.concatenate([forks["event_id"].to_numpy(), execs["event_id"].to_numpy(),
                                exits["event_id"].to_numpy()]).astype(np.int64)
        b_ts = np.concatenate([forks["ts"].to_numpy(), execs["ts"].to_numpy(),
                               exits["ts"].to_numpy()]).astype(np.uint64)
        b_reason = np.concatenate([
            np.full(forks.num_rows, END_EXIT), np.full(execs.num_rows, END_EXEC),
            np.full(exits.num_rows, END_EXIT)])  # fmt: skip
        # a fork that copies the address space (not a vfork: CLONE_VM shares it)
        copying = np.concatenate([(forks["flags"].to_numpy() & CLONE_VM) == 0,
                                  np.zeros(execs.num_rows + exits.num_rows, bool)])
        self.stride = events + 1
        key = b_pid * self.stride + b_eid
        order = np.argsort(key, kind="stable")
        self.key, self.pid = key[order], b_pid[order]
        self.eid, self.ts, self.reason = b_eid[order], b_ts[order], b_reason[order]
        self.groups = len(key) + 1  # a pid's images are fewer: (pid, image) key
        self.attached = np.zeros(0, np.int64)  # heaps_before_attach's (pid, image) keys
        # an exec that ends a prelude: the process's boundary before it is its fork
        copying = copying[order]
        self.ends_prelude = self.reason == END_EXEC
        self.ends_prelude[1:] &= copying[:-1] & (self.pid[1:] == self.pid[:-1])
        self.ends_prelude[:1] = False

    def heaps_before_attach(self, attached: list[int], fork_ev: np.ndarray,
                            parent: np.ndarray, child: np.ndarray) -> None:
        """The images whose heap holds blocks allocated before the run began (`capture
        --pid`): each attached process's first, and the image a fork of such an image
        starts (the child's copy of that heap); `fork_ev`, `parent`, `child`: the forks
        whose children inherit, in event order."""
        heaps = {(pid, 0) for pid in attached}
        if heaps:
            for ev, p, c in zip(fork_ev.tolist(), parent.tolist(), child.tolist(),
                                strict=True):
                e = np.array([ev])
                if (p, int(self.image(np.array([p]), e)[0])) in heaps:
                    heaps.add((c, int(self.image(np.array([c]), e)[0])))
        self.attached = np.array(sorted(p * self.groups + i for p, i in heaps), np.int64)

    def before_attach(self, pid: np.ndarray, image: np.ndarray) -> np.ndarray:
        """Whether each (pid, image) is one of heaps_before_attach's."""
        return np.isin(pid.astype(np.int64) * self.groups + image, self.attached)

    def image(self, p: np.ndarray, e: np.ndarray) -> np.ndarray:
        """The image of pid p that event e falls in: how many boundaries of p came at or
        before e."""
        return np.searchsorted(self.key, p * self.stride + e, side="right") - \
            np.searchsorted(self.key, p * self.stride, side="left")

    def in_prelude(self, p: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Whether event e of pid p falls in a prelude: after the fork that made p (not a
        vfork) and before the exec that comes next in p."""
        if not len(self.key):
            return np.zeros(len(p), bool)
        j = self.next_boundary(p, e)
        return (j >= 0) & self.ends_prelude[np.maximum(j, 0)]

    def next_boundary(self, p: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Index into the boundaries of pid p's first one after event e, -1: none."""
        if not len(self.key):
            return np.full(len(p), -1, np.int64)
        j = np.searchsorted(self.key, p * self.stride + e, side="right")
        jc = np.minimum(j, len(self.key) - 1)
        return np.where((j < len(self.key)) & (self.pid[jc] == p), jc, -1)


PROCESS_ROWS = pa.schema([
    ("pid", pa.uint32()), ("ppid", pa.uint32()), ("name", pa.string()), ("exe", pa.string()),
    ("cmdline", pa.list_(pa.string())), ("start_ts", pa.uint64()), ("exit_ts", pa.uint64()),
    ("exit_status", pa.int32()), ("exit_code", pa.int32()), ("exit_signal", pa.int32()),
    ("ns_pid", pa.uint32()),
])  # fmt: skip


def of_artifact(tables: ArtifactTables, manifest: Manifest,
                first_seen: dict[int, int] | None = None) -> Lifecycle:
    """The lifecycle of an artifact: its events' (or, when `tables` came through a
    spill, the lifecycle events it kept, with `first_seen` the spill's) and processes
    rows, its root pid and start from the manifest."""
    return lifecycle(tables.events, tables.processes, root_pid=manifest.root_pid,
                     start_ns=manifest.start_ns, first_seen=first_seen)


def lifecycle(events: pa.Table, processes: pa.Table | None = None, *, root_pid: int = 0,
              start_ns: int = 0, first_seen: dict[int, int] | None = None) -> Lifecycle:
    """The lifecycle of a capture from its events (any order; `event_id` when they have
    one, else their position) and processes rows; `root_pid` and `start_ns` (the
    manifest's) give the root a process even when nothing else names it. `first_seen`:
    each pid's first event's time, when `events` are not all of them (a spill's)."""
    n = events.num_rows
    ts = events["ts"].to_numpy()
    in_order = n < 2 or bool((ts[1:] >= ts[:-1]).all())
    order = None if in_order else np.argsort(ts, kind="stable")
    # only the lifecycle events are gathered (a few per process among millions)
    kinds = events["kind"].to_numpy()
    rows = np.flatnonzero(np.isin(kinds, (EventKind.FORK, EventKind.EXEC, EventKind.EXIT)))
    del kinds
    if order is not None:
        rows = rows[np.argsort(ts[rows], kind="stable")]
    picked = events.take(pa.array(rows))
    col = {c: picked[c].to_numpy() for c in ("ts", "pid", "tid", "kind", "flags", "addr",
                                             "size")}
    eid = (picked["event_id"].to_numpy() if "event_id" in events.column_names
           else rows.astype(np.uint64))
    kind, flags = col["kind"], col["flags"]
    fk, task, thread = clones(kind, flags, col["addr"])
    clone_rows = pa.table({
        "event_id": pa.array(eid[fk], pa.uint64()), "ts": pa.array(col["ts"][fk], pa.uint64()),
        "pid": pa.array(col["pid"][fk], pa.uint32()), "tid": pa.array(col["tid"][fk], pa.uint32()),
        "child": pa.array(task, pa.uint32()), "thread": pa.array(thread),
        "flags": pa.array(flags[fk], pa.uint64())})  # fmt: skip
    ex = kind == EventKind.EXEC
    execs = pa.table({"event_id": pa.array(eid[ex], pa.uint64()),
                      "ts": pa.array(col["ts"][ex], pa.uint64()),
                      "pid": pa.array(col["pid"][ex], pa.uint32())})
    xt = kind == EventKind.EXIT
    exits = pa.table({
        "event_id": pa.array(eid[xt], pa.uint64()), "ts": pa.array(col["ts"][xt], pa.uint64()),
        "pid": pa.array(col["pid"][xt], pa.uint32()), "tid": pa.array(col["tid"][xt], pa.uint32()),
        "status": pa.array(col["size"][xt].astype(np.int64).astype(np.int32), pa.int32()),
        "process": pa.array((flags[xt] & EXIT_PROCESS) != 0)})  # fmt: skip
    if first_seen is None and n:  # each pid's earliest event
        pid = events["pid"].to_numpy()
        pids, first = np.unique(pid if order is None else pid[order], return_index=True)
        first_seen = dict(zip(pids.tolist(), (ts if order is None else ts[order])[first]
                              .tolist(), strict=True))
    first_seen = first_seen or {}
    lc = Lifecycle(clone_rows, execs, exits, [])
    lc.processes = _processes(lc, processes, first_seen, root_pid, start_ns)
    return lc


def _processes(lc: Lifecycle, rows_table: pa.Table | None, first_seen: dict[int, int],
               root_pid: int, start_ns: int) -> list[Process]:
    """The processes: forks start them, exits end them, execs and processes rows (who
    each process was, at start and after each exec) fall in the process that holds
    them."""
    of_pid: dict[int, list[Process]] = defaultdict(list)

    def current(pid: int, ts: int) -> Process:
        last = of_pid[pid][-1] if of_pid[pid] else None
        if last is None or (last.exit_ns is not None and last.exit_ns < ts):
            of_pid[pid].append(Process(pid, None))
        return of_pid[pid][-1]

    forks, pexits, execs = lc.forks, lc.process_exits, lc.execs
    steps = [(e, t, 0, p, c, 0) for e, t, p, c in zip(
        forks["event_id"].to_pylist(), forks["ts"].to_pylist(), forks["parent"].to_pylist(),
        forks["child"].to_pylist(), strict=True)]
    steps += [(e, t, 1, p, 0, 0) for e, t, p in zip(
        execs["event_id"].to_pylist(), execs["ts"].to_pylist(), execs["pid"].to_pylist(),
        strict=True)]
    steps += [(e, t, 2, p, 0, s) for e, t, p, s in zip(
        pexits["event_id"].to_pylist(), pexits["ts"].to_pylist(), pexits["pid"].to_pylist(),
        pexits["status"].to_pylist(), strict=True)]
    steps.sort(key=lambda x: (x[1], x[0]))  # in time, then in event order
    for _, ts, what, pid, child, status in steps:
        if what == 0:
            if of_pid[child] and of_pid[child][-1].exit_ns is None \
                    and of_pid[child][-1].start_ns is None:
                proc = of_pid[child][-1]  # seen (processes row) before its fork event
                proc.start_ns, proc.ppid = ts, pid
            else:
                of_pid[child].append(Process(child, ts, ppid=pid))
        elif what == 1:
            current(pid, ts).execs.append(ts)
        else:
            proc = current(pid, ts)
            proc.exit_ns, proc.exit_raw = ts, status
    rows = rows_table.sort_by([("ts", "ascending")]).to_pylist() if rows_table is not None \
        else []
    for row in rows:
        pid = row["pid"]
        cands = [lf for lf in of_pid[pid] if lf.start_ns is None or lf.start_ns <= row["ts"]]
        proc = cands[-1] if cands else current(pid, row["ts"])
        if proc.ppid is None and row["ppid"]:
            proc.ppid = row["ppid"]
        proc.idents.append(row)
    if root_pid and not of_pid[root_pid]:
        of_pid[root_pid].append(Process(root_pid, start_ns or None))
    for pid, ts in first_seen.items():  # a pid only its events name
        if not of_pid[pid]:
            of_pid[pid].append(Process(pid, ts))
    out = [lf for ls in of_pid.values() for lf in ls]
    for lf in out:
        if lf.start_ns is None:
            seen = [t for t in (lf.idents[0]["ts"] if lf.idents else None,
                                first_seen.get(lf.pid)) if t is not None]
            lf.start_ns = min(seen) if seen else (start_ns or None)
    out.sort(key=lambda lf: (lf.start_ns or 0, lf.pid))
    return out


def fork_depths(forks: pa.Table) -> dict[int, int]:
    """Child pid -> its depth below the first traced ancestor (1 = its parent was not
    itself forked during the capture). A reused pid takes its latest fork."""
    parent_of = dict(zip(forks["child"].to_pylist(), forks["parent"].to_pylist(), strict=True))
    depth: dict[int, int] = {}
    for child in parent_of:
        chain: list[int] = []
        seen: set[int] = set()
        x = child
        while x in parent_of and x not in depth and x not in seen:
            chain.append(x)
            seen.add(x)
            x = parent_of[x]
        d = depth.get(x, 0)
        for y in reversed(chain):
            d += 1
            depth[y] = d
    return depth
