"""`memtrack process`: read (the events into a spill) -> lifecycle -> rss -> regions ->
decode + unwind (in the snapshots and the address spaces forked children inherit) ->
load the stacks (symbolizing the code locations they hold) -> pair (the spill's buckets)
-> load the rest -> RUN.memory_metadata.json, all in one DuckDB session on the database
being written. No stage holds the events whole: their number sizes the disk used, not
the memory (memtrack.process.spill).

Each stage is its module's entry point; this module runs them in order, times them and
gathers their counters. Decode and unwind go piece by piece, on `jobs` processes
(memtrack.process.parallel): the rebuilt stack bytes, gigabytes on a long capture, are
held one piece (per job) at a time; each stack hash is unwound once, from its first
record that verifies. The stack stages do nothing when the artifact holds no stack
records (a capture made with --stacks off).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from memtrack.addrspace.mappings import inherited_mappings
from memtrack.addrspace.modules import ModuleStore, host_modules_for
from memtrack.process import metadata
from memtrack.process.decode import DEFAULT_MAX_BYTES
from memtrack.process.lifecycle import of_artifact
from memtrack.process.load import Aside, RunDatabase, meta_rows
from memtrack.process.pair import pair_spilled
from memtrack.process.parallel import default_jobs, unwind_records
from memtrack.process.progress import Advance, ProgressSink, TerminalProgress
from memtrack.process.pyframes import merge as merge_python
from memtrack.process.read import LIFECYCLE_TABLES, read_artifact, spilled_events
from memtrack.process.regions import regions
from memtrack.process.rss import resident
from memtrack.process.spill import EventSpill, OtherEvents, buckets_for
from memtrack.process.stage import StageResult
from memtrack.process.unwind import UnwoundStacks, module_paths
from memtrack.schema import FORMAT_VERSION, loss_lines, table_file
from memtrack.schema.artifact import Artifact, ArtifactError
from memtrack.schema.stages import (
    MODULES,
    SYMBOLIZED_FRAMES,
)

R = TypeVar("R", bound=StageResult)


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
    notes: list[str] = field(default_factory=list)  # said, not kept in the run's warnings
    metadata: Path | None = None  # RUN.memory_metadata.json

    def lines(self) -> list[str]:
        out = [
            f"{self.out_db}: {self.events} events, {self.allocations} allocations, "
            f"{self.stacks} distinct stacks, {self.rows.get('stack_frames', 0)} frames",
        ]
        if self.frames_by_method:
            methods = ", ".join(f"{k} {v}" for k, v in sorted(self.frames_by_method.items()))
            out.append(f"frames by method: {methods}; unknown frames: {self.unknown_frames}")
        out.append("stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))
        out.extend(loss_lines(self.losses))
        noted = {k: v for k, v in self.counters.items()
                 if v and (k in NOTABLE or k.endswith("_bad_rows"))}
        if noted:
            out.append("process: " + ", ".join(f"{k} {v}" for k, v in noted.items()))
        if self.counters.get("frees_at_thread_exit"):
            out.append(f"note: {self.counters['frees_at_thread_exit']} frees at thread exit "
                       "are glibc's (tcache_thread_shutdown frees the blocks a thread's "
                       "cache held, and the cache itself): not counted as unmatched")
        if self.counters.get("frees_before_attach"):
            out.append(f"note: {self.counters['frees_before_attach']} frees of blocks "
                       "allocated before the capture attached: not counted as unmatched")
        if self.counters.get("allocations_before_exec"):
            out.append(f"note: {self.counters['allocations_before_exec']} allocations of "
                       "forked children before their exec (their parent's program, e.g. a "
                       "shell's, between fork and exec): ended by the exec, in no "
                       "process's figures")
        out.extend(f"note: {n}" for n in self.notes)
        out.extend(f"warning: {w}" for w in self.warnings)
        return out

    def add(self, counters: dict[str, int]) -> None:
        for k, v in counters.items():
            self.counters[k] = self.counters.get(k, 0) + int(v)

    def warn(self, problems: list[str]) -> None:
        self.warnings.extend(p for p in dict.fromkeys(problems) if p not in self.warnings)


# Process counters worth a line in the summary when not zero (the rest are in meta).
NOTABLE = (
    "events_bad_kind", "frees_unmatched", "allocations_reused_without_free",
    "decode_mismatch", "events_stack_missing", "symbolize_missing_rows",
    "stacks_duplicate_hash", "region_ends_unmatched", "regions_duplicate_id",
    "regions_unnamed", "python_code_missing", "python_native_missing",
    "python_runs_unplaced",
)  # fmt: skip


class Stages:
    """Runs the stages one after another, each once (progress.STAGES), times them,
    takes their counters and problems into the summary (`took`) and tells `sink` (None:
    nobody) where they are."""

    def __init__(self, summary: Summary, sink: ProgressSink | None) -> None:
        self.summary, self.sink = summary, sink

    @contextmanager
    def stage(self, name: str) -> Iterator[Advance]:
        """A stage: what it yields tells how far the stage is."""
        sink = self.sink
        if sink is not None:
            sink.start(name)

        def advance(done: int, total: int | None = None, **counts: int) -> None:
            if sink is not None:
                sink.advance(name, done, total, counts)

        t0 = time.perf_counter()
        yield advance
        # what the stage freed goes back to the system, not to the next stage's pool
        pa.default_memory_pool().release_unused()
        self.summary.timings[name] = seconds = time.perf_counter() - t0
        if sink is not None:
            sink.finish(name, seconds)

    def run(self, name: str, fn: Callable[[], R]) -> R:
        with self.stage(name):
            return self.took(fn())

    def took(self, result: R) -> R:
        """A stage's result, its counters and problems now the summary's."""
        self.summary.add(result.counters)
        self.summary.warn(result.problems)
        return result


def process(
    artifact_path: Path | str,
    out_db: Path | str,
    *,
    parquet_dir: Path | str | None = None,
    host_modules: bool | None = None,
    cache_dir: Path | str | None = None,
    progress: bool | ProgressSink | None = None,
    piece_bytes: int | None = None,
    labels: dict[str, str] | None = None,
    jobs: int | None = None,
    python_frames: bool = True,
    accept_damaged: bool = False,
) -> Summary:
    """Process an artifact into a run database. Raises ArtifactError for a bad artifact.

    host_modules: where the artifact lacks a module, use the host file at its mapped path
    when its build id matches (ModuleStore); None: only for a run captured on this host
    in this boot, else not, with a note saying so (host_modules_for).
    cache_dir: the symbol and CFI caches (per module), None for none.
    progress: where the stages are (memtrack.process.progress): True draws it on stderr
    (TerminalProgress), None only when stderr is a terminal, False nowhere; or a sink.
    piece_bytes: rebuilt stack bytes decoded and unwound at a time (None: decode's
    DEFAULT_MAX_BYTES); the output does not depend on it, the peak memory does.
    labels: what the user says of the run (`--label commit=...`), kept in meta.
    jobs: processes that decode and unwind stack records, and DuckDB's threads (None:
    the machine's cores); the output does not depend on it either.
    python_frames: False leaves the Python frames out (the native stacks only).
    accept_damaged: read a damaged table of a complete artifact up to the damage
    (Artifact.accept_damaged).
    """
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ProcessError(f"--jobs must be at least 1, not {jobs}")
    artifact_path, out_db = Path(artifact_path), Path(out_db)
    if not out_db.parent.is_dir():
        raise ProcessError(f"{out_db.parent}: no such directory for the run database")
    if out_db.is_dir():
        raise ProcessError(f"{out_db}: is a directory, not a run database path")
    summary = Summary(artifact_path, out_db)
    if progress is None:
        progress = sys.stderr.isatty()
    shown = TerminalProgress() if progress is True else None
    st = Stages(summary, shown or (progress if not isinstance(progress, bool) else None))
    with shown or nullcontext():
        art = Artifact.open(artifact_path, accept_damaged=accept_damaged)
        host_modules, note = host_modules_for(art.manifest.host, host_modules)
        summary.notes += [note] if note else []
        db = RunDatabase(out_db, jobs)
        spill = EventSpill(db.tmp.with_name(db.tmp.name + ".spill"),
                           buckets_for(_events_estimate(art)))
        try:
            _process(art, db, spill, summary, st, host_modules=host_modules,
                     cache=Path(cache_dir) if cache_dir else None, piece_bytes=piece_bytes,
                     labels=labels, jobs=jobs, python_frames=python_frames,
                     parquet_dir=Path(parquet_dir) if parquet_dir else None)
        except BaseException:
            db.abandon()
            raise
        finally:
            spill.remove()
    return summary


def _events_estimate(art: Artifact) -> int:
    """About how many events the artifact holds, from the size of events.arrow
    (compressed, 3-10 bytes an event): it only sizes pair's buckets."""
    try:
        return art.file(table_file("events")).stat().st_size // 3
    except (FileNotFoundError, ArtifactError):
        return 0


