"""What the unwinder knows of each module, extracted once into flat rows before any
step needs it: the compact CFI table (memtrack.dwarf.cfi) and the addresses where the
kernel's signal-return sequence starts (a trampoline without CFI, musl's __restore_rt).

Extraction reads the module's files; it happens the first time a frame lands in the
module, between two depths of the walk, never inside a step. The rows are cached per
build id under $XDG_CACHE_HOME/memtrack/cfi/ (one .npz per module).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memtrack.dwarf.cfi import CFITable, build_table
from memtrack.elf import ElfImage, ElfReadError
from memtrack.symbolize.cache import default_cache_dir
from memtrack.symbolize.modules import Module

CACHE_VERSION = 3  # bump when the rows extracted from the same files change
SIGRETURN_CODE = bytes.fromhex("48c7c00f0000000f05")  # mov $15, %rax; syscall


@dataclass
class ModuleRows:
    cfi: CFITable
    signal_pcs: np.ndarray  # uint64, sorted: vaddrs where SIGRETURN_CODE starts

    def is_signal(self, vaddr: np.ndarray) -> np.ndarray:
        """Which virtual addresses start a signal-return sequence."""
        v = np.asarray(vaddr, dtype=np.uint64)
        i = np.minimum(np.searchsorted(self.signal_pcs, v), max(len(self.signal_pcs) - 1, 0))
        return (self.signal_pcs[i] == v) if len(self.signal_pcs) else np.zeros(len(v), bool)


def signal_pcs(elf_path: Path) -> tuple[np.ndarray, list[str]]:
    """Every address of the module's executable segments where SIGRETURN_CODE starts."""
    found: list[int] = []
    try:
        with ElfImage(elf_path) as img:
            for vaddr, data in img.executable_bytes():
                p = data.find(SIGRETURN_CODE)
                while p >= 0:
                    found.append(vaddr + p)
                    p = data.find(SIGRETURN_CODE, p + 1)
    except ElfReadError as e:
        return np.zeros(0, np.uint64), [str(e)]
    return np.array(sorted(found), dtype=np.uint64), []


def cache_dir() -> Path:
    """cfi/ under the symbolizer's cache directory ($XDG_CACHE_HOME/memtrack)."""
    return default_cache_dir() / "cfi"


_memo: dict[str, ModuleRows] = {}


def extract(module: Module, cache: Path | None = None) -> ModuleRows:
    """The rows of a module, from memory, the on-disk cache (by build id) or its files."""
    bid = module.build_id
    if bid in _memo:
        return _memo[bid]
    cdir = cache or cache_dir()
    cfile = cdir / f"{bid}.v{CACHE_VERSION}.npz" if bid else None
    if cfile is not None and cfile.is_file():
        try:
            with np.load(cfile, allow_pickle=False) as z:
                rows = ModuleRows(CFITable.from_arrays(z), z["signal_pcs"])
            _memo[bid] = rows
            return rows
        except (OSError, ValueError, KeyError):
            cfile.unlink(missing_ok=True)
    table = build_table(module.elf_path, module.debug_path)
    pcs, problems = signal_pcs(module.elf_path)
    table.problems += problems
    rows = ModuleRows(table, pcs)
    if cfile is not None:
        _memo[bid] = rows
        try:
            cdir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cdir, prefix=".cfi.", suffix=".npz")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, signal_pcs=pcs, **table.arrays())
            os.replace(tmp, cfile)
        except OSError as e:
            table.problems.append(f"{cdir}: cannot write the unwind cache ({e.strerror or e})")
    return rows
