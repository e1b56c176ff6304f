"""Decode and unwind the stack records in pieces, on `jobs` worker processes.

Each stack hash is unwound once, from its first record (in file order) that decodes and
verifies. The records of a hash that occurs once need no choice; those of the hashes
recorded more than once (a forked child, the kernel's dedupe map forgetting) are decoded
first only to learn which verify (`decode`), so that the rest of the work splits into
pieces that need nothing from each other (`unwind`: decode, then walk). A piece holds at
most `piece_bytes` of rebuilt copies; with more than one job, pieces are also cut so that
every job gets one (never below MIN_PIECE records, never above MAX_PIECE). The pieces
are read from the artifact as the jobs take them (memtrack.process.decode.StackRecords):
what this process holds of the records is their index and a few pieces, whatever the
stack bytes add up to. Which records
are unwound, and so every table, does not depend on the pieces or the jobs: each stack
is walked alone, and the load stage orders stacks by hash and frames by stack and depth.

Workers are spawned (not forked: the parent holds Arrow's and DuckDB's threads); each
builds its own Unwinder from the mappings and module store, and reads the per-build-id
CFI rows from the unwind cache that the first to need them writes.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.addrspace.modules import ModuleStore
from memtrack.process.decode import StackRecords, decode_pieces, decode_table, piece_ends
from memtrack.process.lookup import unique_pairs
from memtrack.process.progress import Advance, no_progress
from memtrack.process.stage import StageResult
from memtrack.process.unwind import Unwinder, UnwoundStacks
from memtrack.schema.stages import UNWOUND_STACK_FRAMES, UNWOUND_STACKS

MIN_PIECE = 2000  # records: below this a worker's start-up costs more than it saves
MAX_PIECE = 16384  # records: what a worker holds (its copies, frames) stays bounded


def default_jobs() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) or 1


@dataclass
class StackWork(StageResult):
    unwound: UnwoundStacks  # problems: sorted, each once


def choose_records(records: StackRecords, piece_bytes: int,
                   progress: Advance = no_progress) -> tuple[np.ndarray, dict[str, int]]:
    """The records to unwind (positions in `records`, file order): every record whose
    hash occurs once, and the first verified record of each hash that occurs more often
    (those are decoded, `progress` told after each piece). Counts the repeated hashes'
    records that did not verify, and `stacks_duplicate_hash` (the same bytes recorded by
    more than one process: one stack, the first's)."""
    counters = {"decode_mismatch": 0, "decode_bad_payload": 0, "stacks_duplicate_hash": 0}
    h = records.index.column("hash").to_numpy()
    uniq, counts = np.unique(h, return_counts=True)
    repeated = counts[np.searchsorted(uniq, h)] > 1
    if not repeated.any():
        return np.arange(h.size), counters
    rows = np.flatnonzero(repeated)
    verified = []
    start = 0
    for piece in decode_pieces(records, piece_bytes, rows):
        verified.append(rows[start + piece.kept])
        start += piece.counters["stack_records"]
        counters["decode_mismatch"] += piece.counters["decode_mismatch"]
        counters["decode_bad_payload"] += piece.counters["decode_bad_payload"]
        progress(start, rows.size, records=start)
    ok = np.concatenate(verified)
    _, first = np.unique(h[ok], return_index=True)
    keep = ~repeated
    keep[ok[first]] = True
    pid = records.index.column("pid").to_numpy()
    pairs = len(unique_pairs(h[ok], pid[ok])[0])
    counters["stacks_duplicate_hash"] = pairs - len(first)
    return np.flatnonzero(keep), counters


def piece_size(n: int, jobs: int) -> int | None:
    """The most records of a piece: with jobs > 1 a job's share of the `n` records (never
    below MIN_PIECE, never above MAX_PIECE), so that every job gets one."""
    return min(max(MIN_PIECE, -(-n // jobs)), MAX_PIECE) if jobs > 1 else None


Piece = tuple[pa.Table, pa.Table, dict[str, int], list[str]]
_unwinder: Unwinder | None = None  # a worker's


def _start_worker(mappings: pa.Table, artifact: Path, host_modules: bool,
                  cache_dir: Path | None) -> None:
    global _unwinder
    _unwinder = Unwinder(mappings, ModuleStore(artifact, host_modules=host_modules),
                         cache_dir=cache_dir)


def _piece(records: pa.Table, unwinder: Unwinder | None = None) -> Piece:
    """Decode and unwind one piece (in a worker: with the worker's unwinder)."""
    u = unwinder or _unwinder
    assert u is not None
    decoded = decode_table(records)
    del records
    counters = {k: v for k, v in decoded.counters.items() if k != "stack_records"}
    out = u.unwind(decoded.table)
    del decoded
    counters.update({k: counters.get(k, 0) + v for k, v in out.counters.items()})
    return out.stacks, out.stack_frames, counters, u.problems


def unwind_records(records: StackRecords, mappings: pa.Table, artifact: Path,
                   host_modules: bool, store: ModuleStore, piece_bytes: int, jobs: int,
                   stage: Callable[[str], AbstractContextManager[Advance]],
                   cache_dir: Path | None = None) -> StackWork:
    """Stacks and stack frames of every stack hash of `records` (the artifact's), on
    `jobs` processes (1: in this one), with the CFI cache under `cache_dir` (None: none).
    `stage(name)` runs "decode" (choosing records) then "unwind" (decoding and unwinding
    the pieces, read from the records one at a time as the jobs take them: no more than
    two per job are held at once)."""
    counters: dict[str, int] = {"stack_records": records.num_rows}
    with stage("decode") as progress:
        chosen, picked = choose_records(records, piece_bytes, progress)
    counters.update(picked)
    copy_len = records.index.column("copy_len").to_numpy()[chosen]
    ends = piece_ends(copy_len, piece_bytes, piece_size(chosen.size, jobs)) \
        if chosen.size else []
    results: list[Piece] = []
    with stage("unwind") as progress:
        def done(result: Piece) -> None:
            results.append(result)
            progress(len(results), len(ends), records=ends[len(results) - 1],
                     stacks=sum(r[0].num_rows for r in results))

        parts = records.read(chosen, ends)
        if jobs <= 1 or len(ends) <= 1:
            unwinder = Unwinder(mappings, store, cache_dir=cache_dir) if ends else None
            for part in parts:
                done(_piece(part, unwinder))
        else:
            with ProcessPoolExecutor(
                    max_workers=min(jobs, len(ends)), mp_context=multiprocessing.get_context(
                        "spawn"), initializer=_start_worker,
                    initargs=(mappings, artifact, host_modules, cache_dir)) as pool:
                running: deque[Future[Piece]] = deque()
                try:
                    for part in parts:
                        running.append(pool.submit(_piece, part))
                        del part
                        if len(running) > 2 * jobs:
                            done(running.popleft().result())
                    while running:
                        done(running.popleft().result())
                except BaseException:
                    pool.shutdown(cancel_futures=True)  # the pieces not started, dropped
                    raise
    problems: set[str] = set()
    for _, _, c, p in results:
        for k, v in c.items():
            counters[k] = counters.get(k, 0) + v
        problems.update(p)
    if not results:
        return StackWork(UnwoundStacks(UNWOUND_STACKS.empty_table(),
                                       UNWOUND_STACK_FRAMES.empty_table()), counters=counters)
    return StackWork(UnwoundStacks(pa.concat_tables([r[0] for r in results]),
                                   pa.concat_tables([r[1] for r in results])),
                     counters=counters, problems=sorted(problems))
