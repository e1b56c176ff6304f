"""The load stage: the stages' Arrow tables into the run database (memtrack.schema.ddl),
in one DuckDB session on the database file being written. `RunDatabase` is driven by
the pipeline (memtrack.process.pipeline), the one orchestration: the tests write their
runs through it too (tests/support/synth.py writes artifacts).

Ids are assigned there, where the rows land: a stack per stack hash, a frame per code
location (module and ELF vaddr, or the runtime address with its reason where
normalization failed); the locations to symbolize are read back from it, their
symbols written into `frames`. Nothing here loops over events, stacks or frames in
Python.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from memtrack.process.dataset import write_parquet
from memtrack.process.lifecycle import Lifecycle
from memtrack.process.lookup import find_sorted
from memtrack.process.stage import StageResult
from memtrack.schema.ddl import (
    ALLOCATORS,
    DERIVED_NAMES,
    END_REASONS,
    EVENT_KINDS,
    EXPORT_TABLES,
    RSS_CAUSES,
    RSS_MEMBERS,
    STOP_REASONS,
    TABLE_NAMES,
    connect,
    create_schema,
    derive,
)
from memtrack.schema.enums import ALLOC_KINDS, EventKind
from memtrack.schema.stages import SYMBOLIZED_FRAMES


@dataclass
class Loaded(StageResult):
    """What the load stage wrote and learnt on the way (counters:
    `symbolize_missing_rows`, the locations the symbolizer returned nothing for)."""

    rows: dict[str, int] = field(default_factory=dict)  # per table
    frames_by_method: dict[str, int] = field(default_factory=dict)
    unknown_frames: int = 0  # stack frames whose (outermost) function is unknown


def _names(values: list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


KIND_SQL = f"CAST(list_extract({_names(EVENT_KINDS)}, kind::INTEGER) AS event_kind)"
ALLOCATOR_SQL = (
    f"CAST(list_extract({_names(ALLOCATORS)}, allocator::INTEGER + 1) AS allocator_kind)"
)
MEMBER_SQL = f"CAST(list_extract({_names(RSS_MEMBERS)}, member::INTEGER + 1) AS rss_member)"
CAUSE_SQL = f"CAST(list_extract({_names(RSS_CAUSES)}, cause::INTEGER + 1) AS rss_cause)"
STOP_SQL = f"CAST(list_extract({_names(STOP_REASONS)}, reason::INTEGER + 1) AS stop_reason)"
END_SQL = f"CAST(list_extract({_names(END_REASONS)}, end_reason::INTEGER + 1) AS end_reason)"
HEAP_KINDS = ", ".join(f"'{EVENT_KINDS[k - 1]}'" for k in (*ALLOC_KINDS, EventKind.FREE))

# One stack per stack hash (unwind gives each hash once); a location is (module, ELF
# vaddr) where normalization succeeded, else (its reason, the runtime address).
STACKS_SQL = """
    CREATE TEMP TABLE st AS
    SELECT (row_number() OVER (ORDER BY stack_hash) - 1)::INTEGER AS stack_id, *
    FROM src_stacks;
    INSERT INTO stacks SELECT stack_id, stack_hash, pid, depth, truncated, complete, stop
    FROM st ORDER BY stack_id;
    CREATE TEMP VIEW sfl AS
    SELECT *, CASE WHEN reason IS NULL THEN build_id END AS loc_build_id,
           CASE WHEN reason IS NULL THEN lookup_vaddr ELSE address END AS loc_key
    FROM src_stack_frames;
    CREATE TEMP TABLE locs AS
    SELECT (row_number() OVER (ORDER BY build_id NULLS LAST, key, reason) - 1)::INTEGER
           AS frame_id, build_id, key, reason FROM (
        SELECT DISTINCT loc_build_id AS build_id, loc_key AS key, reason FROM sfl);
    INSERT INTO stack_frames
    SELECT st.stack_id, f.depth, f.address, m.module_id, f.method, f.lookup_vaddr, l.frame_id
    FROM sfl f JOIN st USING (stack_hash)
    LEFT JOIN src_modules m ON m.build_id = f.build_id
    JOIN locs l ON l.build_id IS NOT DISTINCT FROM f.loc_build_id AND l.key = f.loc_key
        AND l.reason IS NOT DISTINCT FROM f.reason
    ORDER BY st.stack_id, f.depth;
