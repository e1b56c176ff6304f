"""The RSS stage: resident memory per process over time, and its peaks.

`effective_rss` turns the kmem:rss_stat updates of rss.arrow into each process's
resident bytes per member over time:
- an update a process made on its own mm is the new absolute value (latest wins);
- an `external` update (made from another task's context) may only lower a counter,
  so a stale read or an mm_id collision cannot invent a peak; one that arrives before
  anything is known of the process is dropped;
- a forked child starts from its parent's values at the fork (rss_stat never reports
  the counters the kernel copies into a child's new mm);
- exec and the process's exit reset every member to 0; nothing after the exit counts.

The fault-based replay of anonymous RSS is memtrack.process.anon_replay.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memtrack.process.anon_replay import AnonReplay, reconstruct_anon, thp_mode
from memtrack.process.lifecycle import Lifecycle, fork_depths
from memtrack.process.lookup import key_bounds
from memtrack.process.read import ArtifactTables
from memtrack.process.stage import StageResult
from memtrack.schema.enums import RssCause, RssMember
from memtrack.schema.manifest import Manifest
from memtrack.schema.stages import EFFECTIVE_RSS, RSS_PEAKS

_RESIDENT = (RssMember.FILE, RssMember.ANON, RssMember.SHMEM)


def _cols(t: dict[str, np.ndarray], order: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[order] for k, v in t.items()}


def _effective(rows: dict[str, np.ndarray], bounds: tuple[np.ndarray, np.ndarray, np.ndarray]
               ) -> dict[str, np.ndarray]:
    """Apply the rules to raw rows (any order); returns the kept rows sorted by pid,
    member, ts, seq with `bytes` the effective value."""
    r = _cols(rows, np.lexsort((rows["seq"], rows["ts"], rows["member"], rows["pid"])))
    n = len(r["ts"])
    if not n:
        return r
    part = r["pid"].astype(np.int64) * 8 + r["member"]
    new_part = np.r_[True, part[1:] != part[:-1]]
    external = r["cause"] == RssCause.EXTERNAL
    start = new_part | ~external
    grp = np.cumsum(start) - 1
    # External rows may only lower: a running minimum inside each group (which starts at
    # an own value, a seed or a reset). Values become ranks and each group an offset
    # below every earlier group, so one cumulative minimum serves all groups.
    values, rank = np.unique(r["bytes"], return_inverse=True)
    u = np.int64(len(values))
    g = np.int64(grp[-1] + 1)
    offset = (g - 1 - grp) * u
    eff = np.minimum.accumulate(offset + rank) - offset
    r["bytes"] = values[eff]
    # an external update with nothing known before it cannot lower anything: dropped
    keep = ~external[np.flatnonzero(start)[grp]]
    keep &= _alive(r["pid"], r["ts"], r["cause"], bounds)
    return _cols(r, np.flatnonzero(keep))


def _alive(pid: np.ndarray, ts: np.ndarray, cause: np.ndarray,
           bounds: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Rows not after their process's exit (a fork of the same pid starts another process)."""
    l_pid, l_ts, l_alive = bounds
    if not len(l_pid):
        return np.ones(len(pid), bool)
    n = len(pid)
    a_pid = np.concatenate([l_pid, pid])
    a_ts = np.concatenate([l_ts, ts])
    is_bound = np.r_[np.ones(len(l_pid), bool), np.zeros(n, bool)]
    o = np.lexsort((~is_bound, a_ts, a_pid))  # a fork or exit before rows at its ts
    pid_o, is_bound_o = a_pid[o], is_bound[o]
    idx = np.where(is_bound_o, np.arange(len(o)), -1)
    new_pid = np.r_[True, pid_o[1:] != pid_o[:-1]]
    # forward fill the last fork or exit within each pid
    marker = np.where(new_pid & ~is_bound_o, -1, idx)
    seg = np.cumsum(new_pid) - 1
    seg_start = np.flatnonzero(new_pid)
    last = np.maximum.accumulate(np.where(marker >= 0, marker, -1))
    last = np.where(last >= seg_start[seg], last, -1)
    alive_at = np.ones(len(o), bool)
    has = last >= 0
    bound_idx = o[last[has]]  # index into the concatenation: < len(l_pid)
    alive_at[has] = l_alive[bound_idx] | (l_ts[bound_idx] == a_ts[o][has])
    keep = np.empty(n, bool)
    rows = ~is_bound_o
    keep[o[rows] - len(l_pid)] = alive_at[rows]
    return keep | (cause == RssCause.EXIT)


