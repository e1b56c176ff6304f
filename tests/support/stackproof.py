"""The proof that stack records are exact: an artifact captured with `--stack-copies`
holds every capture's raw copy beside the records; unwinding each raw copy on its own
must give the frames of the record its hash names (address and method, depth by depth,
and whether the stack is complete)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.addrspace.modules import ModuleStore
from memtrack.process.decode import decode
from memtrack.process.unwind import unwind
from memtrack.schema.artifact import Artifact
from memtrack.schema.stages import DECODED_RECORDS

Frames = tuple[tuple[int, str], ...]


@dataclass
class Proof:
    copies: int  # captures compared
    records: int  # records they refer to
    mismatches: list[tuple[int, Frames, Frames]] = field(default_factory=list)
    # (record hash, the record's frames, the copy's frames) of each copy that differs
    incomplete_mismatches: int = 0  # copies whose `complete` differs from their record's


def _frames_by_stack(res: pa.Table) -> dict[tuple[int, int], Frames]:
    t = res.sort_by([("stack_hash", "ascending"), ("pid", "ascending"),
                     ("depth", "ascending")])
    out: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for h, pid, addr, method in zip(t.column("stack_hash").to_pylist(),
                                    t.column("pid").to_pylist(),
                                    t.column("address").to_pylist(),
                                    t.column("method").to_pylist(), strict=True):
        out.setdefault((h, pid), []).append((addr, method))
    return {k: tuple(v) for k, v in out.items()}


def prove(path: Path) -> Proof:
    """Compare every raw copy's unwinding with its record's."""
    art = Artifact.open(path)
    copies = art.read("stack_copies").table
    mappings = art.read("mappings").table
    store = ModuleStore(path)
    decoded = decode(art)
    assert decoded.counters["decode_mismatch"] == 0, decoded.counters
    rec = unwind(decoded.table, mappings, store)
    rec_frames = _frames_by_stack(rec.stack_frames)
    rec_complete = dict(zip(zip(rec.stacks.column("stack_hash").to_pylist(),
                                rec.stacks.column("pid").to_pylist(), strict=True),
                            rec.stacks.column("complete").to_pylist(), strict=True))
    n = copies.num_rows
    # each copy unwound on its own: a hash of its own (its row), so none is deduplicated;
    # laid out as decoded records
    own = copies.set_column(0, "stack_hash", pa.array(np.arange(1, n + 1, dtype=np.uint64)))
    own = own.rename_columns([{"truncated": "copy_truncated"}.get(c, c)
                              for c in own.column_names]).select(DECODED_RECORDS.names)
    mine = unwind(own, mappings, store)
    own_frames = _frames_by_stack(mine.stack_frames)
    own_complete = dict(zip(mine.stacks.column("stack_hash").to_pylist(),
                            mine.stacks.column("complete").to_pylist(), strict=True))
    proof = Proof(copies=n, records=len(rec_frames))
    for i, (h, pid) in enumerate(zip(copies.column("hash").to_pylist(),
                                     copies.column("pid").to_pylist(), strict=True)):
        want = rec_frames.get((h, pid), ())
        got = own_frames.get((i + 1, pid), ())
        if got != want:
            proof.mismatches.append((h, want, got))
        if own_complete.get(i + 1) != rec_complete.get((h, pid)):
            proof.incomplete_mismatches += 1
    return proof
