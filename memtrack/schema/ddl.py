"""The run database (`memtrack process -o RUN.duckdb`): DuckDB DDL of every table and view.

docs/tables.md documents each column. A change to a table or a view's meaning bumps
SCHEMA_VERSION; `open_run` refuses a database written with another version in one line
(re-running `memtrack process` on the artifact rebuilds it).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import duckdb

from memtrack.schema.enums import (
    Allocator,
    EndReason,
    EventKind,
    RssCause,
    RssMember,
    StopReason,
    names,
)

SCHEMA_VERSION = 9


class RunError(Exception):
    """A run database that cannot be used, worded for one line: `FILE: problem`."""


def _enum(values: list[str]) -> str:
    return "ENUM(" + ", ".join(f"'{v}'" for v in values) + ")"


EVENT_KINDS = names(EventKind)
ALLOCATORS = names(Allocator)
RSS_MEMBERS = names(RssMember)
END_REASONS = names(EndReason)
RSS_CAUSES = names(RssCause)
STOP_REASONS = names(StopReason)

TYPES = f"""
CREATE TYPE event_kind AS {_enum(EVENT_KINDS)};
CREATE TYPE allocator_kind AS {_enum(ALLOCATORS)};
CREATE TYPE rss_member AS {_enum(RSS_MEMBERS)};
CREATE TYPE end_reason AS {_enum(END_REASONS)};
CREATE TYPE rss_cause AS {_enum(RSS_CAUSES)};
CREATE TYPE stop_reason AS {_enum(STOP_REASONS)};
"""

TABLES = """
CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE TABLE processes (
    pid UINTEGER, ppid UINTEGER, name VARCHAR, exe VARCHAR, cmdline VARCHAR[],
    start_ts UBIGINT, exit_ts UBIGINT, exit_status INTEGER, exit_code INTEGER,
    exit_signal INTEGER, ns_pid UINTEGER
);
CREATE TABLE threads (pid UINTEGER, tid UINTEGER, start_ts UBIGINT, exit_ts UBIGINT,
    events UBIGINT);
CREATE TABLE modules (module_id INTEGER, build_id VARCHAR, path VARCHAR, elf_path VARCHAR,
    has_debuginfo BOOLEAN, in_artifact BOOLEAN);
CREATE TABLE mappings (ts UBIGINT, pid UINTEGER, "start" UBIGINT, "end" UBIGINT,
    "offset" UBIGINT, perms VARCHAR, dev VARCHAR, inode UBIGINT, path VARCHAR,
    build_id VARCHAR, module_id INTEGER);
CREATE TABLE events (event_id UBIGINT, ts UBIGINT, pid UINTEGER, tid UINTEGER,
    kind event_kind, allocator allocator_kind, flags UBIGINT, addr UBIGINT,
    old_addr UBIGINT, size UBIGINT, stack_hash UBIGINT, stack_id INTEGER);
CREATE TABLE allocations (alloc_id UBIGINT, event_id UBIGINT, pid UINTEGER, tid UINTEGER,
    ts UBIGINT, kind event_kind, allocator allocator_kind, addr UBIGINT, size UBIGINT,
    stack_id INTEGER, free_ts UBIGINT, free_event_id UBIGINT, free_tid UINTEGER,
    end_ts UBIGINT, end_event_id UBIGINT, end_reason end_reason, lifetime_ns UBIGINT,
    realloc_of UBIGINT, temporary BOOLEAN, inherited_from UBIGINT);
CREATE TABLE stacks (stack_id INTEGER, stack_hash UBIGINT, pid UINTEGER, depth USMALLINT,
    truncated BOOLEAN, complete BOOLEAN, stop VARCHAR);
CREATE TABLE stack_frames (stack_id INTEGER, depth USMALLINT, address UBIGINT,
    module_id INTEGER, method VARCHAR, lookup_vaddr UBIGINT, frame_id INTEGER);
