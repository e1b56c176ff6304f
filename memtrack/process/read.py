"""The read stage: an artifact's files as Arrow tables, its events validated and put in
time order (event_id = that order)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.schema.artifact import Artifact
from memtrack.schema.enums import EventKind


@dataclass
class ArtifactTables:
    events: pa.Table  # valid kinds only, time-ordered, with event_id first
    mappings: pa.Table
    processes: pa.Table
    rss: pa.Table
    faults: pa.Table
    stacks: pa.Table  # the stack records, in file order
    region_names: pa.Table  # region_id, name
    py_stacks: pa.Table  # the Python stack records (format 2.2; empty before)
    py_codes: pa.Table

    events_bad_kind: int = 0  # events dropped for a kind this reader does not know


def read_artifact(art: Artifact) -> ArtifactTables:
    """Every file of `art` (events required, the others empty where missing)."""
    events = art.read("events").table
    kind = events.column("kind")
    ok = pc.and_(pc.greater_equal(kind, min(EventKind)), pc.less_equal(kind, max(EventKind)))
    bad = events.num_rows - pc.sum(ok).as_py() if events.num_rows else 0
    if bad:
        events = events.filter(ok)
    return ArtifactTables(
        events=sort_events(events),
        mappings=art.read("mappings", required=False).table,
        processes=art.read("processes", required=False).table,
        rss=art.read("rss", required=False).table,
        faults=art.read("faults", required=False).table,
        stacks=art.read("stacks", required=False).table,
        region_names=art.read("region_names", required=False).table,
        py_stacks=art.read("py_stacks", required=False).table,
        py_codes=art.read("py_codes", required=False).table,

        events_bad_kind=bad,
    )


def sort_events(events: pa.Table) -> pa.Table:
    """Events in time order (stable: a thread's own order is kept), with `event_id`.
    Events already in time order (as capture writes them) are not copied."""
    ts = events.column("ts").to_numpy()
    n = len(ts)
    event_id = pa.array(np.arange(n, dtype=np.uint64))
    if n > 1 and not bool((ts[1:] >= ts[:-1]).all()):
        events = events.take(pa.array(np.argsort(ts, kind="stable")))
    return events.add_column(0, "event_id", event_id)
