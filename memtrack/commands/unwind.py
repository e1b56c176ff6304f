"""`memtrack unwind ARTIFACT --record HASH`: one stack record unwound and symbolized,
each frame with how it was found (regs, cfi, fp, fp-kernel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.compute as pc

from memtrack.addrspace.modules import ModuleStore, host_modules_for
from memtrack.commands import CommandError
from memtrack.process.decode import decode_pieces
from memtrack.process.pipeline import artifact_mappings
from memtrack.process.unwind import unwind
from memtrack.schema.artifact import Artifact, ArtifactError
from memtrack.symbolize import default_cache_dir, symbolize_frames


def find_record(art: Artifact, stack_hash: int) -> pa.Table | None:
    """The decoded records of one stack hash, decoding piece by piece (a record needs its
    thread's chain back to a keyframe, not the whole artifact at once)."""
    want = pa.scalar(stack_hash, pa.uint64())
    for piece in decode_pieces(art):
        rows = piece.table.filter(pc.equal(piece.table.column("stack_hash"), want))
        if rows.num_rows:
            return rows
    return None


def run(artifact: Path, record: str, host_modules: bool | None, out: TextIO,
        accept_damaged: bool = False, say: TextIO | None = None) -> int:
    try:
        return show_record(artifact, record, out, host_modules=host_modules,
                           accept_damaged=accept_damaged, say=say)
    except (ArtifactError, ValueError) as e:
        raise CommandError(f"unwind: {e}") from None


def parse_hash(text: str) -> int:
    """A stack hash as users type it: 0x-prefixed or bare hex, or decimal digits."""
    t = text.strip().lower()
    try:
        value = int(t, 16) if t.startswith("0x") or any(c in "abcdef" for c in t) else int(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a stack hash (hex or decimal)") from None
    if not 0 < value < 1 << 64:
        raise ValueError(f"{text!r} is not a stack hash (1 .. 2^64-1)")
    return value


def show_record(artifact_path: Path, record: str, out: TextIO, *,
                host_modules: bool | None = False, accept_damaged: bool = False,
                say: TextIO | None = None) -> int:
    """Print one stack record's frames with how each was found and its symbol (inline
    frames indented). Returns the exit status. `host_modules` None: as for `process`
    (host_modules_for), its note to `say`."""
    want = parse_hash(record)
    art = Artifact.open(artifact_path, accept_damaged=accept_damaged)
    rows = find_record(art, want)
    if rows is None:
        raise ValueError(f"no stack record with hash {want:#x} in {artifact_path}")
    host_modules, note = host_modules_for(art.manifest.host, host_modules)
    if note and say is not None:  # once the artifact is read: an error is one line
        say.write(f"note: {note}\n")
    store = ModuleStore(artifact_path, host_modules=host_modules)
    res = unwind(rows, artifact_mappings(art, rows.column("pid").to_numpy()), store,
                 cache_dir=default_cache_dir())
    frames = res.stack_frames
    sym = symbolize_frames(store, frames)
    levels: dict[int, list[dict[str, Any]]] = {}
    for r in sym.to_pylist():
        levels.setdefault(r["row"], []).append(r)
    for s in res.stacks.to_pylist():
        state = "complete" if s["complete"] else f"incomplete: {s['stop']}"
        out.write(f"stack {s['stack_hash']:#018x} pid {s['pid']}: {s['depth']} frames "
                  f"({state})\n")
        for i, f in enumerate(frames.to_pylist()):
            if f["stack_hash"] != s["stack_hash"] or f["pid"] != s["pid"]:
                continue
            module = Path(f["path"]).name if f["path"] else "?"
            syms = levels.get(i, []) if f["lookup_vaddr"] is not None else []
            if not syms:
                out.write(f"  #{f['depth']:<3} {f['address']:#018x} {f['method']:<9} ?  "
                          f"[{module}]\n")
                continue
            for k, r in enumerate(syms):  # innermost first, like gdb
                name = r["function"] or f"[unknown: {r['reason']}]"
                off = f"+{r['offset']:#x}" if r["offset"] and k == len(syms) - 1 else ""
                where = f"  {r['file']}:{r['line']}" if r["file"] else ""
                inl = "  (inlined)" if k < len(syms) - 1 else ""
                head = (f"#{f['depth']:<3} {f['address']:#018x} {f['method']:<9}" if k == 0
                        else " " * 33)
                out.write(f"  {head} {name}{off}{where}{inl}  [{module}]\n")
    for p in res.problems:
        out.write(f"note: {p}\n")
    return 0