CREATE TABLE frames (frame_id INTEGER, inline_depth UTINYINT, name VARCHAR,
    function VARCHAR, symbol VARCHAR, "offset" UBIGINT, file VARCHAR, line UINTEGER,
    "column" UINTEGER, module_id INTEGER, vaddr UBIGINT, reason VARCHAR);
CREATE TABLE heap_timeline (pid UINTEGER, event_id UBIGINT, ts UBIGINT, delta BIGINT,
    heap_bytes BIGINT);
CREATE TABLE heap_peak (pid UINTEGER, peak_event_id UBIGINT, peak_ts UBIGINT,
    peak_bytes BIGINT);
CREATE TABLE rss (ts UBIGINT, pid UINTEGER, member rss_member, bytes BIGINT,
    cause rss_cause);
CREATE TABLE stops (pid UINTEGER, reason stop_reason, begin_ts UBIGINT, end_ts UBIGINT);
CREATE TABLE backtraces (stack_id INTEGER, backtrace_id INTEGER);
CREATE TABLE regions (region_id UBIGINT, name VARCHAR, pid UINTEGER, tid UINTEGER,
    parent_id UBIGINT, depth UINTEGER, begin_event_id UBIGINT, end_event_id UBIGINT,
    begin_ts UBIGINT, end_ts UBIGINT, ended BOOLEAN);
CREATE TABLE region_labels (region_id UBIGINT, key VARCHAR, value VARCHAR);
CREATE TABLE region_allocations (region_id UBIGINT, alloc_id UBIGINT);
CREATE TABLE region_frees (region_id UBIGINT, alloc_id UBIGINT);
CREATE TABLE region_heap_timeline (region_id UBIGINT, event_id UBIGINT, ts UBIGINT,
    delta BIGINT, heap_bytes BIGINT);
CREATE TABLE region_peak (region_id UBIGINT, peak_event_id UBIGINT, peak_ts UBIGINT,
    peak_bytes BIGINT);