"""
KNOWN_SQL = """
    SELECT l.frame_id, l.build_id, l.key AS vaddr, m.path FROM locs l
    LEFT JOIN src_modules m USING (build_id)
    WHERE l.build_id IS NOT NULL ORDER BY l.frame_id"""
FRAMES_SQL = """
    CREATE TEMP TABLE fr AS
    WITH k AS (SELECT (row_number() OVER (ORDER BY frame_id) - 1)::UINTEGER AS row, *
               FROM known)
    SELECT k.frame_id, s.inline_depth, s.function, s.symbol, s."offset", s.file, s.line,
           s."column", m.module_id, k.vaddr, NULL::UBIGINT AS address, s.reason
    FROM sym s JOIN k USING (row) LEFT JOIN src_modules m ON m.build_id = k.build_id
    UNION ALL
    SELECT frame_id, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, key, reason
    FROM locs WHERE build_id IS NULL AND reason IS NOT NULL
    UNION ALL
    SELECT l.frame_id, 0, p.function, NULL, NULL, p.file, p.line, NULL, NULL, NULL, NULL, NULL
    FROM locs l JOIN src_python_locations p USING (key)
    WHERE l.build_id IS NULL AND l.reason IS NULL;
    INSERT INTO frames SELECT f.frame_id, f.inline_depth,
        coalesce(f.function, f.symbol,
                 CASE WHEN d.path IS NOT NULL THEN
                     regexp_extract(d.path, '[^/]*$') || '+0x' || lower(hex(f.vaddr)) END,
                 '0x' || lower(hex(f.address))),
        f.function, f.symbol, f."offset", f.file, f.line, f."column", f.module_id,
        f.vaddr, f.reason
    FROM fr f LEFT JOIN src_modules d USING (module_id)
    ORDER BY f.frame_id, f.inline_depth;
"""

INSERTS = {
    # Sources arrive in event order; DuckDB keeps insertion order without a sort.
    "events": f"""
        INSERT INTO events SELECT event_id, ts, pid, tid, {KIND_SQL}, {ALLOCATOR_SQL},
            flags, addr, old_addr, size, stack_hash, stack_id
        FROM src_events""",
    "allocations": f"""
        INSERT INTO allocations SELECT alloc_id, event_id, pid, tid, ts, {KIND_SQL},
            {ALLOCATOR_SQL}, addr, size, stack_id, free_ts, free_event_id, free_tid, end_ts,
            end_event_id, {END_SQL}, lifetime_ns, realloc_of, temporary, inherited_from
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
    "rss": f"""
        INSERT INTO rss SELECT ts, pid, {MEMBER_SQL}, bytes, {CAUSE_SQL} FROM src_rss""",
    "processes": "INSERT INTO processes SELECT * FROM src_processes",
    "regions": "INSERT INTO regions SELECT * FROM src_regions",
    "region_labels": "INSERT INTO region_labels SELECT * FROM src_region_labels",
    "stops": f"""
        INSERT INTO stops SELECT pid, {STOP_SQL}, begin_ts, end_ts FROM src_stops
        ORDER BY begin_ts, pid""",
    # A thread starts at the FORK that made it (a process's main thread at the process
    # fork), else when first seen; `events` counts its allocator events.
    "threads": f"""
        INSERT INTO threads
        WITH starts AS (SELECT child AS tid, min(ts) AS ts FROM src_clones GROUP BY 1),
        exits AS (SELECT tid, max(ts) AS ts FROM src_exits GROUP BY tid),
        seen AS (
            SELECT pid, tid, min(ts) AS ts, count(*) FILTER (WHERE kind IN ({HEAP_KINDS})) AS n
            FROM events
            WHERE event_id NOT IN (SELECT event_id FROM src_clones WHERE NOT thread)
            GROUP BY pid, tid)
        SELECT s.pid, s.tid, coalesce(st.ts, s.ts), x.ts, s.n
        FROM seen s LEFT JOIN starts st USING (tid) LEFT JOIN exits x USING (tid)
        ORDER BY 3, 2""",
}


MEMORY_LIMIT = "512MB"


