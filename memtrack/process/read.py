"""The read stage: an artifact's files as Arrow tables, every row whose values could
index or size anything range-checked (a bad row is counted and skipped, never a crash
later), its events put in time order (event_id = that order)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.process.decode import StackRecords
from memtrack.process.progress import Advance, no_progress
from memtrack.process.spill import EventSpill, OutOfOrder
from memtrack.process.stage import StageResult
from memtrack.process.streams import as_pieces
from memtrack.schema import EVENTS, TABLES, table_file
from memtrack.schema.artifact import BUILD_ID, Artifact, ArtifactError, TableRead
from memtrack.schema.ddl import connect
from memtrack.schema.enums import Allocator, EventKind, RssMember, StopReason
from memtrack.schema.stackrecord import MAX_BUDGET

# What a value of a hostile artifact may be before it sizes an allocation or indexes an
# array. Byte counts stay below 2^48 (256 TiB, beyond any address space in use), so
# that sums of them cannot overflow an int64.
MAX_BYTES = 1 << 48
MAX_PAYLOAD_BYTES = MAX_BUDGET + MAX_BUDGET // 64 + 64  # every word kept, its bitmap
MAX_FP_CHAIN = 1024  # the kernel's frame-pointer walk: 127 entries
MAX_RET_FIXUPS = MAX_BUDGET // 8
MAX_PY_DEPTH = 128  # Python frames per record (bpf/pyframes.h MT_PY_DEPTH)
MAX_PY_TEXT = 1 << 16  # bytes of a code object's name, file name or line table
MAX_REGION_TEXT = 4096  # bytes of a region label's value (capture takes 4000 a line)
PIECE_ROWS = 1 << 18  # events checked and spilled at a time


@dataclass
class ArtifactTables(StageResult):
    """The artifact's tables (counters: `events_bad_kind`, the events dropped for a
    kind this reader does not know, and `TABLE_bad_rows`, rows skipped per table)."""

    # valid kinds only, time-ordered, with event_id first; read into a spill: the kinds
    # other than the heap's only (the spill has every event)
    events: pa.Table
    mappings: pa.Table
    processes: pa.Table
    rss: pa.Table
    faults: pa.Table
    stacks: StackRecords  # the stack records, in file order (read again a piece at a time)
    region_names: pa.Table  # region_id, name
    region_labels: pa.Table  # region_id, key, value (format 2.5; empty before)
    py_stacks: pa.Table  # the Python stack records (format 2.2; empty before)
    py_codes: pa.Table
    stops: pa.Table  # capture's stops of traced processes (format 2.3; empty before)


def _no_nulls(t: pa.Table, *names: str) -> pa.ChunkedArray:
    ok = pc.is_valid(t.column(names[0]))
    for n in names[1:]:
        ok = pc.and_(ok, pc.is_valid(t.column(n)))
    return ok


def _at_most(t: pa.Table, name: str, hi: int) -> pa.ChunkedArray:
    col = t.column(name)
    return pc.less_equal(col, pa.scalar(hi, col.type))  # an int scalar would cast to int64


def _events_ok(t: pa.Table) -> pa.ChunkedArray:
    return pc.and_(_no_nulls(t, *t.column_names),
                   pc.and_(_at_most(t, "allocator", max(Allocator)),
                           _at_most(t, "size", MAX_BYTES)))


def _stacks_ok(t: pa.Table) -> pa.ChunkedArray:
    fp = pc.fill_null(pc.list_value_length(t.column("fp_chain")), 0)
    fixups = pc.fill_null(pc.list_value_length(t.column("ret_fixups")), 0)
    ok = pc.and_(_no_nulls(t, "hash", "ts", "pid", "tid", "sp", "copy_len", "truncated",
                           "regs", "payload"),
                 _at_most(t, "copy_len", MAX_BUDGET))
    ok = pc.and_(ok, pc.less_equal(pc.binary_length(t.column("payload")), MAX_PAYLOAD_BYTES))
    ok = pc.and_(ok, pc.less_equal(fp, MAX_FP_CHAIN))
    ok = pc.and_(ok, pc.less_equal(fixups, MAX_RET_FIXUPS))
    # a null inside the registers or the frame-pointer chain would be read as a value
    ok = pc.and_(ok, _lists_without_nulls(t.column("regs")))
    return pc.and_(ok, _lists_without_nulls(t.column("fp_chain")))


def _lists_without_nulls(col: pa.ChunkedArray) -> pa.Array:
    """Per list row: no value of it is null."""
    col = col.combine_chunks()
    ok = np.ones(len(col), dtype=bool)
    flat = pc.list_flatten(col)
    if flat.null_count:
        parents = pc.list_parent_indices(col).to_numpy()
        ok[parents[pc.is_null(flat).to_numpy(zero_copy_only=False)]] = False
    return pa.array(ok)


def _rss_ok(t: pa.Table) -> pa.ChunkedArray:
    return pc.and_(_no_nulls(t, *t.column_names),
                   pc.and_(_at_most(t, "member", max(RssMember)),
                           pc.and_(pc.greater_equal(t.column("bytes"), 0),
                                   _at_most(t, "bytes", MAX_BYTES))))


def _mappings_ok(t: pa.Table) -> pa.ChunkedArray:
    ok = pc.and_(_no_nulls(t, "ts", "pid", "start", "end", "offset", "inode", "path"),
                 pc.less(t.column("start"), t.column("end")))
    return pc.and_(ok, _at_most(t, "offset", MAX_BYTES))


def _py_stacks_ok(t: pa.Table) -> pa.ChunkedArray:
    """A Python stack record's three per-frame lists are one frame each, bounded."""
    n = pc.list_value_length(t.column("code_key"))
    ok = pc.and_(_all_valid(t), pc.less_equal(n, MAX_PY_DEPTH))
    for name in ("instr", "entry"):
        ok = pc.and_(ok, pc.equal(pc.list_value_length(t.column(name)), n))
        ok = pc.and_(ok, _lists_without_nulls(t.column(name)))
    return pc.and_(ok, _lists_without_nulls(t.column("code_key")))