"""

# An allocation's site is its first logical frame outside the allocator function (depth
# 1), as heaptrack reports it; the allocator itself where the stack has no caller. A
# Python cut's site is its innermost Python frame (depth 2: the allocator's caller is
# the interpreter's), as memray reports it.
SITE_DEPTH = ("CASE WHEN s.stop = 'python' AND s.depth > 2 THEN 2 "
              "WHEN s.depth > 1 THEN 1 ELSE 0 END")
NO_STACK = "[no stack]"  # the site of an allocation whose stack was not captured
NO_CALLER = "[caller unknown]"  # a stack that has no frame outside the allocator
# The functions capture probed (meta `allocator_functions`: their symbols and demangled
# names): an allocator frame is one of them, or a frame inside the allocator (below
# SITE_DEPTH). Hotspots never name one.
ALLOCATOR_NAMES = ("(SELECT from_json(value, '[\"VARCHAR\"]') FROM meta "
                   "WHERE key = 'allocator_functions')")

# Region attribution (regions come from memtrack.process.regions; per thread they nest).
# `bounds`: after each region boundary of a thread (its event and time), the innermost
# region it has open (0: none; where several close at one event, an exit, the
# outermost's parent); an event of the thread belongs to the innermost region of its
# last boundary before it (an ASOF join: sorted, not a range join per region) and to
# that region's ancestors. The same holds for any time series of the process (RSS),
# seen from each thread that has regions.
REGION_SCOPE = """
    WITH RECURSIVE ancestors(region_id, ancestor_id) AS (
        SELECT region_id, region_id FROM regions
        UNION ALL
        SELECT a.region_id, r.parent_id FROM ancestors a
        JOIN regions r ON r.region_id = a.ancestor_id WHERE r.parent_id IS NOT NULL),
    bounds AS (
        SELECT pid, tid, begin_event_id AS event_id, begin_ts AS ts, region_id FROM regions
        UNION ALL
        SELECT pid, tid, end_event_id, min(end_ts), arg_min(coalesce(parent_id, 0), depth)
        FROM regions WHERE end_event_id IS NOT NULL GROUP BY pid, tid, end_event_id)"""


def _region_attribution(table: str, tid: str, event_id: str) -> str:
    """INSERT INTO `table` (region_id, alloc_id): each allocation whose `event_id` (an
    allocation or its free) its thread `tid` made inside a region, for that region and
    every one enclosing it."""
    return f"""
        INSERT INTO {table}
        {REGION_SCOPE},
        innermost AS (
            SELECT a.alloc_id, b.region_id FROM allocations a ASOF JOIN bounds b
            ON a.pid = b.pid AND a.{tid} = b.tid AND a.{event_id} > b.event_id
            WHERE b.region_id <> 0)
        SELECT s.ancestor_id, i.alloc_id FROM innermost i JOIN ancestors s USING (region_id)
        ORDER BY 1, 2"""

# heap_timeline comes from the pairing stage (memtrack.process.pair); heap_peak and
# backtraces are derived once loaded (as views every report would redo them). A
# backtrace is a stack's frames from its site outward; stacks whose frames from the
# site outward are at the same locations (function, file and line of every inline
# level: heaptrack's granularity) share one, named by the lowest such stack_id (keyed
# by a sum of 64-bit hashes of each level's location and position, and the level
# count: no list is built).
DERIVED = {
    "heap_peak": """
        INSERT INTO heap_peak
        WITH m AS (SELECT pid, max(heap_bytes) AS peak_bytes FROM heap_timeline GROUP BY pid)
        SELECT t.pid, min(t.event_id), arg_min(t.ts, t.event_id), m.peak_bytes
        FROM heap_timeline t JOIN m ON t.pid = m.pid AND t.heap_bytes = m.peak_bytes
        GROUP BY t.pid, m.peak_bytes ORDER BY t.pid""",
    "backtraces": """
        INSERT INTO backtraces
        WITH k AS (
            SELECT sf.stack_id,
                   sum(hash(f.name, f.file, f.line, sf.depth, f.inline_depth)::HUGEINT) AS key,
                   count(*) AS n
            FROM backtrace_frames sf JOIN frames f USING (frame_id) GROUP BY sf.stack_id)
        SELECT stack_id, min(stack_id) OVER (PARTITION BY key, n) FROM k ORDER BY stack_id""",
    # allocations made by a region's thread inside it (or inside a region nested in it)
    "region_allocations": _region_attribution("region_allocations", "tid", "event_id"),
    # blocks (allocated anywhere in the process) freed by a region's thread inside it
    "region_frees": _region_attribution("region_frees", "free_tid", "free_event_id"),
    # the heap above the region's begin after each change its thread made inside it
    "region_heap_timeline": """
        INSERT INTO region_heap_timeline
        WITH d AS (
            SELECT ra.region_id, a.event_id, a.ts, a.size::BIGINT AS delta
            FROM region_allocations ra JOIN allocations a USING (alloc_id)
            UNION ALL
            SELECT rf.region_id, a.free_event_id, a.free_ts, -a.size::BIGINT
            FROM region_frees rf JOIN allocations a USING (alloc_id)),
        g AS (SELECT region_id, event_id, min(ts) AS ts, sum(delta)::BIGINT AS delta FROM d
              GROUP BY region_id, event_id)
        SELECT region_id, event_id, ts, delta,
               sum(delta) OVER (PARTITION BY region_id ORDER BY event_id
                                ROWS UNBOUNDED PRECEDING)::BIGINT
        FROM g ORDER BY region_id, event_id""",
    "region_peak": """
        INSERT INTO region_peak
        SELECT region_id, arg_min(event_id, (-heap_bytes, event_id)),
               arg_min(ts, (-heap_bytes, event_id)), max(heap_bytes)
        FROM region_heap_timeline GROUP BY region_id HAVING max(heap_bytes) > 0
        ORDER BY region_id""",
}

# A leaked allocation: never freed, its process exec'd or exited or the capture ended.
LEAKED = "end_reason IN ('exec', 'exit', 'end')"
# An allocation `a` of region `r` still alive when the region closed (a block that
# ends by the very event that closed the region, an exit, was alive until then).
NEVER = "18446744073709551615::UBIGINT"
ALIVE_AT_END = (f"coalesce(a.end_event_id, {NEVER}) >= coalesce(r.end_event_id, {NEVER})")

# Views. A stack's logical frames run from the allocator itself (position 0) outward,
# inline levels innermost first. An allocation's *location* is its site (SITE_DEPTH).
VIEWS = """
CREATE VIEW stack_lines AS
SELECT sf.stack_id,
       (row_number() OVER (PARTITION BY sf.stack_id
                           ORDER BY sf.depth, f.inline_depth) - 1)::INTEGER AS position,
       sf.depth, f.inline_depth, sf.frame_id, f.name, f.function, f.file, f.line,
       sf.module_id, sf.method
