"""Python frames: name the interpreter frames of py_stacks.arrow and merge them into the
native stacks they extend.

A Python stack record (capture/pyframes.py) names a native stack (`native_hash`) and a
chain of (code key, instruction index, entered from C) innermost first. Each frame is
named from its code record: the qualified name, the file, and the line its instruction
falls in (the code object's line table, CPython 3.11's location table). The chain splits
into runs, each ending at a frame entered from C: the frames one call of
`_PyEval_EvalFrameDefault` executed. In the merged stack each run replaces the evaluation
frame that ran it, innermost first, so that a C extension called from Python shows its
native frames above the Python ones. Python frames have method `python`; their
locations are (code key, line) pairs, keyed apart from native ones (no module, no
reason) and named in `frames` from `python_locations`.

One Python step per distinct Python stack record and per code object (a few thousand),
none per event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from memtrack.schema.stages import UNWOUND_STACK_FRAMES, UNWOUND_STACKS
from memtrack.symbolize.modules import ModuleStore

EVAL_FRAME = "_PyEval_EvalFrameDefault"

# python locations (-> the names of `frames` whose method is python)
PYTHON_LOCATIONS = pa.schema([
    ("key", pa.uint64()),  # stack_frames.lookup_vaddr of the frames at this location
    ("function", pa.string()),  # co_qualname
    ("file", pa.string()),  # co_filename
    ("line", pa.uint32()),  # 0 when the instruction has no line
])


@dataclass
class Merged:
    stacks: pa.Table  # UNWOUND_STACKS rows of the Python stack hashes
    stack_frames: pa.Table  # UNWOUND_STACK_FRAMES rows of them
    locations: pa.Table  # PYTHON_LOCATIONS
    counters: dict[str, int] = field(default_factory=dict)


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


def line_ranges(linetable: bytes, first_line: int) -> tuple[np.ndarray, np.ndarray]:
    """CPython 3.11's location table (Objects/locations.md) as (end code unit of each
    entry, its line; 0 for no location). A table cut short yields the entries it holds."""
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


def eval_ranges(store: ModuleStore, frames: pa.Table) -> dict[str, tuple[int, int]]:
    """build id -> (vaddr, size) of _PyEval_EvalFrameDefault, for the modules of these
    frames that define it."""
    from memtrack.elf.image import ElfImage, ElfReadError

    out: dict[str, tuple[int, int]] = {}
    pairs = frames.select(["build_id", "path"]).drop_null().group_by(
        ["build_id"], use_threads=False).aggregate([("path", "first")])
    for bid, path in zip(pairs.column("build_id").to_pylist(),
                         pairs.column("path_first").to_pylist(), strict=True):
        mod = store.get(bid, path)
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


def merge(py_stacks: pa.Table, py_codes: pa.Table, stacks: pa.Table, stack_frames: pa.Table,
          store: ModuleStore, *, python: bool = True) -> Merged:
    """The stacks of the Python stack hashes: each native stack with its evaluation
    frames replaced by the Python runs they executed (`python` False: the native stack
    alone, under the Python stack hash the events carry)."""
    counters = {"python_stacks": 0, "python_frames": 0, "python_code_missing": 0,
                "python_native_missing": 0, "python_runs_unplaced": 0}
    if py_stacks.num_rows == 0:
        return Merged(UNWOUND_STACKS.empty_table(), UNWOUND_STACK_FRAMES.empty_table(),
                      PYTHON_LOCATIONS.empty_table(), counters)
    # the first record of each hash
    _, first = np.unique(py_stacks.column("hash").to_numpy(), return_index=True)
    recs = py_stacks.take(np.sort(first)).to_pylist()
    codes: dict[int, dict] = {}
    for c in py_codes.to_pylist():
        codes.setdefault(c["key"], c)
    tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # native frames by stack hash, in depth order
    sf = stack_frames.sort_by([("stack_hash", "ascending"), ("depth", "ascending")])
    sf_hash = sf.column("stack_hash").to_numpy()
    evals = eval_ranges(store, sf) if python else {}
    is_eval = np.zeros(sf.num_rows, bool)
    bids = sf.column("build_id").to_pylist() if evals else []
    look = sf.column("lookup_vaddr").fill_null(0).to_numpy() if evals else None
    for bid, (start, size) in evals.items():
        mine = np.array([b == bid for b in bids], bool)
        is_eval |= mine & (look >= start) & (look < start + size)
    st_hash = stacks.column("stack_hash").to_numpy()
    st_rows = stacks.to_pylist()
    st_index = {int(h): i for i, h in enumerate(st_hash)}
    sf_cols = {k: sf.column(k).to_pylist() for k in UNWOUND_STACK_FRAMES.names}

    loc_ids: dict[tuple[int, int], int] = {}
    locs: dict[str, list] = {k: [] for k in PYTHON_LOCATIONS.names}
    out_st: dict[str, list] = {k: [] for k in UNWOUND_STACKS.names}
    out_sf: dict[str, list] = {k: [] for k in UNWOUND_STACK_FRAMES.names}

    def location(key: int, instr: int) -> int:
        code = codes.get(key)
        line = 0
        if code is not None:
            if key not in tables:
                tables[key] = line_ranges(code["linetable"], code["first_line"])
            ends, lines = tables[key]
            unit = 0 if instr == 0xFFFFFFFF else instr  # a frame that has not started
            j = int(np.searchsorted(ends, unit, side="right"))
            line = int(lines[j]) if j < len(lines) else 0
        else:
            counters["python_code_missing"] += 1
        k = (key, line)
        if k not in loc_ids:
            loc_ids[k] = len(loc_ids)
            locs["key"].append(len(loc_ids) - 1)
            locs["function"].append(code["qualname"] if code else "[unknown python code]")
            locs["file"].append(code["filename"] if code else None)
            locs["line"].append(line)
        return loc_ids[k]

    for rec in recs:
        native = int(rec["native_hash"])
        lo = int(np.searchsorted(sf_hash, native, side="left"))
        hi = int(np.searchsorted(sf_hash, native, side="right"))
        si = st_index.get(native)
        if si is None:
            counters["python_native_missing"] += 1
        # the Python runs, innermost first: each ends at a frame entered from C
        runs: list[list[tuple[int, int]]] = [[]]
        for key, instr, entry in zip(rec["code_key"], rec["instr"], rec["entry"], strict=True):
            runs[-1].append((int(key), int(instr)))
            if entry:
                runs.append([])
        runs = [r for r in runs if r]
        rows: list[tuple[str, int, int | None, str | None, str | None, int | None,
                         str | None]] = []
        run = 0
        for j in range(lo, hi):
            if python and is_eval[j] and run < len(runs):
                for key, instr in runs[run]:
                    code = codes.get(key)
                    rows.append(("python", code["address"] if code else 0, None, None, None,
                                 location(key, instr), None))
                run += 1
                continue
            rows.append((sf_cols["method"][j], sf_cols["address"][j], None,
                         sf_cols["build_id"][j], sf_cols["path"][j],
                         sf_cols["lookup_vaddr"][j], sf_cols["reason"][j]))
        if python and run < len(runs):
            # more runs than evaluation frames (the native stack stopped short): the
            # rest go outermost, in order
            counters["python_runs_unplaced"] += len(runs) - run
            for r in runs[run:]:
                for key, instr in r:
                    code = codes.get(key)
                    rows.append(("python", code["address"] if code else 0, None, None, None,
                                 location(key, instr), None))
        h = int(rec["hash"])
        for d, (method, address, _, bid, path, lv, reason) in enumerate(rows):
            out_sf["stack_hash"].append(h)
            out_sf["pid"].append(rec["pid"])
            out_sf["depth"].append(d)
            out_sf["address"].append(address)
            out_sf["method"].append(method)
            out_sf["build_id"].append(bid)
            out_sf["path"].append(path)
            out_sf["lookup_vaddr"].append(lv)
            out_sf["reason"].append(reason)
            counters["python_frames"] += method == "python"
        base = st_rows[si] if si is not None else {
            "truncated": False, "complete": False, "stop": "no-mapping"}
        out_st["stack_hash"].append(h)
        out_st["pid"].append(rec["pid"])
        out_st["depth"].append(len(rows))
        out_st["truncated"].append(base["truncated"])
        out_st["complete"].append(base["complete"])
        out_st["stop"].append(base["stop"])
        counters["python_stacks"] += 1
    return Merged(pa.table(out_st, schema=UNWOUND_STACKS),
                  pa.table(out_sf, schema=UNWOUND_STACK_FRAMES),
                  pa.table(locs, schema=PYTHON_LOCATIONS), counters)
