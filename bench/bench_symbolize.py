"""Symbolization speed on libc with libc6-dbg's debug file: cold (DWARF parsed) and warm
(per-build-id cache) time per address next to llvm-symbolizer on the same addresses,
plus pyelftools parsing the same units, and where the cold time goes.

Run: .venv/bin/python bench/bench_symbolize.py [N_ADDRESSES] (default 2000)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from elftools.elf.elffile import ELFFile

from memtrack.addrspace.modules import ModuleStore
from memtrack.dwarf.lines import Dwarf
from memtrack.elf import ElfImage
from memtrack.symbolize import Symbolizer

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
REPEAT = 3


def text_addresses(path: Path, n: int) -> np.ndarray:
    img = ElfImage(path)
    t = img.sections[".text"]
    img.close()
    rng = np.random.default_rng(1)
    return np.sort(rng.integers(t["sh_addr"], t["sh_addr"] + t["sh_size"], n, dtype=np.uint64))


def ours(addrs: np.ndarray, cache: Path) -> float:
    store = ModuleStore(None)
    bid = store.add_file(LIBC).build_id
    t0 = time.perf_counter()
    s = Symbolizer(store, cache)
    s.symbolize(pa.array([bid] * len(addrs)), addrs)
    s.close()
    return time.perf_counter() - t0


def llvm(addrs: np.ndarray) -> float:
    exe = shutil.which("llvm-symbolizer")
    if exe is None:
        sys.exit("llvm-symbolizer is missing (apt install llvm)")
    inp = "".join(f"{a:#x}\n" for a in addrs.tolist())
    t0 = time.perf_counter()
    subprocess.run([exe, "--inlines", f"--obj={LIBC}"], input=inp, capture_output=True,
                   text=True, check=True)
    return time.perf_counter() - t0


def units_of(dw: Dwarf, addrs: np.ndarray) -> list[int]:
    lo, hi, off = dw.cu_index()
    i = np.searchsorted(lo, addrs, side="right") - 1
    ok = (i >= 0) & (addrs < hi[np.maximum(i, 0)])
    return sorted(set(off[i[ok]].tolist()))


def phases(debug: Path, addrs: np.ndarray) -> tuple[dict[str, float], list[int]]:
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    img = ElfImage(debug)
    secs = img.dwarf_sections()
    out["open + inflate sections"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dw = Dwarf(secs, ElfImage(LIBC).exec_ranges())
    units = units_of(dw, addrs)
    out["unit headers + aranges"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for off in units:
        u = dw.unit_at(off)
        assert u is not None
        dw._line_table(u)
    out["line programs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    nodes = [dw._frame_nodes(dw.unit_at(off)) for off in units]  # type: ignore[arg-type]
    out["DIE walk (frames)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for ns in nodes:
        for n in ns:
            dw.die_name(n[0])
    out["names (origins/specifications)"] = time.perf_counter() - t0
    img.close()
    return out, units


def pyelftools_units(debug: Path, units: list[int]) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    with open(debug, "rb") as f:
        dwarf = ELFFile(f).get_dwarf_info()
        dies = rows = 0
        for off in units:
            cu = dwarf.get_CU_at(off)
            dies += sum(1 for _ in cu.iter_DIEs())
            lp = dwarf.line_program_for_CU(cu)
            rows += len(lp.get_entries()) if lp is not None else 0
    return time.perf_counter() - t0, dies, rows


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    addrs = text_addresses(LIBC, n)
    debug = ModuleStore(None).add_file(LIBC).debug_path
    if debug is None:
        sys.exit("libc6-dbg's debug file is missing (scripts/setup installs it)")
    # best of REPEAT: the machine is shared, the minimum is the least disturbed run
    colds, warms = [], []
    for _ in range(REPEAT):
        with tempfile.TemporaryDirectory() as tmp:
            colds.append(ours(addrs, Path(tmp)))
            warms.append(ours(addrs, Path(tmp)))
    cold, warm = min(colds), min(warms)
    ref = min(llvm(addrs) for _ in range(REPEAT))
    ref_one = min(llvm(addrs[:1]) for _ in range(REPEAT))
    ph, units = phases(debug, addrs)
    pet, dies, rows = pyelftools_units(debug, units)
    us = 1e6 / n
    print(f"libc.so.6 + libc6-dbg, {n} random .text addresses, {len(units)} compilation units"
          f" (best of {REPEAT})")
    print(f"  llvm-symbolizer    {ref * us:8.1f} us/address  (1.00; one address alone: "
          f"{ref_one * 1e3:.0f} ms)")
    print(f"  memtrack cold      {cold * us:8.1f} us/address  ({cold / ref:.2f}x llvm)")
    print(f"  memtrack warm      {warm * us:8.1f} us/address  ({warm / ref:.2f}x llvm, "
          f"{cold / warm:.1f}x faster than cold)")
    print(f"  pyelftools, same units: {pet:.2f} s for {dies} DIEs + {rows} line rows "
          f"({pet / cold:.1f}x memtrack cold)")
    print("  cold time by phase:")
    for k, v in ph.items():
        print(f"    {k:32s} {v:6.2f} s")


if __name__ == "__main__":
    main()