def _py_codes_ok(t: pa.Table) -> pa.ChunkedArray:
    ok = _all_valid(t)
    for name in ("qualname", "filename"):
        ok = pc.and_(ok, pc.less_equal(pc.binary_length(t.column(name)), MAX_PY_TEXT))
    return pc.and_(ok, pc.less_equal(pc.binary_length(t.column("linetable")), MAX_PY_TEXT))


def _stops_ok(t: pa.Table) -> pa.ChunkedArray:
    return pc.and_(pc.and_(_all_valid(t), _at_most(t, "reason", max(StopReason))),
                   pc.less_equal(t.column("begin_ts"), t.column("end_ts")))


def _region_labels_ok(t: pa.Table) -> pa.ChunkedArray:
    """A label as capture takes it (capture.regions.label): a key of letters, digits and
    . _ -, the whole label within a region name's bytes."""
    ok = pc.and_(_all_valid(t), pc.is_valid(t.column("key")))
    ok = pc.and_(ok, pc.match_substring_regex(t.column("key"), r"^[A-Za-z0-9_.-]{1,100}$"))
    return pc.and_(ok, pc.less_equal(pc.binary_length(t.column("value")), MAX_REGION_TEXT))


def _all_valid(t: pa.Table) -> pa.ChunkedArray:
    return _no_nulls(t, *(f.name for f in t.schema if pa.types.is_integer(f.type)
                          or pa.types.is_boolean(f.type)))


def _processes_ok(t: pa.Table) -> pa.ChunkedArray:
    """Every integer but `ns_pid` (null: not known, or a format before 2.5)."""
    return _no_nulls(t, *(f.name for f in t.schema if pa.types.is_integer(f.type)
                          and f.name != "ns_pid"))


# table -> which of its rows may be used
ROW_RULES: dict[str, Callable[[pa.Table], pa.ChunkedArray]] = {
    "events": _events_ok, "stacks": _stacks_ok, "rss": _rss_ok, "mappings": _mappings_ok,
    "processes": _processes_ok, "faults": _all_valid, "region_names": _all_valid,
    "region_labels": _region_labels_ok,
    "py_stacks": _py_stacks_ok, "py_codes": _py_codes_ok, "stops": _stops_ok,
}


def checked(name: str, table: pa.Table) -> tuple[pa.Table, int]:
    """The rows of an artifact's `name` table that ROW_RULES allows, and how many not."""
    if table.num_rows == 0:
        return table, 0
    ok = pc.fill_null(ROW_RULES[name](table), False)
    bad = table.num_rows - (pc.sum(ok).as_py() or 0)
    return (table.filter(ok) if bad else table), bad


