"""ELF symbol tables as sorted numpy arrays, and the ELF section access DWARF needs.

A symbol table is .symtab (from the separate debug file when there is one, which has
the full table even for a stripped module), else .dynsym. Kept: FUNC and IFUNC
symbols, and NOTYPE symbols defined in an executable section (hand-written assembly).
Where several symbols start at one address, one is kept: a sized one over a size-0
one, a global or weak one over a local alias, then the larger, then (like LLVM) the
one that comes last in the table. Lookups honour sizes: an address past a sized symbol's end is not
in it; a size-0 symbol is used only when no sized symbol covers the address and no
sized symbol starts between it and the address.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

SYM_DTYPE = np.dtype(
    [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
     ("size", "<u8")]
)
STT_NOTYPE, STT_FUNC, STT_FILE, STT_GNU_IFUNC = 0, 2, 4, 10
STB_LOCAL = 0
SHF_EXECINSTR = 0x4
SHF_COMPRESSED = 0x800
SHN_LORESERVE = 0xFF00

DWARF_SECTIONS = (
    ".debug_info", ".debug_abbrev", ".debug_str", ".debug_line_str", ".debug_line",
    ".debug_ranges", ".debug_rnglists", ".debug_addr", ".debug_str_offsets", ".debug_aranges",
)  # fmt: skip


class ElfReadError(Exception):
    """An ELF file that cannot be read (worded for one line)."""


_ELF_ERRORS = (OSError, ELFError, struct.error, ValueError, zlib.error, KeyError, IndexError,
               AssertionError)


@dataclass
class SymbolTable:
    start: np.ndarray  # uint64, sorted, unique
    size: np.ndarray  # uint64
    names: list[str]  # raw (mangled) names
    # source file of a local symbol: the STT_FILE symbol before it (for modules without
    # DWARF, like LLVM), else None
    files: list[str | None]

    @classmethod
    def empty(cls) -> SymbolTable:
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.uint64), [], [])

    def lookup(self, vaddrs: np.ndarray) -> np.ndarray:
        """Index of the symbol holding each address (int64), -1 where none."""
        a = np.asarray(vaddrs, dtype=np.uint64)
        out = np.full(a.shape, -1, dtype=np.int64)
        if len(self.start) == 0:
            return out
        sized = self.size > 0
        i = np.searchsorted(self.start, a, side="right").astype(np.int64) - 1
        ok = i >= 0
        ic = np.where(ok, i, 0)
        hit = ok & sized[ic] & (a - self.start[ic] < self.size[ic])
        out[hit] = i[hit]
        # A sized symbol that starts earlier but reaches further (nested symbols).
        ends = np.where(sized, self.start + self.size, 0)
        cover = np.maximum.accumulate(ends)
        arg = _running_argmax(ends)
        miss = ok & ~hit & (cover[ic] > a)
        out[miss] = arg[ic[miss]]
        # Last resort: the nearest size-0 symbol with no sized symbol started after it.
        rest = ok & (out < 0)
        if rest.any():
            zero_idx = np.where(~sized, np.arange(len(sized)), -1)
            last_zero = np.maximum.accumulate(zero_idx)
            sized_idx = np.where(sized, np.arange(len(sized)), -1)
            last_sized = np.maximum.accumulate(sized_idx)
            z = last_zero[ic]
            use = rest & (z >= 0) & (z > last_sized[ic])
            out[use] = z[use]
        return out


def _running_argmax(v: np.ndarray) -> np.ndarray:
    """For each i, the index j <= i of the (first) maximum of v[:i+1]."""
    if len(v) == 0:
        return np.zeros(0, dtype=np.int64)
    run = np.maximum.accumulate(v)
    is_new = np.concatenate(([True], run[1:] > run[:-1]))
    idx = np.where(is_new, np.arange(len(v)), 0)
    return np.maximum.accumulate(idx)


class ElfImage:
    """An open ELF file: section bytes (decompressed), executable ranges, symbols."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._f = open(path, "rb")  # noqa: SIM115 - kept open while the image lives
            self.elf = ELFFile(self._f)
            self.sections = {s.name: s for s in self.elf.iter_sections()}
        except _ELF_ERRORS as e:
            raise ElfReadError(f"{path}: not a readable ELF file ({e})") from None

    def close(self) -> None:
        self._f.close()

    def exec_ranges(self) -> list[tuple[int, int]]:
        out = []
        for s in self.elf.iter_sections():
            if s["sh_flags"] & SHF_EXECINSTR and s["sh_size"]:
                out.append((s["sh_addr"], s["sh_addr"] + s["sh_size"]))
        return sorted(out)

    def has(self, name: str) -> bool:
        s = self.sections.get(name) or self.sections.get(".z" + name[1:])
        return s is not None and s["sh_type"] != "SHT_NOBITS" and s["sh_size"] > 0

    def section_bytes(self, name: str) -> bytes:
        """A section's contents, decompressed (SHF_COMPRESSED or the old .zdebug form)."""
        s = self.sections.get(name)
        if s is not None and s["sh_type"] != "SHT_NOBITS":
            try:
                return bytes(s.data())  # pyelftools inflates SHF_COMPRESSED sections
            except _ELF_ERRORS as e:
                raise ElfReadError(f"{self.path}: section {name} unreadable ({e})") from None
        z = self.sections.get(".z" + name[1:])
        if z is not None:
            raw = z.data()
            if raw[:4] != b"ZLIB":
                raise ElfReadError(f"{self.path}: section {z.name} has no ZLIB header")
            try:
                return zlib.decompress(raw[12:])
            except zlib.error as e:
                raise ElfReadError(f"{self.path}: section {z.name} corrupt ({e})") from None
        return b""

    def dwarf_sections(self) -> dict[str, bytes]:
        return {n: self.section_bytes(n) for n in DWARF_SECTIONS if self.has(n)}

    def symbol_table(self) -> tuple[SymbolTable, str]:
        """(table, source section name); source is '' when there is none."""
        for name in (".symtab", ".dynsym"):
            sec = self.sections.get(name)
            if sec is None or sec["sh_type"] == "SHT_NOBITS" or not sec["sh_size"]:
                continue
            try:
                table = self._read_symbols(sec)
            except _ELF_ERRORS as e:
                raise ElfReadError(f"{self.path}: {name} unreadable ({e})") from None
            if len(table.start):
                return table, name
        return SymbolTable.empty(), ""

    def _read_symbols(self, sec) -> SymbolTable:  # noqa: ANN001 - pyelftools section
        data = sec.data()
        n = len(data) // SYM_DTYPE.itemsize
        syms = np.frombuffer(data, dtype=SYM_DTYPE, count=n)
        strtab = self.elf.get_section(sec["sh_link"]).data()
        typ = syms["info"] & 0xF
        bind = syms["info"] >> 4
        shndx = syms["shndx"].astype(np.int64)
        nsec = self.elf.num_sections()
        exec_sec = np.zeros(max(nsec, 1), dtype=bool)
        for i in range(nsec):
            exec_sec[i] = bool(self.elf.get_section(i)["sh_flags"] & SHF_EXECINSTR)
        defined = (shndx != 0) & (shndx < SHN_LORESERVE) & (shndx < nsec)
        in_exec = defined & exec_sec[np.where(defined, shndx, 0)]
        keep = defined & ((typ == STT_FUNC) | (typ == STT_GNU_IFUNC) |
                          ((typ == STT_NOTYPE) & in_exec)) & (syms["name"] != 0)
        idx = np.flatnonzero(keep)

        def name_at(off: int) -> str:
            end = strtab.find(b"\0", off)
            return strtab[off:end if end >= 0 else len(strtab)].decode("utf-8", "replace")

        names = [name_at(off) for off in syms["name"][idx].tolist()]
        file_pos = np.flatnonzero(typ == STT_FILE)
        file_names = [name_at(off) for off in syms["name"][file_pos].tolist()]
        fi = np.searchsorted(file_pos, idx) - 1
        fi[bind[idx] != STB_LOCAL] = -1
        src_files = [file_names[k] or None if k >= 0 else None for k in fi.tolist()]
        # assembler-local labels are not functions; an empty name is no name
        good = np.array([bool(nm) and not nm.startswith(".L") for nm in names], dtype=bool)
        idx = idx[good]
        names = [nm for nm, g in zip(names, good.tolist(), strict=True) if g]
        src_files = [f for f, g in zip(src_files, good.tolist(), strict=True) if g]
        start = syms["value"][idx]
        size = syms["size"][idx]
        is_global = (bind[idx] != STB_LOCAL).astype(np.int64)
        sized = (size > 0).astype(np.int64)
        order = np.lexsort((idx, size, is_global, sized, start))
        start, size = start[order], size[order]
        last = np.concatenate((start[1:] != start[:-1], [True])) if len(start) else np.zeros(
            0, dtype=bool)
        pick = order[last]
        return SymbolTable(
            start=np.ascontiguousarray(start[last], dtype=np.uint64),
            size=np.ascontiguousarray(size[last], dtype=np.uint64),
            names=[names[k] for k in pick.tolist()],
            files=[src_files[k] for k in pick.tolist()],
        )