FROM stack_frames sf JOIN frames f USING (frame_id);

CREATE VIEW stack_location AS
SELECT sf.stack_id, sf.frame_id, f.name, f.function, f.file, f.line, sf.module_id
FROM stack_frames sf JOIN stacks s USING (stack_id)
JOIN frames f ON f.frame_id = sf.frame_id AND f.inline_depth = 0
WHERE sf.depth = {site};

CREATE VIEW backtrace_frames AS
SELECT sf.stack_id, sf.depth, sf.frame_id
FROM stack_frames sf JOIN stacks s USING (stack_id)
WHERE sf.depth >= {site};

CREATE VIEW backtrace_lines AS
SELECT sf.stack_id, sf.depth, f.inline_depth, sf.frame_id, f.name, f.function, f.file,
       f.line, sf.module_id,
       sf.depth < {site} OR coalesce(list_contains({allocators}, f.name), FALSE)
           OR coalesce(list_contains({allocators}, f.symbol), FALSE) AS allocator
FROM stack_frames sf JOIN stacks s USING (stack_id) JOIN frames f USING (frame_id);

CREATE VIEW allocation_sites AS
SELECT a.*, coalesce(l.name, '{no_stack}') AS location, l.file, l.line
FROM allocations a LEFT JOIN stack_location l USING (stack_id);

CREATE VIEW peak AS
SELECT p.peak_ts, p.peak_bytes, a.* FROM allocations a JOIN heap_peak p USING (pid)
WHERE a.event_id <= p.peak_event_id
  AND (a.end_event_id IS NULL OR a.end_event_id > p.peak_event_id);

CREATE VIEW rss_timeline AS
WITH w AS (
    SELECT pid, ts, rowid AS r,
        last_value(CASE WHEN member = 'file' THEN bytes END IGNORE NULLS)
            OVER (PARTITION BY pid ORDER BY ts, rowid ROWS UNBOUNDED PRECEDING) AS file,
        last_value(CASE WHEN member = 'anon' THEN bytes END IGNORE NULLS)
            OVER (PARTITION BY pid ORDER BY ts, rowid ROWS UNBOUNDED PRECEDING) AS anon,
        last_value(CASE WHEN member = 'swap' THEN bytes END IGNORE NULLS)
            OVER (PARTITION BY pid ORDER BY ts, rowid ROWS UNBOUNDED PRECEDING) AS swap,
        last_value(CASE WHEN member = 'shmem' THEN bytes END IGNORE NULLS)
            OVER (PARTITION BY pid ORDER BY ts, rowid ROWS UNBOUNDED PRECEDING) AS shmem
    FROM rss)
SELECT pid, ts, coalesce(file, 0) AS file, coalesce(anon, 0) AS anon,
       coalesce(swap, 0) AS swap, coalesce(shmem, 0) AS shmem,
       coalesce(file, 0) + coalesce(anon, 0) + coalesce(shmem, 0) AS rss
FROM w QUALIFY row_number() OVER (PARTITION BY pid, ts ORDER BY r DESC) = 1;

