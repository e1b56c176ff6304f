"""The unwind stage: decoded stack records -> stacks and their physical frames.

Per process, an address space of mapped modules (memtrack.addrspace.normalize) with
one unwind table built per module once (memtrack.process.unwind.tables: its CFI,
frame-pointer, signal-return and entry-code rows), a small DWARF expression evaluator
for the rare rows that need one, pc - 1 lookups for every frame but the first and the
one after a signal frame, the frame-pointer fallback where CFI is missing (frame 0 from
its prologue rows), and a per-frame record of which method produced it
(memtrack.process.unwind.walk). Each distinct stack hash is unwound once: the first
record of it (`first_records`); the same bytes recorded again, by a forked child or
after the in-kernel dedupe forgot them, unwind the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.addrspace.modules import ModuleStore
from memtrack.addrspace.normalize import Normalizer
from memtrack.dwarf.cfi import CFITable
from memtrack.process.unwind.tables import extract
from memtrack.process.unwind.walk import METHODS, STOPS, Walk
from memtrack.schema.stages import UNWOUND_STACK_FRAMES, UNWOUND_STACKS

__all__ = ["METHODS", "STOPS", "Unwinder", "UnwoundStacks", "first_records", "module_paths",
           "unwind"]


@dataclass
class UnwoundStacks:
    stacks: pa.Table  # UNWOUND_STACKS: one row per distinct stack hash
    stack_frames: pa.Table  # UNWOUND_STACK_FRAMES, by stack and depth
    counters: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # modules that could not be used


def module_paths(table: pa.Table) -> dict[str, str | None]:
    """Each build id of a table of frames or mappings (build_id, path; strings or
    dictionaries), with the path of its first row, in the order first met."""
    bids = table.column("build_id").combine_chunks()
    if not pa.types.is_dictionary(bids.type):
        bids = bids.dictionary_encode()
    codes = bids.indices.fill_null(-1).to_numpy()
    ok = np.flatnonzero(codes >= 0)
    rows = pa.array(np.sort(ok[np.unique(codes[ok], return_index=True)[1]]))
    names = bids.dictionary.take(bids.indices.take(rows)).to_pylist()
    paths = table.column("path").take(rows).cast(pa.string()).to_pylist()
    return dict(zip(names, paths, strict=True))


def first_records(records: pa.Table, seen: np.ndarray | None = None
                  ) -> tuple[pa.Table, np.ndarray]:
    """The first record of each stack hash not in `seen` (sorted hashes), in table order,
    and the hashes seen now."""
    h = records.column("stack_hash").to_numpy().astype(np.uint64)
    _, first = np.unique(h, return_index=True)
    keep = np.zeros(len(h), dtype=bool)
    keep[first] = True
    if seen is not None and len(seen):
        keep &= ~np.isin(h, seen)
    out = records if keep.all() else records.filter(pa.array(keep))
    return out, np.union1d(seen if seen is not None else np.zeros(0, np.uint64), h)


MAX_DEPTH = 512  # frames a stack is walked to at most (stop max-depth beyond)


class Unwinder:
    """Unwinds batches of decoded stack records against one artifact's mappings: each
    stack hash once, in the first batch that holds it, and the module tables built
    for one batch serve the next (`memtrack process` goes run by run)."""

    def __init__(self, mappings: pa.Table, store: ModuleStore, max_depth: int = MAX_DEPTH,
                 cache_dir: Path | None = None) -> None:
        self.normalizer = Normalizer(mappings, store)
        self.max_depth = max_depth
        self.cache_dir = cache_dir / "cfi" if cache_dir is not None else None
        self.tables: dict[int, CFITable | None] = {}
        self.seen = np.zeros(0, np.uint64)  # sorted stack hashes unwound so far

    def _extract(self, modules: np.ndarray) -> None:
        """The unwind tables of the module indices not built yet (reads their files)."""
        for m in np.unique(modules[modules >= 0]).tolist():
            if m not in self.tables:
                mod = self.normalizer.modules[m]
                self.tables[m] = extract(mod, self.cache_dir) if mod is not None else None

    @property
    def problems(self) -> list[str]:
        out = list(self.normalizer.problems)
        for t in self.tables.values():
            if t is not None:
                out.extend(p for p in t.problems if p not in out)
        return out

    def unwind(self, records: pa.Table) -> UnwoundStacks:
        """Unwind the first record of each stack hash of `records` (DECODED_RECORDS) not
        unwound by an earlier call."""
        records, self.seen = first_records(records, self.seen)
        if records.num_rows == 0:
            return UnwoundStacks(UNWOUND_STACKS.empty_table(),
                                 UNWOUND_STACK_FRAMES.empty_table(), {}, self.problems)
        walk = Walk(records, self.normalizer, self.tables, self._extract, self.max_depth)
        walk.run()
        stacks, frames = walk.result()
        return UnwoundStacks(stacks, frames, walk.counters, self.problems)


def unwind(records: pa.Table, mappings: pa.Table, store: ModuleStore,
           max_depth: int = MAX_DEPTH, cache_dir: Path | None = None) -> UnwoundStacks:
    """Unwind every distinct stack hash of a decoded stack-record table
    (DECODED_RECORDS: stack_hash, pid, ts, sp, regs in DWARF order, the stack bytes from
    sp upward, fp_chain) against the artifact's mapping snapshots. cache_dir: where the
    CFI rows are cached (its cfi/), None for no disk cache."""
    return Unwinder(mappings, store, max_depth, cache_dir).unwind(records)