def _value_at(eff: dict[str, np.ndarray], pid: int, member: int, ts: int) -> int | None:
    """The effective value of (pid, member) as of ts, from _effective's sorted rows."""
    part = eff["pid"].astype(np.int64) * 8 + eff["member"]
    key = pid * 8 + member
    lo, hi = key_bounds(part, key)
    i = lo + int(np.searchsorted(eff["ts"][lo:hi], ts, side="right")) - 1
    return int(eff["bytes"][i]) if i >= lo else None


def effective_rss(rss: pa.Table, lifecycle: Lifecycle) -> pa.Table:
    """Each process's resident bytes per member over time (EFFECTIVE_RSS), ts-sorted."""
    forks, execs, exits = lifecycle.forks, lifecycle.execs, lifecycle.process_exits
    n = rss.num_rows
    parts = [{
        "ts": rss["ts"].to_numpy(),
        "pid": rss["pid"].to_numpy(),
        "member": rss["member"].to_numpy(),
        "bytes": rss["bytes"].to_numpy(),
        "cause": np.where(rss["external"].to_numpy(zero_copy_only=False),
                          RssCause.EXTERNAL, RssCause.UPDATE).astype(np.uint8),
        "seq": np.arange(n, dtype=np.int64),
    }]
    for table, cause in ((execs, RssCause.EXEC), (exits, RssCause.EXIT)):
        k = table.num_rows
        parts.append({
            "ts": np.repeat(table["ts"].to_numpy(), 4),
            "pid": np.repeat(table["pid"].to_numpy(), 4),
            "member": np.tile(np.arange(4, dtype=np.uint8), k),
            "bytes": np.zeros(4 * k, dtype=np.int64),
            "cause": np.full(4 * k, cause, dtype=np.uint8),
            "seq": np.full(4 * k, n + 1, dtype=np.int64),  # after whatever else at its ts
        })
    f_ts = forks["ts"].to_numpy()
    f_parent = forks["parent"].to_numpy()
    f_child = forks["child"].to_numpy()
    x_pid, x_ts = exits["pid"].to_numpy(), exits["ts"].to_numpy()
    bounds = (np.concatenate([f_child, x_pid]).astype(np.uint32), np.concatenate([f_ts, x_ts]),
             np.r_[np.ones(len(f_ts), bool), np.zeros(len(x_ts), bool)])
    depth = fork_depths(forks)
    rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    # A child's seed reads its parent's effective values, which may hold the parent's own
    # seed: fork generations are resolved in order.
    for gen in sorted(set(depth.values())):
        eff = _effective(rows, bounds)
        seeds: dict[str, list[int]] = {k: [] for k in rows}
        for ts, parent, child in zip(f_ts.tolist(), f_parent.tolist(), f_child.tolist(),
                                     strict=True):
            if depth.get(child) != gen:
                continue
            for m in range(4):
                v = _value_at(eff, parent, m, ts)
                if v is None:
                    continue
                for k, x in (("ts", ts), ("pid", child), ("member", m), ("bytes", v),
                             ("cause", RssCause.FORK), ("seq", -1)):
                    seeds[k].append(x)
        rows = {k: np.concatenate([rows[k], np.array(seeds[k], dtype=rows[k].dtype)])
                for k in rows}
    eff = _effective(rows, bounds)
    o = np.lexsort((eff["seq"], eff["ts"]))
    return pa.table({k: pa.array(eff[k][o], EFFECTIVE_RSS.field(k).type)
                     for k in EFFECTIVE_RSS.names})