CREATE VIEW leaks AS SELECT * FROM allocations WHERE {leaked};

CREATE VIEW temporary AS SELECT * FROM allocations WHERE temporary;

CREATE VIEW stack_costs AS
SELECT a.stack_id, a.pid, count(*) FILTER (WHERE a.inherited_from IS NULL) AS calls,
       coalesce(sum(a.size) FILTER (WHERE a.inherited_from IS NULL), 0)::BIGINT AS bytes,
       count(*) FILTER (WHERE a.temporary) AS temporary,
       count(p.alloc_id) AS peak_calls, coalesce(sum(p.size), 0)::BIGINT AS peak_bytes,
       count(*) FILTER (WHERE {leaked}) AS leaked_calls,
       coalesce(sum(a.size) FILTER (WHERE {leaked}), 0)::BIGINT AS leaked_bytes
FROM allocations a LEFT JOIN (SELECT alloc_id, size FROM peak) p USING (alloc_id)
GROUP BY a.stack_id, a.pid;

CREATE VIEW hotspots AS
WITH per_stack AS (
    SELECT stack_id, sum(calls) AS calls, sum(bytes) AS bytes, sum(peak_bytes) AS peak,
           sum(leaked_bytes) AS leaked
    FROM stack_costs GROUP BY stack_id
),
named AS (
    SELECT stack_id, name, depth, inline_depth FROM backtrace_lines WHERE NOT allocator
),
site AS (SELECT stack_id, arg_min(name, (depth, inline_depth)) AS function FROM named
         GROUP BY stack_id),
self AS (
    SELECT CASE WHEN s.stack_id IS NULL THEN '{no_stack}'
                ELSE coalesce(l.function, '{no_caller}') END AS function,
           sum(calls) AS calls, sum(bytes) AS bytes, sum(peak) AS peak,
           sum(leaked) AS leaked
    FROM per_stack s LEFT JOIN site l USING (stack_id) GROUP BY 1
),
incl AS (
    SELECT f.name AS function, sum(calls) AS calls, sum(bytes) AS bytes,
           sum(peak) AS peak, sum(leaked) AS leaked
    FROM per_stack s JOIN (SELECT DISTINCT stack_id, name FROM named) f USING (stack_id)
    GROUP BY 1
)
SELECT coalesce(s.function, i.function) AS function,
       coalesce(s.calls, 0)::BIGINT AS self_calls, coalesce(s.bytes, 0)::BIGINT AS self_bytes,
       coalesce(s.peak, 0)::BIGINT AS self_peak_bytes,
       coalesce(s.leaked, 0)::BIGINT AS self_leaked_bytes,
       coalesce(i.calls, s.calls)::BIGINT AS incl_calls,
       coalesce(i.bytes, s.bytes)::BIGINT AS incl_bytes,
       coalesce(i.peak, s.peak)::BIGINT AS incl_peak_bytes,
       coalesce(i.leaked, s.leaked)::BIGINT AS incl_leaked_bytes
FROM self s FULL JOIN incl i ON s.function = i.function;


CREATE VIEW region_stack_costs AS
SELECT ra.region_id, a.stack_id, count(*) AS calls, sum(a.size)::BIGINT AS bytes,
       count(*) FILTER (WHERE a.temporary) AS temporary,
       count(*) FILTER (WHERE {at_peak}) AS peak_calls,
       coalesce(sum(a.size) FILTER (WHERE {at_peak}), 0)::BIGINT AS peak_bytes,
       count(*) FILTER (WHERE {alive}) AS alive_calls,
       coalesce(sum(a.size) FILTER (WHERE {alive}), 0)::BIGINT AS alive_bytes,
       count(*) FILTER (WHERE {leaked}) AS leaked_calls,
       coalesce(sum(a.size) FILTER (WHERE {leaked}), 0)::BIGINT AS leaked_bytes
