"""The regions stage: each region's thread, nesting and span, from the REGION events
(capture/regions.py writes them; region_names.arrow names them), and their labels
(region_labels.arrow: the last of each key, for the regions kept).

A region opens at its begin and closes at its end. One never ended is closed at its
thread's exit, or at its process's exec or exit, by that event (`ended` false), else
at the capture's end. Regions nest per thread, as capture enforces it; an artifact is
hostile input, so the stage enforces it again: an end closes the regions opened inside
its region first (not ended); an end of no open region of its thread, a second begin
of an id and a begin of id 0 (capture's ids start at 1; 0 means "no region" in the
database) are counted and ignored.

Python walks the region events and the exits and execs of their threads only (a
region is a benchmark or a test: thousands, not millions); attribution of allocations
to regions is the run database's (memtrack.schema.ddl, region_allocations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.process.stage import StageResult
from memtrack.schema.enums import EXIT_PROCESS, REGION_BEGIN, EventKind
from memtrack.schema.stages import REGION_LABELS, REGIONS


@dataclass
class RegionSpans(StageResult):
    regions: pa.Table  # REGIONS
    labels: pa.Table = field(default_factory=REGION_LABELS.empty_table)


def regions(events: pa.Table, names: pa.Table, end_ts: int,
            labels: pa.Table | None = None) -> RegionSpans:
    """The regions of time-ordered `events` (with event_id), named by `names`
    (region_id, name) and labelled by `labels` (region_id, key, value); `end_ts` closes
    what is still open at the capture's end."""
    kind = events.column("kind").to_numpy()
    is_region = kind == EventKind.REGION
    if not is_region.any():
        return RegionSpans(REGIONS.empty_table())
    pid = events.column("pid").to_numpy()
    tid = events.column("tid").to_numpy()
    r_pids, r_tids = np.unique(pid[is_region]), np.unique(tid[is_region])
    closing = (((kind == EventKind.EXIT) & np.isin(tid, r_tids))
               | ((kind == EventKind.EXIT) | (kind == EventKind.EXEC)) & np.isin(pid, r_pids))
    rows = events.filter(pa.array(is_region | closing)).select(
        ["event_id", "ts", "pid", "tid", "kind", "flags", "addr"]).to_pylist()
    named = _names(names)
    out: dict[int, dict[str, Any]] = {}
    stacks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    counters = {"region_ends_unmatched": 0, "regions_duplicate_id": 0, "regions_unnamed": 0}

    def close(stack: list[dict[str, Any]], upto: int, ev: dict[str, Any] | None) -> None:
        """Close the regions of `stack` from its top down to index `upto` at `ev`."""
        while len(stack) > upto:
            r = stack.pop()
            r["end_event_id"] = ev["event_id"] if ev else None
            r["end_ts"] = ev["ts"] if ev else max(end_ts, r["begin_ts"])

    for ev in rows:
        key = (ev["pid"], ev["tid"])
        if ev["kind"] == EventKind.REGION:
            stack = stacks.setdefault(key, [])
            rid = ev["addr"]
            if ev["flags"] & REGION_BEGIN:
                if rid in out or rid == 0:
                    counters["regions_duplicate_id"] += 1
                    continue
                name = named.get(rid)
                if name is None:
                    counters["regions_unnamed"] += 1
                out[rid] = r = {
                    "region_id": rid, "name": name if name is not None else f"[region {rid}]",
                    "pid": ev["pid"], "tid": ev["tid"],
                    "parent_id": stack[-1]["region_id"] if stack else None,
                    "depth": len(stack), "begin_event_id": ev["event_id"], "end_event_id": None,
                    "begin_ts": ev["ts"], "end_ts": None, "ended": False}
                stack.append(r)
                continue
            at = next((i for i, r in enumerate(stack) if r["region_id"] == rid), None)
            if at is None:
                counters["region_ends_unmatched"] += 1
                continue
            close(stack, at + 1, ev)
            stack[at]["ended"] = True
            close(stack, at, ev)
        elif ev["kind"] == EventKind.EXIT and not ev["flags"] & EXIT_PROCESS:
            close(stacks.get(key, []), 0, ev)
        else:  # an exec, or the whole process's exit: every thread of the process
            for (p, _), stack in stacks.items():
                if p == ev["pid"]:
                    close(stack, 0, ev)
    for stack in stacks.values():
        close(stack, 0, None)
    table = pa.Table.from_pylist([out[k] for k in sorted(out)], schema=REGIONS)
    return RegionSpans(table, _labels(labels, out), counters=counters)


def _labels(labels: pa.Table | None, kept: dict[int, Any]) -> pa.Table:
    """The last label of each (region, key), for the regions `kept`, by region and key."""
    last: dict[tuple[int, str], str] = {}
    if labels is not None:
        for rid, key, value in zip(*(labels.column(c).to_pylist()
                                     for c in ("region_id", "key", "value")), strict=True):
            if rid in kept and key is not None and value is not None:
                last[(rid, key)] = value
    rows = sorted(last.items())
    return pa.table({"region_id": [k[0] for k, _ in rows], "key": [k[1] for k, _ in rows],
                     "value": [v for _, v in rows]}, schema=REGION_LABELS)


def _names(names: pa.Table) -> dict[int, str]:
    """region_id -> name (the first row of an id)."""
    out: dict[int, str] = {}
    for rid, name in zip(names.column("region_id").to_pylist(),
                         names.column("name").to_pylist(), strict=True):
        if rid is not None and name is not None:
            out.setdefault(rid, name)
    return out
