"""One open ELF file: its loadable segments, sections (decompressed), symbols, build id,
DWARF presence and .gnu_debuglink, the one reader every part of memtrack asks.

pyelftools parses the headers and inflates compressed sections; symbol tables are read
as numpy arrays (memtrack.elf.symtab), not a Python object per symbol. Every failure to
read the file is an ElfReadError worded for one line (`PATH: problem`).
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

SHF_EXECINSTR = 0x4
NT_GNU_BUILD_ID = 3
SHF_COMPRESSED = 0x800
PF_X = 0x1
PT_LOAD, PT_NOTE = 1, 4
# Elf32_Phdr and Elf64_Phdr (the fields in file order; byte order set per file)
PHDR_DTYPES = {
    32: np.dtype([("type", "u4"), ("offset", "u4"), ("vaddr", "u4"), ("paddr", "u4"),
                  ("filesz", "u4"), ("memsz", "u4"), ("flags", "u4"), ("align", "u4")]),
    64: np.dtype([("type", "u4"), ("flags", "u4"), ("offset", "u8"), ("vaddr", "u8"),
                  ("paddr", "u8"), ("filesz", "u8"), ("memsz", "u8"), ("align", "u8")]),
}
R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT = 6, 7
RELA_DTYPE = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])  # Elf64_Rela

DWARF_SECTIONS = (
    ".debug_info", ".debug_abbrev", ".debug_str", ".debug_line_str", ".debug_line",
    ".debug_ranges", ".debug_rnglists", ".debug_addr", ".debug_str_offsets", ".debug_aranges",
)  # fmt: skip

MAX_SECTION_BYTES = 4 << 30  # a compressed section inflates to at most this

ELF_ERRORS = (OSError, ELFError, struct.error, ValueError, zlib.error, KeyError, IndexError,
              AssertionError)


class ElfReadError(Exception):
    """An ELF file that cannot be read (worded for one line)."""


@dataclass
class Segments:
    """PT_LOAD segments as parallel arrays, sorted by file offset."""

    offset: np.ndarray  # p_offset, uint64
    vaddr: np.ndarray  # p_vaddr, uint64
    filesz: np.ndarray  # p_filesz, uint64
    memsz: np.ndarray  # p_memsz, uint64
    executable: np.ndarray  # PF_X set, bool

    @classmethod
    def of(cls, phdrs: np.ndarray) -> Segments:
        """From the program headers (ElfImage.program_headers)."""
        load = phdrs[phdrs["type"] == PT_LOAD]
        load = load[np.lexsort((load["vaddr"], load["offset"]))]  # by offset, then vaddr
        return cls(load["offset"].astype(np.uint64), load["vaddr"].astype(np.uint64),
                   load["filesz"].astype(np.uint64), load["memsz"].astype(np.uint64),
                   (load["flags"] & PF_X) != 0)

    def file_offset_to_vaddr(self, offsets: np.ndarray) -> np.ndarray:
        """ELF virtual addresses (int64) of file offsets, via the PT_LOAD holding each
        offset (within p_filesz); -1 where no segment holds it."""
        off = np.asarray(offsets, dtype=np.uint64)
        out = np.full(off.shape, -1, dtype=np.int64)
        if len(self.offset) == 0 or off.size == 0:
            return out
        i = np.searchsorted(self.offset, off, side="right").astype(np.int64) - 1
        ok = i >= 0
        ic = np.where(ok, i, 0)
        inside = ok & (off - self.offset[ic] < self.filesz[ic]) & (off >= self.offset[ic])
        # Overlapping segments (a page shared by text and data) are rare; a later
        # segment starting inside an earlier one wins, like the loader's mapping.
        out[inside] = (self.vaddr[ic] + (off - self.offset[ic]))[inside].astype(np.int64)
        return out

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        """The file offset of a virtual address inside a segment's file bytes."""
        for off, va, size in zip(self.offset.tolist(), self.vaddr.tolist(),
                                 self.filesz.tolist(), strict=True):
            if va <= vaddr < va + size:
                return vaddr - va + off
        return None


