"""Loading the stages' Arrow tables into the run database (schema: memtrack.schema.ddl).

Joins and id assignment happen in DuckDB over the registered Arrow tables, so nothing
here loops over events, stacks or frames in Python.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from memtrack.schema.ddl import (
    ALLOCATORS,
    DERIVED_NAMES,
    END_REASONS,
    EVENT_KINDS,
    RSS_CAUSES,
    RSS_MEMBERS,
    TABLE_NAMES,
    create_schema,
    derive,
)

CLONE_THREAD = 0x10000


@dataclass
class StageTables:
    """What the stages produced, in their own column layouts (see pipeline)."""

    events: pa.Table  # artifact events sorted by time, with event_id first
    allocations: pa.Table  # memtrack.process.pair.ALLOCATIONS
    heap_timeline: pa.Table  # memtrack.process.pair.HEAP_TIMELINE
    mappings: pa.Table  # artifact mappings
    processes: pa.Table  # artifact processes
    rss: pa.Table  # memtrack.process.rss.rss_timeline (ts-ordered effective values)
    modules: pa.Table  # module_id, build_id, path, elf_path, has_debuginfo, in_artifact
    stacks: pa.Table  # unwind .stacks + stack_id
    stack_frames: pa.Table  # unwind .frames + stack_id, module_id, frame_id
    frames: pa.Table  # frame_id, inline_depth, function, symbol, offset, file, line,
    #                   column, module_id, vaddr, address, reason


def _names(values: list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


KIND_SQL = f"CAST(list_extract({_names(EVENT_KINDS)}, kind::INTEGER) AS event_kind)"
ALLOCATOR_SQL = (
    f"CAST(list_extract({_names(ALLOCATORS)}, allocator::INTEGER + 1) AS allocator_kind)"
)
MEMBER_SQL = f"CAST(list_extract({_names(RSS_MEMBERS)}, member::INTEGER + 1) AS rss_member)"
CAUSE_SQL = f"CAST(list_extract({_names(RSS_CAUSES)}, cause::INTEGER + 1) AS rss_cause)"
END_SQL = f"CAST(list_extract({_names(END_REASONS)}, end_reason::INTEGER + 1) AS end_reason)"

INSERTS = {
    # Sources arrive in event order; DuckDB keeps insertion order without a sort.
    "events": f"""
        INSERT INTO events SELECT event_id, ts, pid, tid, {KIND_SQL}, {ALLOCATOR_SQL},
            flags, addr, old_addr, size, stack_hash, stack_id
        FROM src_events""",
    "allocations": f"""
        INSERT INTO allocations SELECT alloc_id, event_id, pid, tid, ts, {KIND_SQL},
            {ALLOCATOR_SQL}, addr, size, stack_id, free_ts, free_event_id, free_tid, end_ts,
            end_event_id, {END_SQL}, lifetime_ns, realloc_of, temporary
        FROM src_allocations""",
    "heap_timeline": "INSERT INTO heap_timeline SELECT * FROM src_heap_timeline",
    "modules": """
        INSERT INTO modules SELECT module_id, build_id, path, elf_path, has_debuginfo,
            in_artifact FROM src_modules ORDER BY module_id""",
    "mappings": """
        INSERT INTO mappings SELECT m.ts, m.pid, m.start, m."end", m."offset", m.perms, m.dev,
            m.inode, m.path, m.build_id, d.module_id
        FROM src_mappings m LEFT JOIN src_modules d ON d.build_id = m.build_id
        ORDER BY m.ts, m.pid, m.start""",
    "stacks": """
        INSERT INTO stacks SELECT stack_id, stack_hash, pid, depth, truncated, complete, stop
        FROM src_stacks ORDER BY stack_id""",
    "stack_frames": """
        INSERT INTO stack_frames SELECT stack_id, depth, address, module_id, method,
            lookup_vaddr, frame_id
        FROM src_stack_frames""",
    "frames": """
        INSERT INTO frames SELECT f.frame_id, f.inline_depth,
            coalesce(f.function, f.symbol,
                     CASE WHEN d.path IS NOT NULL THEN
                         regexp_extract(d.path, '[^/]*$') || '+0x' || lower(hex(f.vaddr)) END,
                     '0x' || lower(hex(f.address))),
            f.function, f.symbol, f."offset", f.file, f.line, f."column", f.module_id,
            f.vaddr, f.reason
        FROM src_frames f LEFT JOIN src_modules d USING (module_id)
        ORDER BY f.frame_id, f.inline_depth""",
    "rss": f"""
        INSERT INTO rss SELECT ts, pid, {MEMBER_SQL}, bytes, {CAUSE_SQL} FROM src_rss""",
    "processes": f"""
        INSERT INTO processes
        WITH info AS (
            SELECT pid, arg_max(ppid, ts) AS ppid, arg_max(comm, ts) AS name,
                   arg_max(exe, ts) AS exe, arg_max(cmdline, ts) AS cmdline,
                   min(ts) AS seen_ts
            FROM src_processes GROUP BY pid),
        forks AS (
            SELECT addr::UINTEGER AS pid, min(ts) AS ts, arg_min(pid, ts) AS parent
            FROM src_events WHERE kind = 9 AND (flags & {CLONE_THREAD}) = 0 GROUP BY 1),
        exits AS (
            SELECT pid, max(ts) AS ts, arg_max(size, ts)::INTEGER AS status
            FROM src_events WHERE kind = 11 AND (flags & 1) = 1 GROUP BY pid),
        seen AS (SELECT pid, min(ts) AS ts FROM src_events GROUP BY pid),
        pids AS (SELECT pid FROM info UNION SELECT pid FROM seen UNION SELECT pid FROM forks)
        SELECT p.pid, coalesce(i.ppid, f.parent), i.name, i.exe, i.cmdline,
               coalesce(f.ts, least(i.seen_ts, s.ts), i.seen_ts, s.ts), x.ts, x.status,
               (x.status >> 8) & 255, CASE WHEN x.status & 127 <> 0 THEN x.status & 127 END
        FROM pids p LEFT JOIN info i USING (pid) LEFT JOIN forks f USING (pid)
            LEFT JOIN exits x USING (pid) LEFT JOIN seen s USING (pid)
        ORDER BY 6, 1""",
    "threads": f"""
        INSERT INTO threads
        WITH starts AS (
            SELECT addr::UINTEGER AS tid, min(ts) AS ts FROM src_events
            WHERE kind = 9 GROUP BY 1),
        exits AS (SELECT tid, max(ts) AS ts FROM src_events WHERE kind = 11 GROUP BY tid),
        seen AS (
            SELECT pid, tid, min(ts) AS ts, count(*) FILTER (WHERE kind <= 5) AS n
            FROM src_events WHERE kind <> 9 OR (flags & {CLONE_THREAD}) <> 0
            GROUP BY pid, tid)
        SELECT s.pid, s.tid, coalesce(st.ts, s.ts), x.ts, s.n
        FROM seen s LEFT JOIN starts st USING (tid) LEFT JOIN exits x USING (tid)
        ORDER BY 3, 2""",
}


def load(
    out_db: Path,
    tables: StageTables,
    meta: dict[str, str],
    parquet_dir: Path | None = None,
) -> dict[str, int]:
    """Write the run database at out_db (replacing it); returns rows per table."""
    out_db = Path(out_db)
    tmp = out_db.with_name(f".{out_db.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    con = duckdb.connect(str(tmp))
    try:
        create_schema(con)
        con.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
        for name in ("mappings", "processes", "rss", "modules", "stacks", "stack_frames",
                     "frames", "heap_timeline"):
            con.register(f"src_{name}", getattr(tables, name))
        for name in ("events", "allocations"):
            con.register(f"src_{name}", with_stack_ids(getattr(tables, name), tables.stacks))
        for name in (*TABLE_NAMES, "heap_timeline"):
            con.execute(INSERTS[name])
        derive(con)
        counts = {
            name: con.execute(f"SELECT count(*) FROM {name}").fetchone()[0]  # type: ignore[index]
            for name in TABLE_NAMES + DERIVED_NAMES
        }
        if parquet_dir is not None:
            export_parquet(con, Path(parquet_dir))
        con.execute("CHECKPOINT")
    finally:
        con.close()
    os.replace(tmp, out_db)
    Path(str(tmp) + ".wal").unlink(missing_ok=True)
    return counts


def with_stack_ids(table: pa.Table, stacks: pa.Table) -> pa.Table:
    """`table` with a stack_id column: its stack_hash's id in `stacks`, null where the
    hash is 0 (no stack captured) or has no stack record."""
    h = table.column("stack_hash").to_numpy()
    known = stacks.column("stack_hash").to_numpy()
    ids = stacks.column("stack_id").to_numpy()
    order = np.argsort(known)
    known, ids = known[order], ids[order]
    if len(known):
        i = np.minimum(np.searchsorted(known, h), len(known) - 1)
        hit = (known[i] == h) & (h != 0)
        sid = ids[i]
    else:
        hit = np.zeros(len(h), bool)
        sid = np.zeros(len(h), np.int32)
    return table.append_column("stack_id", pa.array(sid.astype(np.int32), mask=~hit))


def export_parquet(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """Every table as Parquet, one directory per table (ROOT/TABLE/data.parquet)."""
    for name in ("meta", *TABLE_NAMES, *DERIVED_NAMES):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        target = str(d / "data.parquet").replace("'", "''")
        con.execute(f"COPY {name} TO '{target}' (FORMAT parquet, COMPRESSION zstd)")


def meta_rows(**values: object) -> dict[str, str]:
    """meta values as strings (JSON for anything that is not a str or int)."""
    return {
        k: v if isinstance(v, str) else str(v) if isinstance(v, int) else json.dumps(v)
        for k, v in values.items()
    }
