"""memory_metadata.json: who each traced process was, and its peak resident memory.

Built from processes.arrow (comm, exe, cmdline at start and after each exec), the FORK /
EXEC / EXIT events and rss.arrow (through memtrack.process.rss). One entry per process
life: a pid that the kernel hands out again during the capture gets a second entry.
A child that never exec'd and was never snapshotted carries its parent's identity (a
fork copies it). Times are CLOCK_MONOTONIC ns as in the artifact; `clock.wall_offset_ns`
turns them into Unix time.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.process.rss import (
    CLONE_THREAD,
    REPLAY_LIMITS,
    artifact_rss,
    artifact_thp_mode,
    peaks_by_pid,
    reconstruct_anon,
    rss_peaks,
)
from memtrack.schema import EventKind
from memtrack.schema.artifact import Artifact

METADATA_VERSION = 1


@dataclass
class _Life:
    pid: int
    start_ns: int | None
    ppid: int | None = None
    exit_ns: int | None = None
    exit_raw: int | None = None  # the kernel's exit_code: status << 8 | signal
    idents: list[dict[str, Any]] = field(default_factory=list)  # processes rows, in time
    execs: list[int] = field(default_factory=list)


def _exit_status(raw: int | None) -> dict[str, int | None] | None:
    if raw is None:
        return None
    sig = raw & 0x7F
    return {"code": None if sig else (raw >> 8) & 0xFF, "signal": sig or None}


def _lives(art: Artifact) -> list[_Life]:
    ev = art.read("events", required=False).table
    procs = art.read("processes", required=False).table.sort_by([("ts", "ascending")])
    kind = ev["kind"].to_numpy()
    flags = ev["flags"].to_numpy()
    life_ev = (kind == EventKind.EXEC) | ((kind == EventKind.EXIT) & ((flags & 1) == 1)) | (
        (kind == EventKind.FORK) & ((flags & CLONE_THREAD) == 0))
    lev = ev.filter(pa.array(life_ev)).sort_by([("ts", "ascending")]).to_pylist()
    lives: dict[int, list[_Life]] = defaultdict(list)
    m = art.manifest

    def current(pid: int, ts: int) -> _Life:
        if not lives[pid] or (lives[pid][-1].exit_ns is not None and lives[pid][-1].exit_ns < ts):
            lives[pid].append(_Life(pid, None))
        return lives[pid][-1]

    for e in lev:
        if e["kind"] == EventKind.FORK:
            child = e["addr"] & 0xFFFFFFFF
            if lives[child] and lives[child][-1].exit_ns is None \
                    and lives[child][-1].start_ns is None:
                life = lives[child][-1]  # seen (processes row) before its fork event
                life.start_ns, life.ppid = e["ts"], e["pid"]
            else:
                lives[child].append(_Life(child, e["ts"], ppid=e["pid"]))
        elif e["kind"] == EventKind.EXEC:
            current(e["pid"], e["ts"]).execs.append(e["ts"])
        else:
            life = current(e["pid"], e["ts"])
            life.exit_ns, life.exit_raw = e["ts"], e["size"]
    for row in procs.to_pylist():
        pid = row["pid"]
        cands = [lf for lf in lives[pid] if lf.start_ns is None or lf.start_ns <= row["ts"]]
        life = cands[-1] if cands else current(pid, row["ts"])
        if life.ppid is None and row["ppid"]:
            life.ppid = row["ppid"]
        life.idents.append(row)
    if m.root_pid and not lives[m.root_pid]:
        lives[m.root_pid].append(_Life(m.root_pid, m.start_ns or None))
    out = [lf for ls in lives.values() for lf in ls]
    for lf in out:
        if lf.start_ns is None:
            lf.start_ns = lf.idents[0]["ts"] if lf.idents else (m.start_ns or None)
        if lf.pid == m.root_pid and lf.exit_raw is None and (
                m.exit_status.code is not None or m.exit_status.signal is not None):
            lf.exit_raw = ((m.exit_status.code or 0) << 8) | (m.exit_status.signal or 0)
    out.sort(key=lambda lf: (lf.start_ns or 0, lf.pid))
    return out


def _identity(life: _Life, by_pid: dict[int, list[_Life]]) -> dict[str, Any]:
    """comm/exe/cmdline of a life: its latest processes row, else its parent's at the fork."""
    if life.idents:
        row = life.idents[-1]
        return {"comm": row["comm"], "exe": row["exe"], "cmdline": row["cmdline"]}
    seen = {id(life)}
    parent = life
    while parent.ppid is not None:
        cands = [p for p in by_pid.get(parent.ppid, []) if (p.start_ns or 0) <= (life.start_ns
                                                                                   or 0)]
        if not cands or id(cands[-1]) in seen:
            break
        parent = cands[-1]
        seen.add(id(parent))
        before = [r for r in parent.idents if r["ts"] <= (life.start_ns or 0)] or parent.idents
        if before:
            row = before[-1]
            return {"comm": row["comm"], "exe": row["exe"], "cmdline": row["cmdline"]}
    return {"comm": None, "exe": None, "cmdline": None}