FROM region_allocations ra JOIN allocations a USING (alloc_id)
JOIN regions r USING (region_id) LEFT JOIN region_peak p USING (region_id)
GROUP BY ra.region_id, a.stack_id;

CREATE VIEW region_metrics AS
{scope},
c AS (
    SELECT region_id, sum(calls)::BIGINT AS calls, sum(bytes)::BIGINT AS bytes,
           sum(temporary)::BIGINT AS temporary, sum(alive_calls)::BIGINT AS alive_calls,
           sum(alive_bytes)::BIGINT AS alive_bytes, sum(leaked_calls)::BIGINT AS leaked_calls,
           sum(leaked_bytes)::BIGINT AS leaked_bytes
    FROM region_stack_costs GROUP BY region_id),
f AS (SELECT rf.region_id, count(*) AS frees, sum(a.size)::BIGINT AS freed_bytes
      FROM region_frees rf JOIN allocations a USING (alloc_id) GROUP BY 1),
t AS MATERIALIZED (
    SELECT pid, ts, rss FROM rss_timeline WHERE pid IN (SELECT pid FROM regions)),
rss_begin AS (
    SELECT r.region_id, t.rss FROM regions r ASOF JOIN t
    ON t.pid = r.pid AND t.ts <= r.begin_ts),
seen AS (  -- each RSS sample, once per thread of its process that has regions
    SELECT th.tid, t.* FROM (SELECT DISTINCT pid, tid FROM regions) th JOIN t USING (pid)),
rss_inner AS (  -- in (begin, end]: the last boundary strictly before the sample
    SELECT b.region_id, max(s.rss) AS rss FROM seen s ASOF JOIN bounds b
    ON s.pid = b.pid AND s.tid = b.tid AND s.ts > b.ts WHERE b.region_id <> 0 GROUP BY 1),
rss_in AS (
    SELECT a.ancestor_id AS region_id, max(i.rss) AS rss
    FROM rss_inner i JOIN ancestors a USING (region_id) GROUP BY 1)
SELECT r.region_id, r.name, r.pid, r.tid, r.parent_id, r.depth, r.begin_ts, r.end_ts,
       r.end_ts - r.begin_ts AS duration_ns, r.ended,
       coalesce(c.calls, 0) AS calls, coalesce(c.bytes, 0) AS bytes,
       CASE WHEN c.calls > 0 THEN c.bytes / c.calls END AS avg_size,
       coalesce(c.temporary, 0) AS temporary,
       coalesce(f.frees, 0) AS frees, coalesce(f.freed_bytes, 0) AS freed_bytes,
       coalesce(p.peak_bytes, 0) AS peak_heap_bytes,
       coalesce(p.peak_ts, r.begin_ts) AS peak_heap_ts,
       coalesce(c.alive_calls, 0) AS alive_calls, coalesce(c.alive_bytes, 0) AS alive_bytes,
       coalesce(c.leaked_calls, 0) AS leaked_calls, coalesce(c.leaked_bytes, 0) AS leaked_bytes,
       b.rss AS rss_at_begin_bytes,
       CASE WHEN b.rss IS NOT NULL OR i.rss IS NOT NULL
            THEN greatest(coalesce(b.rss, 0), coalesce(i.rss, 0)) END AS peak_rss_bytes
