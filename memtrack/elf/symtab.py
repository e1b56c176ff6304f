"""ELF symbol tables as sorted numpy arrays (read for memtrack.elf.ElfImage).

A symbol table is .symtab (from the separate debug file when there is one, which has
the full table even for a stripped module), else .dynsym. Kept: FUNC and IFUNC
symbols, and NOTYPE symbols defined in an executable section (hand-written assembly).
Where several symbols start at one address, one is kept: a sized one over a size-0
one, a global or weak one over a local alias, then the larger, then (like LLVM) the
one that comes last in the table. Lookups honour sizes: an address past a sized
symbol's end is not in it; a size-0 symbol is used only when no sized symbol covers the
address and no sized symbol starts between it and the address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from memtrack.elf.image import ELF_ERRORS, SHF_EXECINSTR, ElfReadError

if TYPE_CHECKING:
    from memtrack.elf.image import ElfImage

SYM_DTYPE = np.dtype(
    [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
     ("size", "<u8")]
)
STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_FILE, STT_GNU_IFUNC = 0, 1, 2, 4, 10
STB_LOCAL = 0
SHN_LORESERVE = 0xFF00


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


def read_symbol_table(image: ElfImage) -> tuple[SymbolTable, str]:
    """(table, source section name) of an image: .symtab, else .dynsym; '' when none."""
    for name in (".symtab", ".dynsym"):
        sec = image.sections.get(name)
        if sec is None or sec["sh_type"] == "SHT_NOBITS" or not sec["sh_size"]:
            continue
        try:
            table = _read_symbols(image, sec)
        except ELF_ERRORS as e:
            raise ElfReadError(f"{image.path}: {name} unreadable ({e})") from None
        if len(table.start):
            return table, name
    return SymbolTable.empty(), ""


def _raw_symbols(image: ElfImage, sec: Any) -> tuple[np.ndarray, bytes]:
    """A symbol section's entries (SYM_DTYPE) and its string table."""
    data = image.data(sec)
    syms = np.frombuffer(data, dtype=SYM_DTYPE, count=len(data) // SYM_DTYPE.itemsize)
    return syms, image.data(image.elf.get_section(sec["sh_link"]))


def name_at(strtab: bytes, off: int) -> str:
    end = strtab.find(b"\0", off)
    return strtab[off:end if end >= 0 else len(strtab)].decode("utf-8", "replace")


def defined_functions(image: ElfImage, names: set[str], *, ifunc: bool = False
                      ) -> dict[str, tuple[int, int]]:
    """ElfImage.functions: defined FUNC (and with `ifunc` IFUNC) symbols named in `names`,
    -> (vaddr, size), from .dynsym then .symtab; the first definition wins."""
    return defined_symbols(image, names, (STT_FUNC, STT_GNU_IFUNC) if ifunc else (STT_FUNC,))


def defined_symbols(image: ElfImage, names: set[str], types: tuple[int, ...],
                    sections: tuple[str, ...] = (".dynsym", ".symtab")
                    ) -> dict[str, tuple[int, int]]:
    """Symbols of these types (STT_*) that the module defines (not imports), named in
    `names`, -> (vaddr, size), from `sections` in order; the first definition wins. The
    names are found in the string tables first, so only their symbols are decoded
    (pyelftools decodes every symbol of a section to find one: ~75 ms for libc's)."""
    out: dict[str, tuple[int, int]] = {}
    for sec_name in sections:
        sec = image.sections.get(sec_name)
        if sec is None or sec["sh_type"] == "SHT_NOBITS" or not sec["sh_size"]:
            continue
        try:
            syms, strtab = _raw_symbols(image, sec)
        except ELF_ERRORS as e:
            raise ElfReadError(f"{image.path}: {sec_name} unreadable ({e})") from None
        offsets: dict[int, str] = {}
        for name in names:
            for end in (b"\0", b"@"):
                needle = name.encode() + end
                pos = strtab.find(needle)
                while pos >= 0:  # string tables may share tails: any match is a name
                    offsets[pos] = name
                    pos = strtab.find(needle, pos + 1)
        if not offsets:
            continue
        keep = (np.isin(syms["info"] & 0xF, types) & (syms["shndx"] != 0)
                & (syms["value"] != 0)
                & np.isin(syms["name"], np.fromiter(offsets, dtype=np.uint32)))
        for s in syms[keep]:
            out.setdefault(offsets[int(s["name"])], (int(s["value"]), int(s["size"])))
    return out


def _read_symbols(image: ElfImage, sec: Any) -> SymbolTable:
    syms, strtab = _raw_symbols(image, sec)
    typ = syms["info"] & 0xF
    bind = syms["info"] >> 4
    shndx = syms["shndx"].astype(np.int64)
    nsec = image.elf.num_sections()
    exec_sec = np.zeros(max(nsec, 1), dtype=bool)
    for i in range(nsec):
        exec_sec[i] = bool(image.elf.get_section(i)["sh_flags"] & SHF_EXECINSTR)
    defined = (shndx != 0) & (shndx < SHN_LORESERVE) & (shndx < nsec)
    in_exec = defined & exec_sec[np.where(defined, shndx, 0)]
    keep = defined & ((typ == STT_FUNC) | (typ == STT_GNU_IFUNC) |
                      ((typ == STT_NOTYPE) & in_exec)) & (syms["name"] != 0)
    idx = np.flatnonzero(keep)

    names = [name_at(strtab, off) for off in syms["name"][idx].tolist()]
    file_pos = np.flatnonzero(typ == STT_FILE)
    file_names = [name_at(strtab, off) for off in syms["name"][file_pos].tolist()]
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