def rss_peaks(timeline: pa.Table) -> pa.Table:
    """Peak bytes per process and member, and of the total (file + anon + shmem), each
    with the first time it was reached (RSS_PEAKS); members never above 0 are left out."""
    ts = timeline["ts"].to_numpy()
    pid = timeline["pid"].to_numpy()
    member = timeline["member"].to_numpy()
    val = timeline["bytes"].to_numpy()
    n = len(ts)
    o = np.lexsort((np.arange(n), ts, pid))  # per pid in time order (stable)
    ts, pid, member, val = ts[o], pid[o], member[o], val[o]
    new_pid = np.r_[True, pid[1:] != pid[:-1]] if n else np.zeros(0, bool)
    seg_start = np.flatnonzero(new_pid)
    seg = np.cumsum(new_pid) - 1
    total = np.zeros(n, np.int64)
    for m in _RESIDENT:
        # the member's latest value at each row, within the same pid
        idx = np.where(member == m, np.arange(n), -1)
        last = np.maximum.accumulate(idx) if n else idx
        ok = last >= seg_start[seg] if n else last >= 0
        total += np.where(ok, val[np.maximum(last, 0)], 0)
    names = np.array([m.name.lower() for m in RssMember] + ["total"])
    s_pid = np.concatenate([pid, pid])
    s_name = np.concatenate([member.astype(np.int64), np.full(n, len(RssMember))])
    s_val = np.concatenate([val, total])
    s_ts = np.concatenate([ts, ts])
    s_ord = np.concatenate([np.arange(n), np.arange(n)])
    # per (pid, member): the largest value, the first time it was reached
    o = np.lexsort((s_ord, s_ts, -s_val, s_name, s_pid))
    s_pid, s_name, s_val, s_ts = s_pid[o], s_name[o], s_val[o], s_ts[o]
    first = np.r_[True, (s_pid[1:] != s_pid[:-1]) | (s_name[1:] != s_name[:-1])] if len(o) \
        else np.zeros(0, bool)
    first &= s_val > 0
    out = pa.table({"pid": s_pid[first], "member": names[s_name[first]],
                    "bytes": s_val[first], "ts": s_ts[first]})
    out = out.sort_by([("pid", "ascending"), ("member", "ascending")])
    return out.cast(RSS_PEAKS)


def peaks_by_pid(peaks: pa.Table) -> dict[int, dict[str, dict[str, int]]]:
    """{pid: {member: {"bytes": n, "ts": t}}} from an rss_peaks table."""
    out: dict[int, dict[str, dict[str, int]]] = defaultdict(dict)
    for row in peaks.to_pylist():
        out[row["pid"]][row["member"]] = {"bytes": row["bytes"], "ts": row["ts"]}
    return dict(out)


@dataclass
class Resident(StageResult):
    """How much of each process was resident."""

    rss: pa.Table  # EFFECTIVE_RSS
    replay: AnonReplay | None  # with --track-faults only


def resident(tables: ArtifactTables, manifest: Manifest, lifecycle: Lifecycle, *,
             replay: bool = True) -> Resident:
    """The RSS and (where faults were recorded) anon replay stages, on the lifecycle
    stage's result (memtrack.process.lifecycle.of_artifact)."""
    anon = None
    if replay and tables.faults.num_rows:
        anon = reconstruct_anon(tables.faults, tables.events, tables.mappings, lifecycle,
                                page_size=manifest.host.page_size or 4096,
                                thp=thp_mode(manifest), rss=tables.rss)
    return Resident(effective_rss(tables.rss, lifecycle), anon)