FROM regions r LEFT JOIN c USING (region_id) LEFT JOIN f USING (region_id)
LEFT JOIN region_peak p USING (region_id) LEFT JOIN rss_begin b USING (region_id)
LEFT JOIN rss_in i USING (region_id);
""".replace("{leaked}", LEAKED).replace("{site}", SITE_DEPTH).replace(
    "{alive}", ALIVE_AT_END).replace("{scope}", REGION_SCOPE.strip()).replace(
    "{at_peak}", "a.event_id <= p.peak_event_id AND coalesce(a.end_event_id, "
    f"{NEVER}) > p.peak_event_id").replace("{allocators}", ALLOCATOR_NAMES).replace(
    "{no_stack}", NO_STACK).replace("{no_caller}", NO_CALLER)

TABLE_NAMES = (
    "processes", "threads", "modules", "mappings", "events", "allocations", "stacks",
    "stack_frames", "frames", "rss", "regions", "region_labels", "stops",
)  # fmt: skip
DERIVED_NAMES = ("heap_timeline", "heap_peak", "backtraces", "region_allocations",
                 "region_frees", "region_heap_timeline", "region_peak")
# The tables a run writes as Parquet (`process --parquet`, `process --dataset`).
EXPORT_TABLES = ("meta", *TABLE_NAMES, *DERIVED_NAMES)


def create_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create every type, table and view in an empty database, and stamp its version."""
    con.execute(TYPES)
    con.execute(TABLES)
    con.execute(VIEWS)
    con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])


def derive(con: duckdb.DuckDBPyConnection, *tables: str) -> None:
    """Fill the derived tables (all, or those named) from the loaded ones."""
    for name in tables or DERIVED:
        con.execute(DERIVED[name])


def connect(database: str = ":memory:", *, read_only: bool = False,
            **config: object) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection as memtrack opens every one: without DuckDB's progress bar,
    which it prints to stdout once a query runs for two seconds (a slow query on a busy
    machine put it in the middle of `query --format json`)."""
    con = duckdb.connect(database, read_only=read_only, config=config)
    con.execute("SET enable_progress_bar = false")  # a session option, not a config one
    return con


# A run database or a dataset comes from elsewhere (a CI job's upload, shared storage)
# and is read, often as root, as hostile input: in an in-memory session that never
# loads or installs an extension and, once `lock`ed, has no file access and cannot
# turn either back on (`SET lock_configuration`).
READ_CONFIG = {"autoload_known_extensions": False, "autoinstall_known_extensions": False}
RUN_CATALOG = "run"  # the run database, attached read-only


def reading_session() -> duckdb.DuckDBPyConnection:
    """An in-memory session for reading a run database or a dataset (then `lock` it)."""
    return connect(**READ_CONFIG)


def lock(con: duckdb.DuckDBPyConnection, *, files: bool = False) -> None:
    """No file access from here on (`files`: keep it, for `query --allow-files`), and no
    SQL may change the session's configuration."""
    if not files:
        con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def sql_literal(text: Path | str) -> str:
    """A path or text as an SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


@cache
def table_columns() -> dict[str, list[tuple[str, str]]]:
    """Every table of a run database (TABLES) with its columns' names and types."""
    con = connect()
    try:
        con.execute(TYPES)
        con.execute(TABLES)
        return _columns(con, "memory")
    finally:
        con.close()


def _columns(con: duckdb.DuckDBPyConnection, catalog: str) -> dict[str, list[tuple[str, str]]]:
    """The tables (not views) of a catalog's main schema with their columns."""
    out: dict[str, list[tuple[str, str]]] = {}
    for table, column, kind in con.execute(
            "SELECT table_name, column_name, data_type FROM duckdb_columns() "
            "JOIN duckdb_tables() USING (database_name, schema_name, table_name) "
            "WHERE database_name = ? AND schema_name = 'main' "
            "ORDER BY table_name, column_index", [catalog]).fetchall():
        out.setdefault(table, []).append((column, kind))
    return out


