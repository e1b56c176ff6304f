"""What the unwinder knows of each module, extracted once into flat rows before any
step needs it: the compact CFI table (memtrack.dwarf.cfi), the addresses where the
kernel's signal-return sequence starts (a trampoline without CFI, musl's __restore_rt)
and the module's entry code when no CFI covers it (ld.so's `_start`/`_dl_start_user`,
which calls the libraries' constructors; a `_start` built without CFI): the outermost
frame of a process's first thread, where the stack is complete.

Extraction reads the module's files; it happens the first time a frame lands in the
module, between two depths of the walk, never inside a step. The rows are cached per
module under CACHE_DIR/cfi/ (one .npz per module, named by Module.cache_key: its build
id and a hash of its files' bytes), with `process --cache-dir`'s directory, none with
`--cache off`. An entry that does not load is rebuilt; one that cannot be written is a
warning, and the rows are still used.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memtrack.addrspace.modules import Module
from memtrack.dwarf.cfi import CFITable, build_table
from memtrack.elf import ElfImage, ElfReadError

CACHE_VERSION = 5  # bump when the rows extracted from the same files change
SIGRETURN_CODE = bytes.fromhex("48c7c00f0000000f05")  # mov $15, %rax; syscall


@dataclass
class ModuleRows:
    cfi: CFITable
    signal_pcs: np.ndarray  # uint64, sorted: vaddrs where SIGRETURN_CODE starts
    entry: np.ndarray  # uint64 [start, end): the entry code no CFI covers (may be empty)

    def is_entry(self, vaddr: np.ndarray) -> np.ndarray:
        """Which virtual addresses lie in the module's entry code without CFI."""
        v = np.asarray(vaddr, dtype=np.uint64)
        return (v >= self.entry[0]) & (v < self.entry[1])

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


def entry_code(elf_path: Path, cfi: CFITable) -> tuple[np.ndarray, list[str]]:
    """[e_entry, the next CFI row or the end of its section) where no CFI covers the
    entry point (the ELF header's; none when it is 0, as in most shared libraries)."""
    empty = np.zeros(2, np.uint64)
    try:
        with ElfImage(elf_path) as img:
            entry = int(img.elf["e_entry"])
            ranges = img.exec_ranges()
    except ElfReadError as e:
        return empty, [str(e)]
    section = [hi for lo, hi in ranges if lo <= entry < hi]
    if not entry or not section or cfi.lookup(np.array([entry], np.uint64))[0] >= 0:
        return empty, []
    later = cfi.pc[cfi.pc > np.uint64(entry)]
    end = min(int(later[0]), section[0]) if len(later) else section[0]
    return np.array([entry, end], np.uint64), []


_memo: dict[str, ModuleRows] = {}  # by Module.cache_key


def extract(module: Module, cache: Path | None = None) -> ModuleRows:
    """The rows of a module, from memory, the on-disk cache under `cache` (None: no disk
    cache) or its files."""
    key = module.cache_key
    if key is not None and key in _memo:
        return _memo[key]
    cfile = cache / f"{key}.v{CACHE_VERSION}.npz" if cache is not None and key else None
    if cfile is not None and cfile.is_file():
        try:
            with np.load(cfile, allow_pickle=False) as z:
                rows = ModuleRows(CFITable.from_arrays(z), z["signal_pcs"], z["entry"])
            _memo[key] = rows  # type: ignore[index]
            return rows
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            cfile.unlink(missing_ok=True)
    table = build_table(module.elf_path, module.debug_path)
    pcs, problems = signal_pcs(module.elf_path)
    entry, more = entry_code(module.elf_path, table)
    table.problems += problems + [p for p in more if p not in problems]
    rows = ModuleRows(table, pcs, entry)
    if key is not None:
        _memo[key] = rows
    if cfile is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=".cfi.", suffix=".npz")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, signal_pcs=pcs, entry=entry, **table.arrays())
            os.replace(tmp, cfile)
        except OSError as e:
            table.problems.append(f"{cache}: cannot write the unwind cache "
                                  f"({e.strerror or e}); unwinding goes on without it")
    return rows
