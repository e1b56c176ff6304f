"""`memtrack process`: read → pair → decode + unwind → symbolize → load.

Each stage is called through its module's entry point (decode, unwind, symbolize are
written by their own owners); this module only moves Arrow tables between them and
assigns the run database's ids. The stack stages run only when the artifact holds stack
records (a capture made with --no-stacks has none). Decode and unwind go run by run
(decode_chunks): the rebuilt stack bytes, gigabytes on a long capture, are held one
run at a time, and only the frames and stacks tables of each run are kept.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from memtrack.process.load import StageTables, load, meta_rows
from memtrack.process.pair import pair, sort_events
from memtrack.process.report import counter_lines
from memtrack.schema import FORMAT_VERSION, EventKind
from memtrack.schema.artifact import Artifact

T = TypeVar("T")

UNWOUND_FRAMES = pa.schema([
    ("stack_hash", pa.uint64()), ("pid", pa.uint32()), ("depth", pa.uint16()),
    ("address", pa.uint64()), ("method", pa.string()), ("build_id", pa.string()),
    ("path", pa.string()), ("lookup_vaddr", pa.uint64())])  # fmt: skip
UNWOUND_STACKS = pa.schema([
    ("stack_hash", pa.uint64()), ("pid", pa.uint32()), ("depth", pa.uint16()),
    ("truncated", pa.bool_()), ("complete", pa.bool_()), ("stop", pa.string())])  # fmt: skip
SYMBOLS = pa.schema([
    ("row", pa.uint32()), ("inline_depth", pa.uint8()), ("function", pa.string()),
    ("symbol", pa.string()), ("offset", pa.uint64()), ("file", pa.string()),
    ("line", pa.uint32()), ("column", pa.uint32()), ("reason", pa.string())])  # fmt: skip


class ProcessError(Exception):
    """`process` cannot write its output; the message is one line for the user."""


@dataclass
class Summary:
    """What `process` did: row counts, stage times, and everything that was lost."""

    artifact: Path
    out_db: Path
    events: int = 0
    allocations: int = 0
    stacks: int = 0
    frames_by_method: dict[str, int] = field(default_factory=dict)
    unknown_frames: int = 0
    losses: dict[str, int] = field(default_factory=dict)  # capture's, from the manifest
    counters: dict[str, int] = field(default_factory=dict)  # process's own
    rows: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    warnings: list[str] = field(default_factory=list)
    metadata: Path | None = None  # memory_metadata.json

    def lines(self) -> list[str]:
        out = [
            f"{self.out_db}: {self.events} events, {self.allocations} allocations, "
            f"{self.stacks} distinct stacks, {self.rows.get('stack_frames', 0)} frames",
        ]
        if self.frames_by_method:
            methods = ", ".join(f"{k} {v}" for k, v in sorted(self.frames_by_method.items()))
            out.append(f"frames by method: {methods}; unknown frames: {self.unknown_frames}")
        out.append("stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))
        out.extend(counter_lines(self.losses))
        noted = {k: v for k, v in self.counters.items() if v and k in NOTABLE}
        if noted:
            out.append("process: " + ", ".join(f"{k} {v}" for k, v in noted.items()))
        out.extend(f"warning: {w}" for w in self.warnings)
        return out


# Process counters worth a line in the summary when not zero (the rest are in meta).
NOTABLE = (
    "events_bad_kind", "frees_unmatched", "allocations_reused_without_free",
    "decode_mismatch", "events_stack_missing", "symbolize_missing_rows",
    "stacks_duplicate_hash",
)  # fmt: skip


class _Stages:
    """Times each stage and drives a progress bar (only on a terminal)."""

    def __init__(self, summary: Summary, show: bool) -> None:
        self.summary = summary
        self.tasks: dict[str, Any] = {}
        self.progress = Progress(
            TextColumn("{task.description:<10}"), BarColumn(), TimeElapsedColumn(),
            console=Console(stderr=True), disable=not show, transient=False,
        )

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """A stage, or one more run of it (decode and unwind run once per run of stack
        records): its time adds up, its progress line pulses until the last run ends."""
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=None)
        t0 = time.perf_counter()
        yield
        timings = self.summary.timings
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0

    def done(self) -> None:
        for task in self.tasks.values():
            self.progress.update(task, total=1, completed=1)

    def run(self, name: str, fn: Callable[[], T]) -> T:
        with self.stage(name):
            return fn()


def process(
    artifact_path: Path | str,
    out_db: Path | str,
    *,
    parquet_dir: Path | str | None = None,
    host_modules: bool = True,
    cache_dir: Path | str | None = None,
    progress: bool | None = None,
    chunk_bytes: int | None = None,
) -> Summary:
    """Process an artifact into a run database. Raises ArtifactError for a bad artifact.

    host_modules: where the artifact lacks a module, use the host file at its mapped path
    when its build id matches. cache_dir: the symbolization cache (per build id).
    progress: a progress bar per stage; None = only when stderr is a terminal.
    chunk_bytes: rebuilt stack bytes decoded and unwound at a time (None: decode's
    DEFAULT_MAX_BYTES); the output does not depend on it, the peak memory does.
    """
    artifact_path, out_db = Path(artifact_path), Path(out_db)
    if not out_db.parent.is_dir():
        raise ProcessError(f"{out_db.parent}: no such directory for the run database")
    if out_db.is_dir():
        raise ProcessError(f"{out_db}: is a directory, not a run database path")
    summary = Summary(artifact_path, out_db)
    show = sys.stderr.isatty() if progress is None else progress
    st = _Stages(summary, show)
    with st.progress:
        art = Artifact.open(artifact_path)
        summary.losses = dict(art.manifest.losses)
        with st.stage("read"):
            events = art.read("events").table
            mappings = art.read("mappings", required=False).table
            processes = art.read("processes", required=False).table
            rss = art.read("rss", required=False).table
            raw_stacks = art.read("stacks", required=False).table
            events = _valid_events(events, summary.counters)
            events = sort_events(events)
        summary.events = events.num_rows

        m = art.manifest
        pairing = st.run("pair", lambda: pair(events, m.end_ns or None))
        summary.counters.update(pairing.counters)
        summary.allocations = pairing.allocations.num_rows

        with st.stage("rss"):
            from memtrack.process.rss import rss_timeline

            rss = rss_timeline(rss, events)
        store = _module_store(artifact_path, host_modules)
        unwound = _decode_unwind(raw_stacks, mappings, store, summary, st, chunk_bytes)
        modules = _modules(mappings, unwound[0], store, artifact_path)
        with st.stage("symbolize"):
            stacks, stack_frames, frames = _symbolize(
                unwound, modules, store, summary, Path(cache_dir) if cache_dir else None)
        summary.stacks = stacks.num_rows
        summary.counters["events_stack_missing"] = _missing_stacks(events, stacks)
        summary.warnings = [*art.warnings, *summary.warnings,
                            *(p for p in store.problems if p not in summary.warnings)]

        tables = StageTables(
            events=events, allocations=pairing.allocations,
            heap_timeline=pairing.heap_timeline, mappings=mappings,
            processes=processes, rss=rss, modules=modules, stacks=stacks,
            stack_frames=stack_frames, frames=frames,
        )
        meta = meta_rows(
            artifact=str(artifact_path.resolve()),
            artifact_format=m.format_version,
            reader_format=FORMAT_VERSION,
            memtrack_version=m.memtrack_version,
            command=m.command,
            root_pid=m.root_pid,
            start_ns=m.start_ns,
            end_ns=m.end_ns or (int(events.column("ts")[-1].as_py()) if events.num_rows else 0),
            wall_offset_ns=m.clock.wall_offset_ns,
            exit_status=m.exit_status.__dict__,
            host=m.host.__dict__,
            losses=summary.losses,
            counters=summary.counters,
            options=m.options,
            warnings=summary.warnings,
        )
        summary.rows = st.run(
            "load",
            lambda: load(out_db, tables, meta, Path(parquet_dir) if parquet_dir else None),
        )
        summary.metadata = st.run("metadata", lambda: _write_metadata(art, out_db))
        st.done()
    return summary


def _valid_events(events: pa.Table, counters: dict[str, int]) -> pa.Table:
    kind = events.column("kind")
    ok = pc.and_(pc.greater_equal(kind, min(EventKind)), pc.less_equal(kind, max(EventKind)))
    bad = events.num_rows - pc.sum(ok).as_py() if events.num_rows else 0
    counters["events_bad_kind"] = bad
    return events.filter(ok) if bad else events


def _decode_unwind(raw_stacks: pa.Table, mappings: pa.Table, store: Any, summary: Summary,
                   st: _Stages, chunk_bytes: int | None) -> tuple[pa.Table, pa.Table]:
    """Unwound frames and stacks of every stack record, decoded and unwound run by run.
    A (hash, pid) unwound in an earlier run is not unwound again: unwind keeps the first
    record of each, and the runs are in file order, so the tables are those of decoding
    and unwinding the whole table at once."""
    if raw_stacks.num_rows == 0:
        return UNWOUND_FRAMES.empty_table(), UNWOUND_STACKS.empty_table()
    from memtrack.process.decode import DEFAULT_MAX_BYTES, decode_chunks

    runs = decode_chunks(raw_stacks, chunk_bytes or DEFAULT_MAX_BYTES)
    frames, stacks = [], []
    seen = np.zeros(0, dtype=_KEY)
    while True:
        with st.stage("decode"):
            run = next(runs, None)
        if run is None:
            break
        for k, v in run.counters.items():
            summary.counters[k] = summary.counters.get(k, 0) + int(v)
        with st.stage("unwind"):
            keys = _keys(run.table.column("hash"), run.table.column("pid"))
            new = ~np.isin(keys, seen)
            table = run.table if new.all() else run.table.filter(pa.array(new))
            del run
            f, s = _unwind(table, mappings, store, summary)
            del table
            frames.append(f)
            stacks.append(s)
            seen = np.concatenate([seen, _keys(s.column("stack_hash"), s.column("pid"))])
    return pa.concat_tables(frames), pa.concat_tables(stacks)


_KEY = np.dtype((np.void, 16))  # (hash, pid) as one comparable value


def _keys(hashes: pa.ChunkedArray, pids: pa.ChunkedArray) -> np.ndarray:
    pair = np.stack([hashes.to_numpy().astype(np.uint64), pids.to_numpy().astype(np.uint64)],
                    axis=1)
    return np.ascontiguousarray(pair).view(_KEY).ravel()


def _module_store(artifact_path: Path, host_modules: bool) -> Any:
    from memtrack.symbolize.modules import ModuleStore

    return ModuleStore(artifact_path, host_modules=host_modules)


def _unwind(decoded: pa.Table | None, mappings: pa.Table, store: Any, summary: Summary,
            ) -> tuple[pa.Table, pa.Table]:
    if decoded is None or decoded.num_rows == 0:
        return UNWOUND_FRAMES.empty_table(), UNWOUND_STACKS.empty_table()
    from memtrack.process.unwind import unwind

    out = unwind(decoded, mappings, store)
    for k, v in out.counters.items():  # the unwinder's counters are named unwind_*
        summary.counters[k] = summary.counters.get(k, 0) + int(v)
    summary.warnings.extend(p for p in dict.fromkeys(out.problems) if p not in summary.warnings)
    frames = out.frames.select(UNWOUND_FRAMES.names).cast(UNWOUND_FRAMES)
    stacks = out.stacks.select(UNWOUND_STACKS.names).cast(UNWOUND_STACKS)
    return frames, stacks


def _modules(mappings: pa.Table, frames: pa.Table, store: Any, artifact_path: Path) -> pa.Table:
    """One row per build id mapped or met while unwinding (a few hundred at most)."""
    seen: dict[str, str] = {}
    for tbl in (mappings, frames):
        bids = tbl.column("build_id")
        paths = tbl.column("path")
        valid = pc.is_valid(bids)
        pairs = pa.table({"b": bids.filter(valid), "p": paths.filter(valid)})
        for row in pairs.group_by("b", use_threads=False).aggregate([("p", "first")]).to_pylist():
            seen.setdefault(row["b"], row["p_first"] or "")
    art_dir = artifact_path.resolve()
    rows: dict[str, list[Any]] = {k: [] for k in (
        "module_id", "build_id", "path", "elf_path", "has_debuginfo", "in_artifact")}
    for i, (bid, path) in enumerate(sorted(seen.items())):
        mod = store.get(bid, path)
        rows["module_id"].append(i)
        rows["build_id"].append(bid)
        rows["path"].append(path)
        rows["elf_path"].append(str(mod.elf_path) if mod else None)
        rows["has_debuginfo"].append(bool(mod and _has_debuginfo(mod)))
        rows["in_artifact"].append(bool(mod and art_dir in Path(mod.elf_path).resolve().parents))
    return pa.table(rows, schema=pa.schema([
        ("module_id", pa.int32()), ("build_id", pa.string()), ("path", pa.string()),
        ("elf_path", pa.string()), ("has_debuginfo", pa.bool_()), ("in_artifact", pa.bool_())]))


def _has_debuginfo(mod: Any) -> bool:
    """Whether the symbolizer will find DWARF for the module (same test as it makes)."""
    if mod.debug_path is not None:
        return True
    from memtrack.symbolize.symtab import ElfImage, ElfReadError

    try:
        image = ElfImage(Path(mod.elf_path))
    except ElfReadError:
        return False
    try:
        return image.has(".debug_info")
    finally:
        image.close()


def _symbolize(
    unwound: tuple[pa.Table, pa.Table], modules: pa.Table, store: Any, summary: Summary,
    cache_dir: Path | None,
) -> tuple[pa.Table, pa.Table, pa.Table]:
    """stacks, stack_frames and frames with their ids; symbolizes each distinct location."""
    uf, us = unwound
    con = duckdb.connect()
    for name, tbl in (("uf", uf), ("us", us), ("mods", modules)):
        _copy_in(con, name, tbl)
    # One stack per hash: the same bytes recorded again (by a forked child, or after the
    # in-kernel dedupe forgot them) unwind the same; the first pid's unwinding is kept.
    stacks = con.execute("""
        SELECT (row_number() OVER (ORDER BY stack_hash) - 1)::INTEGER AS stack_id, *
        FROM us QUALIFY row_number() OVER (PARTITION BY stack_hash ORDER BY pid) = 1
        """).to_arrow_table()
    summary.counters["stacks_duplicate_hash"] = us.num_rows - stacks.num_rows
    _copy_in(con, "st", stacks)
    # A location: (module, ELF vaddr) where both are known, else the runtime address.
    con.execute("""
        CREATE TEMP VIEW ufl AS
        SELECT *, CASE WHEN lookup_vaddr IS NOT NULL THEN build_id END AS loc_build_id,
               CASE WHEN build_id IS NOT NULL AND lookup_vaddr IS NOT NULL
                    THEN lookup_vaddr ELSE address END AS loc_key
        FROM uf""")
    con.execute("""
        CREATE TEMP TABLE locs AS
        SELECT (row_number() OVER (ORDER BY build_id NULLS LAST, key) - 1)::INTEGER
               AS frame_id, build_id, key FROM (
            SELECT DISTINCT loc_build_id AS build_id, loc_key AS key FROM ufl)""")
    stack_frames = con.execute("""
        SELECT st.stack_id, u.depth, u.address, m.module_id, u.method, u.lookup_vaddr,
               l.frame_id
        FROM ufl u JOIN st USING (stack_hash, pid)
        LEFT JOIN mods m ON m.build_id = u.build_id
        JOIN locs l ON l.build_id IS NOT DISTINCT FROM u.loc_build_id AND l.key = u.loc_key
        ORDER BY st.stack_id, u.depth""").to_arrow_table()
    known = con.execute("""
        SELECT l.frame_id, l.build_id, l.key, m.path FROM locs l
        LEFT JOIN mods m USING (build_id)
        WHERE l.build_id IS NOT NULL ORDER BY l.frame_id""").to_arrow_table()
    if known.num_rows:
        from memtrack.symbolize import symbolize

        sym = symbolize(store, known.column("build_id").combine_chunks(),
                        known.column("key").to_numpy(),
                        paths=known.column("path").combine_chunks(), cache_dir=cache_dir)
        sym = sym.select(SYMBOLS.names).cast(SYMBOLS)
    else:
        sym = SYMBOLS.empty_table()
    _copy_in(con, "known", known)
    _copy_in(con, "sym", sym)
    frames = con.execute("""
        WITH k AS (SELECT (row_number() OVER (ORDER BY frame_id) - 1)::UINTEGER AS row, *
                   FROM known)
        SELECT k.frame_id, s.inline_depth, s.function, s.symbol, s."offset", s.file, s.line,
               s."column", m.module_id, k.key AS vaddr, NULL::UBIGINT AS address, s.reason
        FROM sym s JOIN k USING (row) LEFT JOIN mods m ON m.build_id = k.build_id
        UNION ALL
        SELECT frame_id, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, key,
               'no-mapping'
        FROM locs WHERE build_id IS NULL
        ORDER BY 1, 2""").to_arrow_table()
    rows_out = np.unique(sym.column("row").to_numpy()) if sym.num_rows else np.array([])
    summary.counters["symbolize_missing_rows"] = known.num_rows - len(rows_out)
    _copy_in(con, "stack_frames", stack_frames)
    _copy_in(con, "frames", frames)
    summary.frames_by_method = dict(
        con.execute("SELECT method, count(*) FROM stack_frames GROUP BY 1 ORDER BY 1").fetchall()
    )
    summary.unknown_frames = con.execute("""
        SELECT count(*) FROM stack_frames sf JOIN frames f USING (frame_id)
        WHERE f.inline_depth = 0 AND f.reason IS NOT NULL""").fetchone()[0]  # type: ignore[index]
    con.close()
    return stacks, stack_frames, frames


def _copy_in(con: duckdb.DuckDBPyConnection, name: str, tbl: pa.Table) -> None:
    """A DuckDB temp table of `tbl`. Copied, not scanned in place: DuckDB pushes join
    filters into Arrow scans as Python ints, which fails on uint64 values >= 2**63."""
    con.register(f"{name}_arrow", tbl)
    con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM {name}_arrow")
    con.unregister(f"{name}_arrow")


def _missing_stacks(events: pa.Table, stacks: pa.Table) -> int:
    """Events that name a stack hash with no stack record (lost or undecodable)."""
    h = events.column("stack_hash").to_numpy()
    h = h[h != 0]
    known = np.sort(stacks.column("stack_hash").to_numpy())
    if len(known) == 0:
        return int(len(h))
    i = np.minimum(np.searchsorted(known, h), len(known) - 1)
    return int((known[i] != h).sum())


def _write_metadata(art: Artifact, out_db: Path) -> Path:
    """memory_metadata.json next to the run database (memtrack.process.metadata)."""
    from memtrack.process.metadata import write_memory_metadata

    return write_memory_metadata(art, out_db.parent / "memory_metadata.json")