def _process(art: Artifact, db: RunDatabase, spill: EventSpill, summary: Summary,
             st: Stages, *, host_modules: bool, cache: Path | None, piece_bytes: int | None,
             labels: dict[str, str] | None, jobs: int, python_frames: bool,
             parquet_dir: Path | None) -> None:
    """The stages, in the order that holds the least at a time: the events go to the
    spill as they are read; the stacks are unwound, symbolized and loaded before pair
    (the workers never share the machine with pair's tables); pair reads the spill's
    buckets; the events go from the spill into the database last."""
    m = art.manifest
    artifact_path = art.path
    summary.losses = dict(m.losses)
    with st.stage("read") as progress:
        tables = st.took(read_artifact(art, spill, db.con, progress))
    summary.events = spill.n
    end_ns = m.end_ns or spill.last_ts
    lifecycle = st.run("lifecycle", lambda: of_artifact(tables, m, spill.others.first_seen))
    res = st.run("rss", lambda: resident(tables, m, lifecycle))
    spans = st.run("regions", lambda: regions(tables.events, tables.region_names, end_ns,
                                              tables.region_labels))

    store = ModuleStore(artifact_path, host_modules=host_modules)
    spaces = inherited_mappings(tables.mappings, lifecycle.forks,
                                tables.stacks.index.column("pid").to_numpy())
    work = st.took(unwind_records(tables.stacks, spaces, artifact_path, host_modules, store,
                                  piece_bytes or DEFAULT_MAX_BYTES, jobs, st.stage, cache))
    unwound = work.unwound
    with st.stage("pyframes"):
        merged = st.took(merge_python(tables.py_stacks, tables.py_codes, unwound.stacks,
                                      unwound.stack_frames, store, python=python_frames))
    unwound = UnwoundStacks(pa.concat_tables([unwound.stacks, merged.stacks]),
                            pa.concat_tables([unwound.stack_frames, merged.stack_frames]))
    summary.stacks = unwound.stacks.num_rows
    modules = modules_table(tables.mappings, unwound.stack_frames, store, artifact_path)
    with st.stage("symbolize") as progress:
        known = db.stacks(unwound.stacks, unwound.stack_frames, modules)
        del unwound, work
        symbolized = st.took(symbolize_locations(store, known, cache))
        progress(known.num_rows, known.num_rows or None, locations=known.num_rows)
        loaded = st.took(db.frames(known, symbolized.frames, merged.locations))
    del known, symbolized, merged
    # the events go into the database beside pair, and pair's rows as it hands them
    # over, each on a connection of its own (DuckDB's threads and numpy's share the
    # cores; pair reads the buckets, the events' copy the artifact)
    with ThreadPoolExecutor(1) as aside, st.stage("pair") as progress:
        copied = aside.submit(db.events, spilled_events(art, spill), aside=True)
        rows = Aside(db)
        try:
            paired = st.took(pair_spilled(
                spill, lifecycle, m.end_ns or None, partial(rows.insert, "allocations"),
                partial(rows.insert, "heap_timeline"), progress,
                [a["pid"] for a in m.attached]))
        finally:
            rows.close()
            copied.result()
    summary.allocations = paired.counters["allocations"]
    with st.stage("load"):
        spill.remove()
        db.processes(lifecycle)
        db.table("mappings", tables.mappings)
        db.table("rss", res.rss)
        db.table("regions", spans.regions)
        db.table("region_labels", spans.labels)
        db.table("stops", tables.stops)
        summary.counters["events_stack_missing"] = db.missing_stacks()
        summary.warnings = [*art.warnings, *summary.warnings,
                            *(p for p in store.problems if p not in summary.warnings)]
        db.meta(meta_rows(
            artifact=str(artifact_path.resolve()),
            artifact_format=m.format_version,
            reader_format=FORMAT_VERSION,
            memtrack_version=m.memtrack_version,
            command=m.command,
            root_pid=m.root_pid,
            attached=m.attached,
            start_ns=m.start_ns,
            end_ns=end_ns,
            wall_offset_ns=m.clock.wall_offset_ns,
            exit_status=m.exit_status.__dict__,
            host=m.host.__dict__,
            losses=summary.losses,
            counters=summary.counters,
            options=m.options,
            warnings=summary.warnings,
            capture_warnings=m.warnings,
            probes_refused=probes_refused(m.probes),
            labels=labels or {},
            allocator_functions=allocator_functions(m.probes),
        ))
        summary.rows = db.finish(parquet_dir)
    summary.frames_by_method = loaded.frames_by_method
    summary.unknown_frames = loaded.unknown_frames
    with st.stage("metadata"):  # a file beside the database: no tables, nothing counted
        summary.metadata = metadata.write(metadata.build(art.path, m, lifecycle, res),
                                          metadata.path_for(summary.out_db))


