"""Python frames: name the interpreter frames of py_stacks.arrow and merge them into the
native stacks they extend.

A Python stack record (capture/pyframes.py) names a native stack (`native_hash`) and a
chain of (code key, instruction index, entered from C) innermost first. Each frame is
named from its code record: the qualified name (3.10: the function's name), the file,
and the line its instruction falls in (the code object's line table: the location table
of CPython 3.11 to 3.13, 3.10's table of PEP 626). The chain splits into runs, each
ending at a frame entered from C: the frames one call of `_PyEval_EvalFrameDefault`
executed (3.10: every frame is one). In the merged stack each run replaces the evaluation
frame that ran it, innermost first, so that a C extension called from Python shows its
native frames above the Python ones. Python frames have method `python`; their
locations are (code key, line) pairs, keyed apart from native ones (no module, no
reason) and named in `frames` from `python_locations`.

Vectorized over frames (numpy, Arrow); one Python step per distinct (code object,
instruction) pair, to read its line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.addrspace.modules import ModuleStore
from memtrack.process.lookup import find_sorted, key_bounds, unique_pairs
from memtrack.process.stage import StageResult
from memtrack.process.unwind import module_paths
from memtrack.schema.stackrecord import ragged
from memtrack.schema.stages import UNWOUND_STACK_FRAMES, UNWOUND_STACKS

EVAL_FRAME = "_PyEval_EvalFrameDefault"
PEP626 = 0x030A  # py_codes.python_version whose line tables are 3.10's (PEP 626)

# python locations (-> the names of `frames` whose method is python)
PYTHON_LOCATIONS = pa.schema([
    ("key", pa.uint64()),  # stack_frames.lookup_vaddr of the frames at this location
    ("function", pa.string()),  # co_qualname
    ("file", pa.string()),  # co_filename
    ("line", pa.uint32()),  # 0 when the instruction has no line
])


@dataclass
class Merged(StageResult):
    stacks: pa.Table  # UNWOUND_STACKS rows of the Python stack hashes
    stack_frames: pa.Table  # UNWOUND_STACK_FRAMES rows of them
    locations: pa.Table  # PYTHON_LOCATIONS


def _varint(data: bytes, i: int) -> tuple[int, int]:
    b = data[i]
    i += 1
    val, shift = b & 63, 6
    while b & 64:
        b = data[i]
        i += 1
        val |= (b & 63) << shift
        shift += 6
    return val, i


def line_ranges(linetable: bytes, first_line: int, version: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """A code object's line table as (end code unit of each entry, its line; 0 for no
    line), in the format of its interpreter's `version` (py_codes.python_version: 3.10's,
    PEP626, or else the location table of 3.11 to 3.13, Objects/locations.md). A table
    cut short yields the entries it holds."""
    if version == PEP626:
        return pep626_ranges(linetable, first_line)
    ends: list[int] = []
    lines: list[int] = []
    line, unit, i = first_line, 0, 0
    try:
        while i < len(linetable):
            b = linetable[i]
            i += 1
            if not b & 0x80:
                break
            code, length = (b >> 3) & 15, (b & 7) + 1
            known = True
            if code == 15:
                known = False
            elif code == 14:
                delta, i = _varint(linetable, i)
                line += -(delta >> 1) if delta & 1 else delta >> 1
                for _ in range(3):
                    _, i = _varint(linetable, i)
            elif code == 13:
                delta, i = _varint(linetable, i)
                line += -(delta >> 1) if delta & 1 else delta >> 1
            elif code >= 10:
                line += code - 10
                i += 2
            else:
                i += 1
            unit += length
            ends.append(unit)
            lines.append(line if known else 0)
    except IndexError:
        pass
    return np.array(ends, np.int64), np.array(lines, np.int64)


def pep626_ranges(linetable: bytes, first_line: int) -> tuple[np.ndarray, np.ndarray]:
    """CPython 3.10's line table (PEP 626; Objects/lnotab_notes.txt and codeobject.c's
    advance() in 3.10) as line_ranges gives it: byte pairs, each an address range of its
    own: its length in bytes of code (unsigned; 2 bytes a code unit) and its line's
    change from the one before (signed; -128: the range has no line, the next change
    counts from the last line)."""
    pairs = np.frombuffer(linetable, np.uint8)[:len(linetable) // 2 * 2].reshape(-1, 2)
    ends = np.cumsum(pairs[:, 0].astype(np.int64)) // 2
    delta = pairs[:, 1].astype(np.int8).astype(np.int64)
    none = delta == -128
    lines = first_line + np.cumsum(np.where(none, 0, delta))
    return ends, np.where(none, 0, lines)


def trampolines(codes: pa.Table) -> np.ndarray:
    """Per code record: whether no instruction of it has a line (its whole location table,
    as read, holds no-location entries only, whose bytes are 0xf8-0xff, or nothing).
    Compiled Python always has one (RESUME at its first line); CPython's own trampoline
    code objects (3.13's _Py_InitCleanup: table b'\\xfb') do not. A table BPF could not
    read (empty, though its size is not) is not a trampoline's, nor is any of 3.10 (its
    table is not a location table; it has no trampolines)."""
    table = codes.column("linetable").cast(pa.large_binary()).combine_chunks()
    if len(table) == 0:
        return np.zeros(0, bool)
    _, offs, data = table.buffers()
    offsets = np.frombuffer(offs, np.int64)[table.offset:table.offset + len(table) + 1]
    values = np.frombuffer(data or b"", np.uint8)[offsets[0]:offsets[-1]]
    located = np.concatenate([[0], np.cumsum(values < 0xF8)])
    whole = np.diff(offsets) == codes.column("linetable_size").to_numpy()
    whole &= codes.column("python_version").to_numpy() != PEP626
    return whole & (located[offsets[1:] - offsets[0]] == located[offsets[:-1] - offsets[0]])


def eval_ranges(store: ModuleStore, frames: pa.Table) -> dict[str, tuple[int, int]]:
    """build id -> (vaddr, size) of _PyEval_EvalFrameDefault, for the modules of these
    frames that define it."""
    from memtrack.elf.image import ElfImage, ElfReadError

    out: dict[str, tuple[int, int]] = {}
    for bid, path in module_paths(frames).items():
        mod = store.get(bid, path or "")
        if mod is None:
            continue
        try:
            with ElfImage(mod.elf_path) as img:
                found = img.functions({EVAL_FRAME}).get(EVAL_FRAME)
        except (ElfReadError, OSError):
            continue
        if found is not None:
            out[bid] = found
    return out


def _lines(keys: np.ndarray, instrs: np.ndarray, codes: pa.Table) -> np.ndarray:
    """The line of each (code key, instruction index); 0 where the code record is
    missing or the instruction has no line. One step per distinct pair."""
    ckeys = codes.column("key").to_numpy()
    tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    pkeys, pinstrs, inverse = unique_pairs(keys, instrs)
    out = np.zeros(len(pkeys), np.int64)
    for i, (key, instr) in enumerate(zip(pkeys.tolist(), pinstrs.tolist(), strict=True)):
        j = int(np.searchsorted(ckeys, key))
        if j >= len(ckeys) or ckeys[j] != key:
            continue
        first = codes.column("first_line")[j].as_py()
        version = codes.column("python_version")[j].as_py()
        if instr == 0xFFFFFFFF and version == PEP626:
            out[i] = first  # a frame that has not started: 3.10's f_lineno says its first line
            continue
        if key not in tables:
            tables[key] = line_ranges(codes.column("linetable")[j].as_py(), first, version)
        ends, lines = tables[key]
        unit = 0 if instr == 0xFFFFFFFF else instr  # a frame that has not started
        k = int(np.searchsorted(ends, unit, side="right"))
        out[i] = lines[k] if k < len(lines) else 0
    return out[inverse]


def merge(py_stacks: pa.Table, py_codes: pa.Table, stacks: pa.Table, stack_frames: pa.Table,
          store: ModuleStore, *, python: bool = True) -> Merged:
    """The stacks of the Python stack hashes: each native stack with its evaluation
    frames replaced by the Python runs they executed (`python` False: the native stack
    alone, under the Python stack hash the events carry). Vectorized over every frame."""
    counters = {"python_stacks": 0, "python_frames": 0, "python_code_missing": 0,
                "python_native_missing": 0, "python_runs_unplaced": 0,
                "python_trampolines": 0}
    if py_stacks.num_rows == 0:
        return Merged(UNWOUND_STACKS.empty_table(), UNWOUND_STACK_FRAMES.empty_table(),
                      PYTHON_LOCATIONS.empty_table(), counters=counters)
    # the first record of each hash; the first code record of each key, sorted by key
    _, first = np.unique(py_stacks.column("hash").to_numpy(), return_index=True)
    recs = py_stacks.take(np.sort(first))
    _, cfirst = np.unique(py_codes.column("key").to_numpy(), return_index=True)
    codes = py_codes.take(cfirst)
    nrec = recs.num_rows
    rhash = recs.column("hash").to_numpy()
    rnative = recs.column("native_hash").to_numpy()
    code_key = recs.column("code_key").combine_chunks()
    flen = np.diff(code_key.offsets.to_numpy()).astype(np.int64)
    fkey = code_key.values.to_numpy()
    finstr = recs.column("instr").combine_chunks().values.to_numpy()
    fentry = recs.column("entry").combine_chunks().values.to_numpy(zero_copy_only=False)
    frow = np.repeat(np.arange(nrec), flen)
    fstart = np.concatenate([[0], np.cumsum(flen)])[:-1]
    # trampolines (no line anywhere in them: 3.13's _Py_InitCleanup, between a specialized
    # class call and its __init__) are dropped; were one a run's first frame, the frame
    # inside it would begin the run
    tramp = np.isin(fkey, codes.column("key").to_numpy()[trampolines(codes)])
    if tramp.any():
        counters["python_trampolines"] = int(tramp.sum())
        heir = np.flatnonzero(tramp & fentry)
        fentry = fentry.copy()
        fentry[heir[heir > fstart[frow[heir]]] - 1] = True
        fkey, finstr, fentry, frow = fkey[~tramp], finstr[~tramp], fentry[~tramp], frow[~tramp]
        flen = np.bincount(frow, minlength=nrec).astype(np.int64)
        fstart = np.concatenate([[0], np.cumsum(flen)])[:-1]
    # run of each frame: the frames entered from C before it in its record
    before = np.cumsum(fentry) - fentry
    frun = before - before[np.minimum(fstart, len(before) - 1)][frow] if len(frow) else before
    nruns = np.zeros(nrec, np.int64)
    if len(frow):
        nruns[:] = np.where(flen > 0, frun[np.maximum(fstart + flen - 1, 0)] + 1, 0)
    if not python:
        nruns[:] = 0

    # native frames in (hash, depth) order; the evaluation frames among them, ranked
    sf = stack_frames.sort_by([("stack_hash", "ascending"), ("depth", "ascending")])
    sf_hash = sf.column("stack_hash").to_numpy()
    is_eval = np.zeros(sf.num_rows, bool)
    if python:
        bids = sf.column("build_id")
        look = sf.column("lookup_vaddr").fill_null(0).to_numpy()
        for bid, (start, size) in eval_ranges(store, sf).items():
            mine = pc.fill_null(pc.equal(bids, bid), False).to_numpy(zero_copy_only=False)
            is_eval |= mine & (look >= start) & (look < start + size)
    eval_idx = np.flatnonzero(is_eval)
    lo, hi = key_bounds(sf_hash, rnative)
    elo, ehi = key_bounds(sf_hash[eval_idx], rnative)
    nevals = ehi - elo
    ecum = np.cumsum(is_eval) - is_eval  # evaluation frames before each row, over all rows
    st_hash = stacks.column("stack_hash").to_numpy()
    st_order = np.argsort(st_hash, kind="stable")
    si, found = find_sorted(st_hash[st_order], rnative)
    native_row = st_order[si] if len(st_hash) else si  # each record's native stack
    counters["python_native_missing"] = int((~found).sum())
    # a Python cut's native stack ends at the allocator's caller by design: its runs go
    # outermost, none is unplaced
    st_stop = stacks.column("stop").to_numpy(zero_copy_only=False)
    cut = found & (st_stop[native_row] == "python") if len(st_hash) else found

    # native rows, repeated per record; an evaluation frame whose run exists is dropped
    nlen = hi - lo
    nrow = np.repeat(np.arange(nrec), nlen)
    nidx = ragged(lo, nlen)
    rank = ecum[nidx] - ecum[lo][nrow] if len(nidx) else nidx
    keep = ~(is_eval[nidx] & (rank < nruns[nrow]))
    nrow, nidx = nrow[keep], nidx[keep]
    ndepth = sf.column("depth").to_numpy().astype(np.int64)[nidx]
    # Python frames, at the depth of the evaluation frame of their run (outermost when
    # no evaluation frame is left for it)
    placed = frun < nevals[frow]
    pyf = np.flatnonzero(frun < nruns[frow])
    at = np.where(placed[pyf], eval_idx[np.minimum(elo[frow[pyf]] + frun[pyf],
                                                   max(len(eval_idx) - 1, 0))]
                  if len(eval_idx) else 0, 0)
    big = np.iinfo(np.int64).max // 4
    pdepth = np.where(placed[pyf], sf.column("depth").to_numpy().astype(np.int64)[at]
                      if sf.num_rows else 0, big)
    lost = ~placed[pyf] & ~cut[frow[pyf]]
    counters["python_runs_unplaced"] = int(len(np.unique(
        np.stack([frow[pyf][lost], frun[pyf][lost]]), axis=1)[0])) if lost.any() else 0
    prow = frow[pyf]
    rows = np.concatenate([nrow, prow])
    dkey = np.concatenate([ndepth, pdepth])
    sub = np.concatenate([np.zeros(len(nrow), np.int64), 1 + pyf - fstart[prow]])
    order = np.lexsort((sub, dkey, rows))
    rows = rows[order]
    is_py = order >= len(nrow)
    src = np.where(is_py, 0, np.concatenate([nidx, np.zeros(len(pyf), np.int64)])[order])
    pysel = np.where(is_py, order - len(nrow), 0)
    counts = np.bincount(rows, minlength=nrec)
    depth = np.arange(len(rows)) - np.repeat(np.concatenate([[0], np.cumsum(counts)])[:-1],
                                              counts)

    # Python locations: (code key, line), keyed apart from native locations
    lines = _lines(fkey[pyf], finstr[pyf], codes) if len(pyf) else np.zeros(0, np.int64)
    ckeys = codes.column("key").to_numpy()
    ci, have = find_sorted(ckeys, fkey[pyf])
    counters["python_code_missing"] = int((~have).sum())
    loc_key, loc_line, loc_of = unique_pairs(np.where(have, fkey[pyf], 0), lines)
    lci, lhave = find_sorted(ckeys, loc_key)
    mask = pa.array(~lhave)
    locations = pa.table({
        "key": pa.array(np.arange(len(loc_key), dtype=np.uint64)),
        "function": pc.if_else(mask, "[unknown python code]",
                               codes.column("qualname").take(pa.array(lci)) if len(ckeys)
                               else pa.nulls(len(loc_key), pa.string())),
        "file": pc.if_else(mask, pa.scalar(None, pa.string()),
                           codes.column("filename").take(pa.array(lci)) if len(ckeys)
                           else pa.nulls(len(loc_key), pa.string())),
        "line": pa.array(loc_line.astype(np.uint32)),
    }, schema=PYTHON_LOCATIONS)
    caddr = codes.column("address").to_numpy()[ci] if len(ckeys) else np.zeros(len(pyf))
    caddr = np.where(have, caddr, 0).astype(np.uint64)

    def native(col: str) -> pa.Array:
        return sf.column(col).take(pa.array(src, mask=is_py)) if sf.num_rows else \
            pa.nulls(len(rows), sf.schema.field(col).type)

    frames = pa.table({
        "stack_hash": pa.array(rhash[rows], pa.uint64()),
        "pid": recs.column("pid").take(pa.array(rows)),
        "depth": pa.array(depth.astype(np.uint16)),
        "address": pa.array(np.where(is_py, caddr[pysel] if len(pyf) else 0,
                                     sf.column("address").to_numpy()[src] if sf.num_rows
                                     else 0).astype(np.uint64)),
        "method": pc.if_else(pa.array(is_py), "python", native("method")),
        "build_id": native("build_id"),
        "path": native("path"),
        "lookup_vaddr": pc.if_else(pa.array(is_py),
                                   pa.array(loc_of[pysel].astype(np.uint64)) if len(pyf)
                                   else pa.nulls(len(rows), pa.uint64()),
                                   native("lookup_vaddr")),
        "reason": native("reason"),
    }, schema=UNWOUND_STACK_FRAMES)
    base = stacks.take(pa.array(native_row, mask=~found)) if len(st_hash) else None

    def of_native(col: str, default: object) -> pa.Array:
        if base is None:
            return pa.array([default] * nrec, UNWOUND_STACKS.field(col).type)
        return base.column(col).fill_null(default)

    out_stacks = pa.table({
        "stack_hash": pa.array(rhash, pa.uint64()),
        "pid": recs.column("pid"),
        "depth": pa.array(counts.astype(np.uint16)),
        "truncated": of_native("truncated", False),
        "complete": of_native("complete", False),
        "stop": of_native("stop", "no-mapping"),
    }, schema=UNWOUND_STACKS)
    counters["python_stacks"] = nrec
    counters["python_frames"] = int(is_py.sum())
    return Merged(out_stacks, frames, locations, counters=counters)


def native_hashes(py_stacks: pa.Table, hashes: np.ndarray) -> np.ndarray:
    """The native stack hash of each stack hash an event carries: a Python stack's
    `native_hash`, any other hash itself."""
    h = np.asarray(hashes, dtype=np.uint64)
    keys = py_stacks.column("hash").to_numpy()
    if len(keys) == 0:
        return h
    order = np.argsort(keys, kind="stable")
    keys, natives = keys[order], py_stacks.column("native_hash").to_numpy()[order]
    i, hit = find_sorted(keys, h)
    return np.where(hit, natives[i], h)
