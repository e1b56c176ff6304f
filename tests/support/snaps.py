"""Test support for the unwinder: run fixture programs that snapshot their own stack
(fixtures/unwind/snap.c), turn the records into decode-shaped stack tables and mapping
snapshots, and name the unwound frames through the symbolizer."""

from __future__ import annotations

import functools
import os
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from conftest import build

from memtrack.addrspace.modules import ModuleStore
from memtrack.elf import read_build_id
from memtrack.process.unwind import UnwoundStacks, unwind
from memtrack.schema import MAPPINGS, NUM_REGS
from memtrack.schema.stages import DECODED_RECORDS
from memtrack.symbolize import symbolize_frames
from support.stackrecords import regions_kept

VARIANTS = {
    "O0": ("-O0",),
    "O2": ("-O2",),
    "O2-omit-fp": ("-O2", "-fomit-frame-pointer"),
    "O2-fp": ("-O2", "-fno-omit-frame-pointer"),
}


def snap_lib() -> Path:
    return build(["unwind/snap.c"], shared=True, flags=("-O2", "-g"), libs=("-lpthread",),
                 name="libmtsnap")


def build_fixture(sources: list[str], flags: tuple[str, ...], name: str,
                  libs: tuple[str, ...] = (), shared: bool = False, debug: bool = True) -> Path:
    inc = str(Path(__file__).resolve().parent.parent / "fixtures" / "unwind")
    return build(sources, flags=(*flags, "-g" if debug else "-g0", f"-I{inc}"),
                 libs=(str(snap_lib()), *libs), name=name, shared=shared)


@dataclass
class Snaps:
    stacks: pa.Table
    mappings: pa.Table
    sizes: list[int]


@functools.cache
def _build_id(path: str) -> str | None:
    return read_build_id(path)


def parse_maps(text: str, pid: int, ts: int) -> list[dict[str, object]]:
    rows = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        path = parts[5].strip() if len(parts) > 5 else ""
        bid = _build_id(path) if path.startswith("/") and os.path.isfile(path) else None
        rows.append({"ts": ts, "pid": pid, "start": start, "end": end,
                     "offset": int(parts[2], 16), "perms": parts[1], "dev": parts[3],
                     "inode": int(parts[4]), "path": path, "build_id": bid})
    return rows


def read_snaps(path: Path) -> Snaps:
    data = path.read_bytes()
    p = 0
    cols: dict[str, list[object]] = {f.name: [] for f in DECODED_RECORDS}
    maps: list[dict[str, object]] = []
    sizes = []
    while p < len(data):
        magic, version, pid, tid = struct.unpack_from("<4I", data, p)
        assert magic == 0x4E53544D and version == 1
        ts, size, sp, lens = struct.unpack_from("<4Q", data, p + 16)
        copy_len, truncated = lens & 0xFFFFFFFF, lens >> 32
        p += 48
        regs = list(struct.unpack_from(f"<{NUM_REGS}Q", data, p))
        p += 8 * NUM_REGS
        n_fp, maps_len = struct.unpack_from("<2I", data, p)
        p += 8
        fp = list(struct.unpack_from(f"<{n_fp}Q", data, p))
        p += 8 * n_fp
        stack = data[p:p + copy_len]
        p += copy_len
        text = data[p:p + maps_len].decode()
        p += maps_len
        for k, v in (("stack_hash", len(sizes) + 1), ("pid", pid), ("tid", tid), ("ts", ts),
                     ("sp", sp), ("copy_len", copy_len), ("copy_truncated", bool(truncated)),
                     ("regs", regs), ("stack", stack), ("fp_chain", fp),
                     ("python_cut", False)):
            cols[k].append(v)
        maps += parse_maps(text, pid, ts)
        sizes.append(size)
    return Snaps(pa.table(cols, schema=DECODED_RECORDS),
                 pa.Table.from_pylist(maps, schema=MAPPINGS), sizes)


def snaps_kept(snaps: Snaps) -> Callable[[int], bool]:
    """The kept-region test the kernel would have applied to the snapshots: their
    executable mappings, and around each sp the regions a capture marks (below sp's,
    sp's, the copy end's)."""
    starts = [a for r in snaps.mappings.to_pylist() if "x" in r["perms"]
              for a in range(r["start"], r["end"], 1 << 16)]
    for sp, n in zip(snaps.stacks.column("sp").to_pylist(),
                     snaps.stacks.column("copy_len").to_pylist(), strict=True):
        starts += [sp - (1 << 16), sp, sp + n - 1]
    return regions_kept(*starts)


def run_snaps(cmd: list[str], tmp: Path, env: dict[str, str] | None = None,
              budget: int = 8192) -> Snaps:
    out = tmp / f"snaps-{len(list(tmp.glob('snaps-*')))}.bin"
    e = dict(os.environ, MT_SNAP_OUT=str(out), MT_SNAP_BUDGET=str(budget), **(env or {}))
    subprocess.run(cmd, check=True, env=e, timeout=60, capture_output=True)
    return read_snaps(out)


@dataclass
class Named:
    """One unwound stack with frame names (innermost first)."""

    names: list[str]  # the function holding each frame's address ('?' when unknown)
    inlines: list[list[str]]  # each frame's functions, innermost inline level first
    methods: list[str]
    addresses: list[int]
    lookups: list[int | None]
    truncated: bool
    complete: bool
    stop: str


def unwind_named(snaps: Snaps, store: ModuleStore | None = None
                 ) -> tuple[list[Named], UnwoundStacks]:
    """Unwind, then name every frame through the symbolizer."""
    store = store or ModuleStore(None, host_modules=True)
    res = unwind(snaps.stacks, snaps.mappings, store)
    frames = res.stack_frames
    sym = symbolize_frames(store, frames)
    levels: dict[int, list[str]] = {}
    for r in sym.select(["row", "function"]).to_pylist():
        levels.setdefault(r["row"], []).append(r["function"] or "?")
    out: dict[int, Named] = {}
    for s in res.stacks.to_pylist():
        out[s["stack_hash"]] = Named([], [], [], [], [], s["truncated"], s["complete"],
                                     s["stop"])
    for i, f in enumerate(frames.to_pylist()):
        n = out[f["stack_hash"]]
        fns = levels.get(i, ["?"]) if f["lookup_vaddr"] is not None else ["?"]
        n.names.append(fns[-1])
        n.inlines.append(fns)
        n.methods.append(f["method"])
        n.addresses.append(f["address"])
        n.lookups.append(f["lookup_vaddr"])
    return [out[h] for h in snaps.stacks.column("stack_hash").to_pylist()], res