def allocator_functions(probes: Any) -> list[str]:
    """The names of the functions capture probed, raw and demangled: the reports tell
    allocator frames from their callers by them (schema.ddl.ALLOCATOR_NAMES)."""
    from memtrack.symbolize.demangle import demangle

    if not isinstance(probes, list):
        return []
    names = {p["function"] for p in probes if isinstance(p, dict)
             and isinstance(p.get("function"), str) and p["function"]}
    return sorted(names | {demangle(n) for n in names})


def probes_refused(probes: Any) -> list[dict[str, str]]:
    """The functions capture could not probe ({path, function, why}, sorted): a gap in
    what the run saw, compared by `diff` (the same gap on both sides, or not)."""
    if not isinstance(probes, list):
        return []
    return sorted(({"path": str(p.get("path", "")), "function": str(p.get("function", "")),
                    "why": str(p["refused"])} for p in probes
                   if isinstance(p, dict) and p.get("refused")),
                  key=lambda r: (r["path"], r["function"]))


def modules_table(mappings: pa.Table, stack_frames: pa.Table, store: ModuleStore,
                  artifact_path: Path) -> pa.Table:
    """One row per build id mapped or met while unwinding (a few hundred at most)."""
    seen: dict[str, str] = {}
    for tbl in (mappings, stack_frames):
        for bid, path in module_paths(tbl).items():
            seen.setdefault(bid, path or "")
    art_dir = artifact_path.resolve()
    rows: dict[str, list[Any]] = {k: [] for k in MODULES.names}
    for i, (bid, path) in enumerate(sorted(seen.items())):
        mod = store.get(bid, path)
        rows["module_id"].append(i)
        rows["build_id"].append(bid)
        rows["path"].append(path)
        rows["elf_path"].append(str(mod.elf_path) if mod else None)
        rows["has_debuginfo"].append(bool(mod and mod.dwarf_path is not None))
        rows["in_artifact"].append(bool(mod and art_dir in Path(mod.elf_path).resolve().parents))
    return pa.table(rows, schema=MODULES)