# The Python view (`report`, `export`, `diff`, `query --python-only`): a stack with Python
# frames keeps them and the native frames inside its innermost one (what that Python
# line called, down to the allocator function); the native frames outside it (the
# interpreter's start, its evaluation loop and calls between Python frames, a thread's
# start) are folded away, as memray's default view shows a Python program. A stack with
# no Python frame stays whole. Depths are renumbered from 0, so that the site, the
# backtraces and every view over stack_frames read the folded stacks; the allocations
# and their stacks' ids are the same as in the native view. `{source}` is where the
# native tables are read: the run database's catalog, or a dataset run's tables.
PYTHON_ONLY = """
CREATE TABLE stack_frames AS
WITH f AS (SELECT * FROM {source}stack_frames),
py AS (SELECT stack_id, min(depth) AS innermost FROM f WHERE method = 'python'
       GROUP BY stack_id)
SELECT f.stack_id,
       (row_number() OVER (PARTITION BY f.stack_id ORDER BY f.depth) - 1)::USMALLINT
           AS depth,
       f.address, f.module_id, f.method, f.lookup_vaddr, f.frame_id
FROM f LEFT JOIN py USING (stack_id)
WHERE py.innermost IS NULL OR f.depth < py.innermost OR f.method = 'python';

CREATE TABLE stacks AS
SELECT s.* REPLACE (coalesce(n.depth, s.depth)::USMALLINT AS depth)
FROM {source}stacks s
LEFT JOIN (SELECT stack_id, count(*) AS depth FROM stack_frames GROUP BY 1) n USING (stack_id);

CREATE TABLE backtraces (stack_id INTEGER, backtrace_id INTEGER);
"""
# the tables PYTHON_ONLY makes again (backtraces derived from the folded stacks)
PYTHON_FOLDED = ("stack_frames", "stacks", "backtraces")


def open_run(path: Path | str, *, files: bool = False,
             python_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open a run database for reading, refusing (RunError, one line) anything but this
    format. The file is attached read-only to a `reading_session` and only its tables
    are read, by name, once each has the columns TABLES gives it: a view or macro
    stored in the file is never run, and the session has memtrack's own views (VIEWS)
    over those tables. `python_only`: the stacks as PYTHON_ONLY folds them (and their
    backtraces made again from those). Locked (`lock`): no file access unless
    `files`."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"{path}: no such run database")
    con = reading_session()
    folded = PYTHON_FOLDED if python_only else ()
    try:
        try:
            con.execute(f"ATTACH {sql_literal(path)} AS {RUN_CATALOG} (READ_ONLY)")
        except duckdb.Error as e:
            raise RunError(f"{path}: not a DuckDB database ({first_line(e)})") from None
        _check_run(con, path)
        for name in table_columns():
            if name in folded:
                continue
            # rss_timeline orders a process's updates by (ts, rowid): rss is copied in
            # the file's order; the other tables are read where they lie
            kind = "TABLE" if name == "rss" else "VIEW"
            con.execute(f"CREATE {kind} {name} AS SELECT * FROM {RUN_CATALOG}.main.{name}")
        if python_only:
            con.execute(PYTHON_ONLY.replace("{source}", f"{RUN_CATALOG}.main."))
        con.execute(VIEWS)
        if python_only:
            derive(con, "backtraces")
        lock(con, files=files)
    except BaseException:
        con.close()
        raise
    return con


def _check_run(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """RunError unless the attached run database is this format with every table."""
    have, want = _columns(con, RUN_CATALOG), table_columns()
    if have.get("meta") != want["meta"]:
        raise RunError(f"{path}: not a memtrack run database (no meta table)")
    row = con.execute(f"SELECT value FROM {RUN_CATALOG}.main.meta "
                      "WHERE key = 'schema_version'").fetchone()
    version = row[0] if row else "?"
    if version != str(SCHEMA_VERSION):
        older = version.isdigit() and int(version) < SCHEMA_VERSION
        raise RunError(
            f"{path}: run database format {version} is "
            f"{'older than' if older else 'not'} the one this memtrack reads ({SCHEMA_VERSION}); "
            "re-run `memtrack process` on its artifact")
    missing = [n for n in want if n not in have]
    if missing:
        raise RunError(f"{path}: a damaged run database: no {', '.join(missing)} "
                       "(re-run `memtrack process` on its artifact)")
    changed = [n for n in want if have[n] != want[n]]
    if changed:
        raise RunError(f"{path}: a damaged run database: {', '.join(changed)} "
                       "not as memtrack writes it (re-run `memtrack process` on its artifact)")


def first_line(e: BaseException) -> str:
    """An error's message as one line (its first)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