def memory_metadata(art: Artifact) -> dict[str, Any]:
    """The content of memory_metadata.json as plain data."""
    m = art.manifest
    lives = _lives(art)
    by_pid: dict[int, list[_Life]] = defaultdict(list)
    for lf in lives:
        by_pid[lf.pid].append(lf)
    timeline, peaks_tbl = artifact_rss(art)
    peaks = peaks_by_pid(peaks_tbl)
    faults = art.read("faults", required=False).table
    replay = None
    if faults.num_rows:
        replay = reconstruct_anon(
            faults, art.read("events", required=False).table,
            art.read("mappings", required=False).table,
            page_size=m.host.page_size or 4096,
            thp=artifact_thp_mode(art),
            rss=art.read("rss", required=False).table)
    tl_pid = timeline["pid"].to_numpy()
    tl_ts = timeline["ts"].to_numpy()
    processes = []
    for lf in lives:
        entry: dict[str, Any] = {
            "pid": lf.pid,
            "ppid": lf.ppid,
            **_identity(lf, by_pid),
            "start_ns": lf.start_ns,
            "exit_ns": lf.exit_ns,
            "exit_status": _exit_status(lf.exit_raw),
            "exec_ns": lf.execs,
            "history": [
                {"ts": r["ts"], "comm": r["comm"], "exe": r["exe"], "cmdline": r["cmdline"]}
                for r in lf.idents
            ],
        }
        pk = peaks.get(lf.pid, {})
        if len(by_pid[lf.pid]) > 1:
            # pid reused: take the peaks of this life's own span only
            lo, hi = lf.start_ns or 0, lf.exit_ns if lf.exit_ns is not None else 2**64 - 1
            span = (tl_pid == lf.pid) & (tl_ts >= lo) & (tl_ts <= hi)
            pk = peaks_by_pid(rss_peaks(timeline.filter(pa.array(span)))).get(lf.pid, {})
        entry["peak_rss"] = pk
        if replay is not None:
            entry["anon_replay"] = {
                "peak": replay.peaks.get(lf.pid),
                "caveats": replay.caveats.get(lf.pid, []),
            }
        processes.append(entry)
    return {
        "version": METADATA_VERSION,
        "artifact": str(art.path),
        "command": m.command,
        "root_pid": m.root_pid,
        "clock": {"source": m.clock.source, "wall_offset_ns": m.clock.wall_offset_ns},
        "page_size": m.host.page_size,
        "processes": processes,
        **({"anon_replay_limits": list(REPLAY_LIMITS)} if replay is not None else {}),
    }


def write_memory_metadata(artifact: Artifact, path: Path | str) -> Path:
    """Write memory_metadata.json for `artifact` to `path`; returns the path."""
    path = Path(path)
    data = memory_metadata(artifact)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def _json_default(o: object) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    raise TypeError(f"cannot serialize {type(o).__name__}")