class RunDatabase:
    """A run database being written: a temporary file next to `out_db`, renamed over it
    by `finish` (a failed run leaves the old database in place)."""

    def __init__(self, out_db: Path, threads: int = 1) -> None:
        self.out_db = Path(out_db)
        remove_leftovers(self.out_db)
        self.tmp = self.out_db.with_name(f".{self.out_db.name}.{os.getpid()}.tmp")
        self.tmp.unlink(missing_ok=True)
        # DuckDB keeps at most MEMORY_LIMIT of the tables it is given in memory and
        # writes the rest out to the database file (its default is 80 % of the RAM)
        self.con = connect(str(self.tmp), memory_limit=MEMORY_LIMIT, threads=threads)
        create_schema(self.con)
        self.stack_ids: pa.Table | None = None  # stack_hash -> stack_id, once loaded

    def copy_in(self, name: str, tbl: pa.Table) -> None:
        """A temp table of `tbl`. Copied, not scanned in place: DuckDB pushes join
        filters into Arrow scans as Python ints, which fails on uint64 values >= 2**63."""
        self.con.register(f"{name}_arrow", tbl)
        self.con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM {name}_arrow")
        self.con.unregister(f"{name}_arrow")

    def meta(self, values: dict[str, str]) -> None:
        if values:
            self.con.executemany("INSERT INTO meta VALUES (?, ?)", list(values.items()))

    def stacks(self, stacks: pa.Table, stack_frames: pa.Table, modules: pa.Table) -> pa.Table:
        """Load modules, stacks and stack frames; returns the code locations to symbolize
        (frame_id, build_id, vaddr, path), by frame_id."""
        self.copy_in("src_modules", modules)
        self.con.execute(INSERTS["modules"])
        self.copy_in("src_stacks", stacks)
        self.copy_in("src_stack_frames", stack_frames)
        self.con.execute(STACKS_SQL)
        ids = self.con.execute("SELECT stack_hash, stack_id FROM stacks").to_arrow_table()
        # sorted once by hash: every piece of events and allocations looks its hashes up
        self.stack_ids = ids.take(pa.array(np.argsort(ids.column("stack_hash").to_numpy())))
        return self.con.execute(KNOWN_SQL).to_arrow_table()

    def frames(self, known: pa.Table, symbolized: pa.Table,
               python_locations: pa.Table | None = None) -> Loaded:
        """Load the frames table from the symbolized locations (row = known's row) and
        the Python locations (the frames with neither module nor reason)."""
        from memtrack.process.pyframes import PYTHON_LOCATIONS

        self.copy_in("src_python_locations", python_locations if python_locations is not None
                     else PYTHON_LOCATIONS.empty_table())
        self.copy_in("known", known)
        self.copy_in("sym", symbolized.select(SYMBOLIZED_FRAMES.names).cast(SYMBOLIZED_FRAMES))
        self.con.execute(FRAMES_SQL)
        out = Loaded()
        rows_out = np.unique(symbolized.column("row").to_numpy()) if symbolized.num_rows \
            else np.array([])
        out.counters["symbolize_missing_rows"] = known.num_rows - len(rows_out)
        out.frames_by_method = dict(self.con.execute(
            "SELECT method, count(*) FROM stack_frames GROUP BY 1 ORDER BY 1").fetchall())
        out.unknown_frames = self.con.execute("""
            SELECT count(*) FROM stack_frames sf JOIN frames f USING (frame_id)
            WHERE f.inline_depth = 0 AND f.reason IS NOT NULL""").fetchone()[0]  # type: ignore[index]
        return out

    def events(self, pieces: Iterable[pa.Table], *, aside: bool = False) -> None:
        """Load the events (time-ordered, event_id first; after `stacks`: each with its
        stack's id), a table at a time. aside: on a connection of its own, so that
        another thread may go on with this one meanwhile (the events table is all it
        touches)."""
        con = self.con.cursor() if aside else self.con
        try:
            for piece in pieces:
                self.insert(con, "events", piece)
        finally:
            if aside:
                con.close()

    def insert(self, con: duckdb.DuckDBPyConnection, name: str, piece: pa.Table) -> None:
        """Load the next rows of events, allocations (ALLOCATIONS, by alloc_id) or the
        heap timeline (HEAP_TIMELINE, in event order) on `con`; after `stacks`: each
        event and allocation with its stack's id."""
        if name != "heap_timeline":
            assert self.stack_ids is not None, "stacks first"
            piece = with_stack_ids(piece, self.stack_ids)
        con.register(f"src_{name}", piece)
        con.execute(INSERTS[name])
        con.unregister(f"src_{name}")

    def processes(self, lifecycle: Lifecycle) -> None:
        """Load processes (each pid's last process) and threads (after `events`)."""
        for name, tbl in (("processes", lifecycle.processes_table()),
                          ("clones", lifecycle.clones), ("exits", lifecycle.exits)):
            self.copy_in(f"src_{name}", tbl)
        self.con.execute(INSERTS["processes"])
        self.con.execute(INSERTS["threads"])

    def missing_stacks(self) -> int:
        """Events that name a stack hash with no stack (its record lost or undecodable)."""
        return self.con.execute("SELECT count(*) FROM events WHERE stack_hash <> 0 "
                                "AND stack_id IS NULL").fetchone()[0]  # type: ignore[index]

    def table(self, name: str, tbl: pa.Table) -> None:
        """Load mappings, rss, regions, region_labels or stops."""
        self.con.register(f"src_{name}", tbl)
        self.con.execute(INSERTS[name])
        self.con.unregister(f"src_{name}")

    def finish(self, parquet_dir: Path | None = None) -> dict[str, int]:
        """Derive the computed tables, export Parquet if asked, and move the database into
        place; returns rows per table."""
        try:
            derive(self.con)
            counts = {
                name: self.con.execute(f"SELECT count(*) FROM {name}").fetchone()[0]  # type: ignore[index]
                for name in TABLE_NAMES + DERIVED_NAMES
            }
            if parquet_dir is not None:
                export_parquet(self.con, Path(parquet_dir))
            self.con.execute("CHECKPOINT")
        finally:
            self.con.close()
        os.replace(self.tmp, self.out_db)
        Path(str(self.tmp) + ".wal").unlink(missing_ok=True)
        return counts

    def abandon(self) -> None:
        self.con.close()
        self.tmp.unlink(missing_ok=True)
        Path(str(self.tmp) + ".wal").unlink(missing_ok=True)


