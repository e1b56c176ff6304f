"""The run database (`memtrack process -o RUN.duckdb`): DuckDB DDL of every table and view.

docs/tables.md documents each column. A change to a table or a view's meaning bumps
SCHEMA_VERSION; `open_run` refuses a database written with another version in one line
(re-running `memtrack process` on the artifact rebuilds it).
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from memtrack.schema.enums import Allocator, EndReason, EventKind, RssCause, RssMember, names

SCHEMA_VERSION = 3


class RunError(Exception):
    """A run database that cannot be used, worded for one line: `FILE: problem`."""


def _enum(values: list[str]) -> str:
    return "ENUM(" + ", ".join(f"'{v}'" for v in values) + ")"


EVENT_KINDS = names(EventKind)
ALLOCATORS = names(Allocator)
RSS_MEMBERS = names(RssMember)
END_REASONS = names(EndReason)
RSS_CAUSES = names(RssCause)

TYPES = f"""
CREATE TYPE event_kind AS {_enum(EVENT_KINDS)};
CREATE TYPE allocator_kind AS {_enum(ALLOCATORS)};
CREATE TYPE rss_member AS {_enum(RSS_MEMBERS)};
CREATE TYPE end_reason AS {_enum(END_REASONS)};
CREATE TYPE rss_cause AS {_enum(RSS_CAUSES)};
"""

TABLES = """
CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE TABLE processes (
    pid UINTEGER, ppid UINTEGER, name VARCHAR, exe VARCHAR, cmdline VARCHAR[],
    start_ts UBIGINT, exit_ts UBIGINT, exit_status INTEGER, exit_code INTEGER,
    exit_signal INTEGER
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
    realloc_of UBIGINT, temporary BOOLEAN);
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
CREATE TABLE backtraces (stack_id INTEGER, backtrace_id INTEGER);
"""

# An allocation's site is its first logical frame outside the allocator function (depth
# 1), as heaptrack reports it; the allocator itself where the stack has no caller.
SITE_DEPTH = "CASE WHEN s.depth > 1 THEN 1 ELSE 0 END"

# heap_timeline comes from the pairing stage (memtrack.process.pair); heap_peak and
# backtraces are derived once loaded (as views every report would redo them). A
# backtrace is a stack's frames from its site outward; stacks whose bytes differed but
# that unwound to the same frames share one, named by the lowest such stack_id (keyed
# by a sum of 64-bit hashes of (frame, depth) and the frame count: no list is built).
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
            SELECT stack_id, sum(hash(frame_id, depth)::HUGEINT) AS key, count(*) AS n
            FROM backtrace_frames GROUP BY stack_id)
        SELECT stack_id, min(stack_id) OVER (PARTITION BY key, n) FROM k ORDER BY stack_id""",
}

# A leaked allocation: never freed, its process exec'd or exited or the capture ended.
LEAKED = "end_reason IN ('exec', 'exit', 'end')"

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
SELECT sf.stack_id, sf.frame_id, f.name, f.function, f.file, f.line
FROM stack_frames sf JOIN stacks s USING (stack_id)
JOIN frames f ON f.frame_id = sf.frame_id AND f.inline_depth = 0
WHERE sf.depth = {site};

CREATE VIEW backtrace_frames AS
SELECT sf.stack_id, sf.depth, sf.frame_id
FROM stack_frames sf JOIN stacks s USING (stack_id)
WHERE sf.depth >= {site};

CREATE VIEW allocation_sites AS
SELECT a.*, coalesce(l.name, '[no stack]') AS location, l.file, l.line
FROM allocations a LEFT JOIN stack_location l USING (stack_id);

CREATE VIEW peak AS
SELECT p.peak_ts, p.peak_bytes, a.* FROM allocations a JOIN heap_peak p USING (pid)
WHERE a.event_id <= p.peak_event_id
  AND (a.end_event_id IS NULL OR a.end_event_id > p.peak_event_id);

CREATE VIEW rss_timeline AS
WITH w AS (
    SELECT pid, ts,
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
FROM w;

CREATE VIEW leaks AS SELECT * FROM allocations WHERE {leaked};

CREATE VIEW temporary AS SELECT * FROM allocations WHERE temporary;

CREATE VIEW stack_costs AS
SELECT a.stack_id, a.pid, count(*) AS calls, sum(a.size)::BIGINT AS bytes,
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
self AS (
    SELECT coalesce(l.name, '[no stack]') AS function, sum(calls) AS calls,
           sum(bytes) AS bytes, sum(peak) AS peak, sum(leaked) AS leaked
    FROM per_stack s LEFT JOIN stack_location l USING (stack_id) GROUP BY 1
),
incl AS (
    SELECT f.name AS function, sum(calls) AS calls, sum(bytes) AS bytes,
           sum(peak) AS peak, sum(leaked) AS leaked
    FROM per_stack s JOIN (
        SELECT DISTINCT sf.stack_id, f.name FROM stack_frames sf JOIN frames f USING (frame_id)
    ) f USING (stack_id)
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
""".replace("{leaked}", LEAKED).replace("{site}", SITE_DEPTH)

TABLE_NAMES = (
    "processes", "threads", "modules", "mappings", "events", "allocations", "stacks",
    "stack_frames", "frames", "rss",
)  # fmt: skip
DERIVED_NAMES = ("heap_timeline", "heap_peak", "backtraces")


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


# every table and view a run database has (open_run refuses one that lacks any)
RELATIONS = tuple(re.findall(r"CREATE (?:TABLE|VIEW) (\w+)", TABLES + VIEWS))


def open_run(path: Path | str, *, read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """Open a run database, refusing (RunError, one line) anything but this format."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"{path}: no such run database")
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as e:
        raise RunError(f"{path}: not a DuckDB database ({_first_line(e)})") from None
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except duckdb.Error:
        con.close()
        raise RunError(f"{path}: not a memtrack run database (no meta table)") from None
    version = row[0] if row else "?"
    if version == str(SCHEMA_VERSION):
        have = {r[0] for r in con.execute(
            "SELECT table_name FROM duckdb_tables() UNION SELECT view_name FROM duckdb_views()"
        ).fetchall()}
        missing = [n for n in RELATIONS if n not in have]
        if missing:
            con.close()
            raise RunError(f"{path}: a damaged run database: no {', '.join(missing)} "
                           "(re-run `memtrack process` on its artifact)")
    if version != str(SCHEMA_VERSION):
        con.close()
        older = version.isdigit() and int(version) < SCHEMA_VERSION
        raise RunError(
            f"{path}: run database format {version} is "
            f"{'older' if older else 'not the one'} this memtrack reads ({SCHEMA_VERSION}); "
            "re-run `memtrack process` on its artifact"
        )
    return con


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