def _mapping_build_ids(t: pa.Table) -> tuple[pa.Table, int]:
    """Mappings whose build id is not hex have none (a build id names cache files)."""
    bid = t.column("build_id")
    bad = pc.and_(pc.is_valid(bid), pc.invert(pc.match_substring_regex(
        bid, f"^{BUILD_ID.pattern}$")))
    n = pc.sum(bad).as_py() or 0
    if not n:
        return t, 0
    i = t.schema.get_field_index("build_id")
    return t.set_column(i, "build_id", pc.if_else(bad, pa.scalar(None, pa.string()), bid)), n


class EventSink(Protocol):
    """What takes the events a batch at a time: memtrack.process.spill.EventSpill, or
    `info`'s tally."""

    def add(self, batch: pa.RecordBatch) -> None: ...

    def other_events(self) -> pa.Table: ...

    def close(self) -> None: ...


# What the lifecycle stage reads besides the events (`memtrack unwind` reads no more).
LIFECYCLE_TABLES = ("processes", "mappings")


def read_artifact(art: Artifact, spill: EventSink | None = None,
                  con: duckdb.DuckDBPyConnection | None = None,
                  progress: Advance = no_progress,
                  only: tuple[str, ...] | None = None) -> ArtifactTables:
    """Every file of `art` (events required, the others empty where missing), or the
    events and the tables named in `only` (the others read as empty). With a spill, the
    events go to it a batch at a time (an EventSpill's in time order: sorted by DuckDB
    in `con`, or a connection of its own, first when they are not), `progress` told the
    bytes of the events file read after each piece, and `events` keeps the other kinds
    only."""
    bad_rows: dict[str, int] = {}
    out: dict[str, pa.Table] = {}
    for name in ROW_RULES:
        if name in ("events", "stacks"):
            continue
        if only is None or name in only:
            out[name], bad_rows[name] = checked(name, art.read(name, required=False).table)
        else:
            out[name] = TABLES[name].empty_table()
    stacks = StackRecords(lambda: _checked_batches(art, "stacks", bad_rows),
                          art.path / table_file("stacks"))
    out["mappings"], bad_rows["mappings_build_id"] = _mapping_build_ids(out["mappings"])
    counts: dict[str, int] = {}
    if spill is None:
        events = sort_events(pa.Table.from_batches(list(_valid(art, counts)), schema=EVENTS))
    else:
        _spill(art, spill, con, counts, progress)
        events = spill.other_events()
    bad_rows["events"], bad = counts["bad_rows"], counts["bad_kind"]
    return ArtifactTables(
        events=events, mappings=out["mappings"], processes=out["processes"],
        rss=out["rss"], faults=out["faults"], stacks=stacks,
        region_names=out["region_names"], region_labels=out["region_labels"],
        py_stacks=out["py_stacks"], py_codes=out["py_codes"],
        stops=out["stops"],
        counters={"events_bad_kind": bad,
                  **{f"{k}_bad_rows": v for k, v in bad_rows.items() if v}},
    )


def _checked_batches(art: Artifact, name: str, bad_rows: dict[str, int]
                     ) -> Iterator[pa.RecordBatch]:
    """The rows of an artifact's `name` table that ROW_RULES allows, a batch at a time
    (`bad_rows[name]`: how many were not)."""
    bad_rows[name] = 0
    for batch in art.batches(name, required=False):
        t, bad = checked(name, pa.Table.from_batches([batch]))
        bad_rows[name] += bad
        yield from t.to_batches()


def _valid_kinds(events: pa.Table) -> tuple[pa.Table, int]:
    """The events of a kind this reader knows, and how many were not."""
    kind = events.column("kind")
    ok = pc.and_(pc.greater_equal(kind, min(EventKind)), pc.less_equal(kind, max(EventKind)))
    bad = events.num_rows - pc.sum(ok).as_py() if events.num_rows else 0
    return (events.filter(ok) if bad else events), bad