@dataclass
class Symbolized(StageResult):
    frames: pa.Table  # SYMBOLIZED_FRAMES


def symbolize_locations(store: ModuleStore, known: pa.Table, cache_dir: Path | None
                        ) -> Symbolized:
    """Symbolize the code locations (frame_id, build_id, vaddr, path) of a run, with what
    the symbolizer found wrong (a cache it cannot write, DWARF it cannot read) as the
    problems and its counters as `symbolize_*`."""
    if known.num_rows == 0:
        return Symbolized(SYMBOLIZED_FRAMES.empty_table())
    from memtrack.symbolize import Symbolizer

    s = Symbolizer(store, cache_dir)
    try:
        frames = s.symbolize(known.column("build_id").combine_chunks(),
                             known.column("vaddr").to_numpy(),
                             known.column("path").combine_chunks())
    finally:
        s.close()  # writes the cache: its failure is a problem too
    return Symbolized(frames, counters={f"symbolize_{k}": v for k, v in s.counters.items()},
                      problems=list(s.problems))


def artifact_mappings(art: Artifact, pids: np.ndarray) -> pa.Table:
    """An artifact's snapshots and the inherited ones of its forked children among
    `pids`, from the lifecycle stage as `process` runs it (`memtrack unwind` on one
    record): read reads the events into a sink that keeps the lifecycle's (and each
    pid's first time), and of the other tables the lifecycle's alone."""
    sink = OtherEvents()
    tables = read_artifact(art, sink, only=LIFECYCLE_TABLES)
    lifecycle = of_artifact(tables, art.manifest, sink.first_seen)
    return inherited_mappings(tables.mappings, lifecycle.forks, pids)