class ElfImage:
    """An open ELF file (or image in memory). Use as a context manager, or close()."""

    def __init__(self, path: Path | str, data: bytes | None = None, *,
                 sections: bool = True) -> None:
        self.path = Path(path)
        try:
            self._f: IO[bytes] = io.BytesIO(data) if data is not None else open(  # noqa: SIM115
                self.path, "rb")
        except OSError as e:
            raise ElfReadError(f"{path}: not a readable ELF file ({e})") from None
        try:
            self.size = self._f.seek(0, io.SEEK_END)
            self.elf = ELFFile(self._f)
        except ELF_ERRORS as e:
            self._f.close()
            raise ElfReadError(f"{path}: not a readable ELF file ({e})") from None
        self._sections: dict[str, Any] | None = None
        self._segments: Segments | None = None
        if sections:  # read (and checked) now: ElfReadError from the open, not a use
            try:
                _ = self.sections
            except ElfReadError:
                self._f.close()
                raise

    @classmethod
    def of_bytes(cls, data: bytes, name: str = "[memory]") -> ElfImage:
        """An ELF image held in memory (the vDSO)."""
        return cls(name, data)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> ElfImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- headers -------------------------------------------------------------------
    @property
    def elf_type(self) -> str:
        """e_type: "ET_DYN" (shared object or PIE), "ET_EXEC", ..."""
        return str(self.elf["e_type"])

    @property
    def sections(self) -> dict[str, Any]:
        """The sections by name (read at the open, or at the first use when opened
        with `sections=False`: a build id or the program headers need none, and capture
        reads those of every module it sees)."""
        if self._sections is None:
            try:
                self._sections = {s.name: s for s in self.elf.iter_sections()}
            except ELF_ERRORS as e:
                raise ElfReadError(f"{self.path}: not a readable ELF file ({e})") from None
        return self._sections

    @property
    def segments(self) -> Segments:
        if self._segments is None:
            self._segments = Segments.of(self.program_headers())
        return self._segments

    def program_headers(self) -> np.ndarray:
        """The program header table as an array (PHDR_DTYPES' fields), read raw:
        pyelftools builds an object per segment and parses PT_DYNAMIC's whole table on
        the way (a third of a module's classification at capture)."""
        try:
            dtype = PHDR_DTYPES[self.elf.elfclass].newbyteorder(
                "<" if self.elf.little_endian else ">")
            off, num, size = (self.elf["e_phoff"], self.elf["e_phnum"],
                              self.elf["e_phentsize"])
            if num and (size != dtype.itemsize or off + num * size > self.size):
                raise ElfReadError(f"{self.path}: program headers unreadable ({num} of "
                                   f"{size} bytes at {off:#x})")
            self._f.seek(off)
            return np.frombuffer(self._f.read(num * size), dtype, num)
        except ELF_ERRORS as e:
            raise ElfReadError(f"{self.path}: program headers unreadable ({e})") from None

    @property
    def build_id(self) -> str | None:
        """The GNU build id as lowercase hex, or None: from the PT_NOTE segments, else
        the .note.gnu.build-id section (a debug file's notes are not in a segment)."""
        try:
            phdrs = self.program_headers()
            notes = phdrs[phdrs["type"] == PT_NOTE]
            for off, size in zip(notes["offset"].tolist(), notes["filesz"].tolist(),
                                 strict=True):
                if off + size <= self.size:
                    self._f.seek(off)
                    found = self._build_id_note(self._f.read(size))
                    if found:
                        return found
            sec = self.sections.get(".note.gnu.build-id")
            return self._build_id_note(self.data(sec)) if sec is not None else None
        except (ElfReadError, *ELF_ERRORS):
            return None

    def _build_id_note(self, notes: bytes) -> str | None:
        """The GNU build id among ELF notes, each note's sizes checked against the bytes
        (pyelftools read a note's n_descsz of 2 GiB as it stood)."""
        order = "<" if self.elf.little_endian else ">"
        pos = 0
        while pos + 12 <= len(notes):
            namesz, descsz, kind = struct.unpack_from(order + "III", notes, pos)
            desc = pos + 12 + (namesz + 3) // 4 * 4
            if desc + descsz > len(notes):
                return None
            if kind == NT_GNU_BUILD_ID and notes[pos + 12:pos + 12 + namesz] == b"GNU\0":
                return notes[desc:desc + descsz].hex()
            pos = desc + (descsz + 3) // 4 * 4
        return None

    def debuglink(self) -> tuple[str, int] | None:
        """(file name, CRC32) of the .gnu_debuglink section, or None."""
        sec = self.sections.get(".gnu_debuglink")
        if sec is None:
            return None
        try:
            data = self.data(sec)
            end = data.index(b"\0")
            (crc,) = struct.unpack_from("<I", data, (end + 4) & ~3)
        except (ElfReadError, *ELF_ERRORS):
            return None
        return data[:end].decode(errors="replace"), crc

    # ---- sections ------------------------------------------------------------------
    def exec_ranges(self) -> list[tuple[int, int]]:
        """[start, end) virtual address ranges of the executable sections, sorted."""
        out = []
        for s in self.elf.iter_sections():
            if s["sh_flags"] & SHF_EXECINSTR and s["sh_size"]:
                out.append((s["sh_addr"], s["sh_addr"] + s["sh_size"]))
        return sorted(out)

    def has(self, name: str) -> bool:
        """Whether section `name` (or its old .zdebug form) holds bytes."""
        s = self.sections.get(name) or self.sections.get(".z" + name[1:])
        return s is not None and s["sh_type"] != "SHT_NOBITS" and s["sh_size"] > 0

    @property
    def has_dwarf(self) -> bool:
        """Whether the file holds DWARF debug information (.debug_info with bytes;
        compressed or .zdebug sections count, a debug stub's NOBITS one does not)."""
        return self.has(".debug_info")

    def data(self, sec: Any) -> bytes:
        """A section's bytes, b"" for NOBITS, inflated where SHF_COMPRESSED; read only
        once its size is known to fit (its bytes inside the file, its inflated size at
        most MAX_SECTION_BYTES): a size in a header is never an allocation."""
        if sec["sh_type"] == "SHT_NOBITS":
            return b""
        if sec["sh_offset"] + sec["sh_size"] > self.size:
            raise ElfReadError(f"{self.path}: section {sec.name} ends beyond the file "
                               f"({sec['sh_size']:,} bytes at {sec['sh_offset']:#x})")
        try:
            if sec.compressed and sec.data_size > MAX_SECTION_BYTES:
                raise ElfReadError(f"{self.path}: section {sec.name} inflates to "
                                   f"{sec.data_size:,} bytes, more than {MAX_SECTION_BYTES:,}")
            return bytes(sec.data())  # pyelftools inflates SHF_COMPRESSED sections
        except ELF_ERRORS as e:
            raise ElfReadError(f"{self.path}: section {sec.name} unreadable ({e})") from None

    def section_bytes(self, name: str) -> bytes:
        """A section's contents, decompressed (SHF_COMPRESSED or the old .zdebug form)."""
        s = self.sections.get(name)
        if s is not None and s["sh_type"] != "SHT_NOBITS":
            return self.data(s)
        z = self.sections.get(".z" + name[1:])
        if z is not None:
            raw = self.data(z)
            if raw[:4] != b"ZLIB":
                raise ElfReadError(f"{self.path}: section {z.name} has no ZLIB header")
            size = int.from_bytes(raw[4:12], "big")
            if size > MAX_SECTION_BYTES:
                raise ElfReadError(f"{self.path}: section {z.name} inflates to {size:,} "
                                   f"bytes, more than {MAX_SECTION_BYTES:,}")
            try:
                return zlib.decompressobj().decompress(raw[12:], size)
            except zlib.error as e:
                raise ElfReadError(f"{self.path}: section {z.name} corrupt ({e})") from None
        return b""

    def dwarf_sections(self) -> dict[str, bytes]:
        return {n: self.section_bytes(n) for n in DWARF_SECTIONS if self.has(n)}

    def section(self, name: str) -> tuple[bytes, int] | None:
        """(bytes, sh_addr) of a section with contents, or None (absent or NOBITS)."""
        sec = self.sections.get(name)
        if sec is None or sec["sh_type"] == "SHT_NOBITS":
            return None
        return self.data(sec), int(sec["sh_addr"])

    # ---- code ----------------------------------------------------------------------
    def code(self, vaddr: int, size: int) -> bytes:
        """Up to `size` file bytes from virtual address `vaddr` (b'' outside the
        segments' file bytes)."""
        seg = self.segments
        off = self.segments.vaddr_to_offset(vaddr)
        if off is None or size <= 0:
            return b""
        i = int(np.searchsorted(seg.offset, np.uint64(off), side="right")) - 1
        end = min(int(seg.offset[i] + seg.filesz[i]), self.size)  # no more than the file
        try:
            self._f.seek(off)
            return self._f.read(max(min(size, end - off), 0))
        except OSError:
            return b""

    def executable_bytes(self) -> list[tuple[int, bytes]]:
        """(vaddr, file bytes) of each executable PT_LOAD segment."""
        seg = self.segments
        out = []
        for off, va, size, x in zip(seg.offset.tolist(), seg.vaddr.tolist(),
                                    seg.filesz.tolist(), seg.executable.tolist(), strict=True):
            if x and size:
                if off + size > self.size:  # a size in a header is never an allocation
                    raise ElfReadError(f"{self.path}: segment at {off:#x} ends beyond the "
                                       f"file ({size:,} bytes)")
                try:
                    self._f.seek(off)
                    out.append((va, self._f.read(size)))
                except OSError as e:
                    raise ElfReadError(f"{self.path}: segment at {off:#x} unreadable "
                                       f"({e})") from None
        return out

    def import_slots(self) -> dict[int, str]:
        """GOT slot address -> the symbol the dynamic linker binds it to, for every
        JUMP_SLOT and GLOB_DAT relocation (.rela.plt, .rela.dyn): what a PLT stub or a
        `call *slot(%rip)` calls. Read as arrays: pyelftools parses a relocation at a
        time (0.1 s for libstdc++'s, at every capture of a C++ program)."""
        from memtrack.elf.symtab import SYM_DTYPE, name_at

        out: dict[int, str] = {}
        try:
            for sec in self.sections.values():
                if sec["sh_type"] != "SHT_RELA" or sec["sh_entsize"] != RELA_DTYPE.itemsize:
                    continue
                data = self.data(sec)
                rels = np.frombuffer(data, RELA_DTYPE, len(data) // RELA_DTYPE.itemsize)
                rels = rels[np.isin(rels["info"] & 0xFFFFFFFF,
                                    (R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT))]
                if not len(rels):
                    continue
                symtab = self.elf.get_section(sec["sh_link"])
                syms = self.data(symtab)
                syms = np.frombuffer(syms, SYM_DTYPE, len(syms) // SYM_DTYPE.itemsize)
                strtab = self.data(self.elf.get_section(symtab["sh_link"]))
                index = (rels["info"] >> 32).astype(np.int64)
                known = index < len(syms)
                for slot, st_name in zip(rels["offset"][known].tolist(),
                                         syms["name"][index[known]].tolist(), strict=True):
                    name = name_at(strtab, st_name)
                    if name:
                        out[slot] = name.split("@")[0]
        except ELF_ERRORS as e:
            raise ElfReadError(f"{self.path}: relocations unreadable ({e})") from None
        return out

    # ---- symbols -------------------------------------------------------------------
    def symbol_table(self) -> tuple[Any, str]:
        """(SymbolTable, source section name): .symtab, else .dynsym; ('' when none)."""
        from memtrack.elf.symtab import read_symbol_table

        return read_symbol_table(self)

    def functions(self, names: set[str], *, ifunc: bool = False) -> dict[str, tuple[int, int]]:
        """Defined functions among `names` -> (vaddr, size), from .dynsym and .symtab
        (the first definition in section order wins; `name@VERSION` matches `name`).
        STT_GNU_IFUNC symbols only with `ifunc` (their address is the resolver's)."""
        from memtrack.elf.symtab import defined_functions

        return defined_functions(self, names, ifunc=ifunc)

    def function_code(self, symbol: str) -> tuple[bytes, int]:
        """The machine code of a function symbol (st_size bytes, 256 when unsized) and
        its address; ValueError when it is missing or not in a loaded segment."""
        found = self.functions({symbol}, ifunc=True).get(symbol)
        if found is None:
            raise ValueError(f"{self.path}: no function symbol {symbol!r}")
        vaddr, size = found
        code = self.code(vaddr, size or 256)
        if not code:
            raise ValueError(f"{self.path}: {symbol} at {vaddr:#x} is not in a loaded segment")
        return code, vaddr


def read_build_id(path: str | Path) -> str | None:
    """The GNU build id of an ELF file as lowercase hex, or None (no note, not an ELF)."""
    try:
        with ElfImage(path, sections=False) as img:
            return img.build_id
    except ElfReadError:
        return None


def build_id_of_bytes(data: bytes) -> str | None:
    """The build id of an ELF image held in memory (the vDSO)."""
    try:
        with ElfImage.of_bytes(data) as img:
            return img.build_id
    except ElfReadError:
        return None