def _valid(art: Artifact, counts: dict[str, int], into: TableRead | None = None
           ) -> Iterator[pa.RecordBatch]:
    """The artifact's events that ROW_RULES and the known kinds allow, in file order, a
    piece at a time (what a batch costs beyond its own bytes stays bounded); counts
    the rows left out (and `into` how far the file is read)."""
    counts.update(bad_rows=0, bad_kind=0)
    for whole in art.batches("events", into=into):
        for at in range(0, whole.num_rows, PIECE_ROWS):
            t, bad_rows = checked("events", pa.Table.from_batches([whole.slice(at, PIECE_ROWS)]))
            t, bad_kind = _valid_kinds(t)
            counts["bad_rows"] += bad_rows
            counts["bad_kind"] += bad_kind
            yield from t.to_batches()


def _spill(art: Artifact, spill: EventSink, con: duckdb.DuckDBPyConnection | None,
           counts: dict[str, int], progress: Advance) -> None:
    """The artifact's valid events into `spill`, `counts` of the rows left out. Events in
    time order (as capture writes them) are not staged: `spilled_events` reads them
    again; others are sorted by DuckDB and staged in that order. `progress`: the bytes
    of the events file read (a second reading, of events out of order, is told once it
    is further than the first)."""
    try:
        size: int | None = art.file(table_file("events")).stat().st_size
    except FileNotFoundError:  # the reading below says so, as for any other table
        size = None
    read = TableRead(EVENTS.empty_table())
    furthest = 0

    def valid_batches() -> Iterator[pa.RecordBatch]:
        nonlocal furthest
        events = 0
        for batch in _valid(art, counts, read):
            yield batch
            events += batch.num_rows
            if read.position > furthest:
                furthest = read.position
                progress(furthest, size, events=events)
        if size is not None and furthest < size:  # the end marker, or a truncated rest
            furthest = size
            progress(size, size, events=events)

    try:
        for piece in as_pieces(valid_batches(), EVENTS, PIECE_ROWS):
            spill.add(piece.combine_chunks().to_batches()[0])  # a call's cost, per event
    except OutOfOrder:
        assert isinstance(spill, EventSpill)  # the one that wants them in order
        spill.reset()
        spill.stage_events = True
        con = con or connect()
        # stable: a thread's own order is kept among equal times (seq: the file's order)
        con.register("read_empty", EVENTS.empty_table())
        con.execute("CREATE OR REPLACE TEMP TABLE read_unsorted AS "
                    "SELECT 0::UBIGINT AS seq, * FROM read_empty WHERE false")
        con.unregister("read_empty")
        seq = 0
        for piece in as_pieces(valid_batches(), EVENTS):
            con.register("read_piece", piece.add_column(
                0, "seq", pa.array(np.arange(seq, seq + piece.num_rows, dtype=np.uint64))))
            con.execute("INSERT INTO read_unsorted SELECT * FROM read_piece")
            con.unregister("read_piece")
            seq += piece.num_rows
        reader = con.execute("SELECT * EXCLUDE (seq) FROM read_unsorted ORDER BY ts, seq"
                             ).to_arrow_reader(PIECE_ROWS)
        for batch in reader:
            for b in pa.Table.from_batches([batch]).cast(EVENTS).to_batches():
                spill.add(b)
        con.execute("DROP TABLE read_unsorted")
    spill.close()


def spilled_events(art: Artifact, spill: EventSpill) -> Iterator[pa.Table]:
    """The events `read_artifact` put into `spill`, with event_id, in order, about a
    million at a time: staged, or read from the artifact again (the same rows: the same
    checks; an artifact that changed meanwhile is an ArtifactError)."""
    if spill.stage_events:
        yield from spill.staged.pieces()
        return
    n = 0
    for piece in as_pieces(_valid(art, {}), EVENTS):
        yield piece.add_column(0, "event_id", pa.array(
            np.arange(n, n + piece.num_rows, dtype=np.uint64)))
        n += piece.num_rows
    if n != spill.n:
        raise ArtifactError(art.path / table_file("events"),
                            f"changed while being processed ({spill.n} events, then {n})")


def sort_events(events: pa.Table) -> pa.Table:
    """Events in time order (stable: a thread's own order is kept), with `event_id`.
    Events already in time order (as capture writes them) are not copied."""
    ts = events.column("ts").to_numpy()
    n = len(ts)
    event_id = pa.array(np.arange(n, dtype=np.uint64))
    if n > 1 and not bool((ts[1:] >= ts[:-1]).all()):
        events = events.take(pa.array(np.argsort(ts, kind="stable")))
    return events.add_column(0, "event_id", event_id)