def remove_leftovers(out_db: Path) -> None:
    """Delete what a run that wrote `out_db` and was killed outright (SIGKILL, a crash)
    left beside it: its `.NAME.PID.tmp` database, WAL and spill, whose process is gone
    (a run still going, even another user's, keeps its files)."""
    prefix = f".{out_db.name}."
    for path in out_db.parent.glob(f"{glob.escape(prefix)}*.tmp*"):
        pid = path.name[len(prefix):].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class Aside:
    """Inserts into a run database on a connection of its own, in a thread, so that the
    caller goes on while one runs; the next waits for it (pieces never pile up)."""

    def __init__(self, db: RunDatabase) -> None:
        self.db, self.con = db, db.con.cursor()
        self.pool = ThreadPoolExecutor(1)
        self.pending: Future[None] | None = None

    def insert(self, name: str, piece: pa.Table) -> None:
        self.wait()
        self.pending = self.pool.submit(self.db.insert, self.con, name, piece)

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown()
            self.con.close()


def with_stack_ids(table: pa.Table, stacks: pa.Table) -> pa.Table:
    """`table` with a stack_id column: its stack_hash's id in `stacks` (stack_hash,
    stack_id, sorted by stack_hash), null where the hash is 0 (no stack captured) or has
    no stack."""
    h = table.column("stack_hash").to_numpy()
    known = stacks.column("stack_hash").to_numpy()
    ids = stacks.column("stack_id").to_numpy()
    i, hit = find_sorted(known, h)
    hit &= h != 0
    sid = ids[i] if len(known) else np.zeros(len(h), np.int32)
    return table.append_column("stack_id", pa.array(sid.astype(np.int32), mask=~hit))


def export_parquet(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """Every table as Parquet, one directory per table (ROOT/TABLE/data.parquet)."""
    for name in EXPORT_TABLES:
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        write_parquet(con, f"SELECT * FROM {name}", d / "data.parquet")


def meta_rows(**values: object) -> dict[str, str]:
    """meta values as strings (JSON for anything that is not a str or int)."""
    return {
        k: v if isinstance(v, str) else str(v) if isinstance(v, int) else json.dumps(v)
        for k, v in values.items()
    }
