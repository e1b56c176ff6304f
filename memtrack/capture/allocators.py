"""Which functions of a module to probe: classify an ELF file by its defined symbols.

A module's allocator family comes from the symbols it defines (dynamic and static
symbol tables, so that allocators linked statically into an executable are found):
`mallocx`/`je_mallocx` = jemalloc (distro builds are unprefixed), `mi_malloc` =
mimalloc, `tc_malloc` = tcmalloc, `malloc` with `__libc_start_main` = the C library,
`malloc` otherwise = a program's own allocator, `operator new` alone = the C++
runtime. Every probed function has a shape (what its arguments mean), carried to the
BPF programs of alloc.c as the probe's attach cookie.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memtrack.schema import Allocator, EventKind

# name -> shape (SHAPES); shapes ending in "free..." are entry-only frees (alloc.c
# mt_free), the others allocating entries (mt_alloc) paired with their return (mt_ret).
LIBC_NAMES = {
    "malloc": "malloc", "calloc": "calloc", "realloc": "realloc",
    "reallocarray": "reallocn", "aligned_alloc": "memalign", "memalign": "memalign",
    "posix_memalign": "posixmemalign", "valloc": "valloc", "pvalloc": "valloc",
    "free": "free", "cfree": "free", "free_sized": "freesized",
    "free_aligned_sized": "freealignedsized",
}  # fmt: skip
_NEW = "_Znwm _Znam _ZnwmRKSt9nothrow_t _ZnamRKSt9nothrow_t"
_NEW_ALIGNED = ("_ZnwmSt11align_val_t _ZnamSt11align_val_t _ZnwmSt11align_val_tRKSt9nothrow_t "
                "_ZnamSt11align_val_tRKSt9nothrow_t")
_DELETE = ("_ZdlPv _ZdaPv _ZdlPvRKSt9nothrow_t _ZdaPvRKSt9nothrow_t _ZdlPvSt11align_val_t "
           "_ZdaPvSt11align_val_t _ZdlPvSt11align_val_tRKSt9nothrow_t "
           "_ZdaPvSt11align_val_tRKSt9nothrow_t")
_DELETE_SIZED = "_ZdlPvm _ZdaPvm _ZdlPvmSt11align_val_t _ZdaPvmSt11align_val_t"
CXX_NAMES = {
    **dict.fromkeys(_NEW.split(), "malloc"),
    **dict.fromkeys(_NEW_ALIGNED.split(), "alignedsz"),
    **dict.fromkeys(_DELETE.split(), "free"),
    **dict.fromkeys(_DELETE_SIZED.split(), "freesized"),
}
_JE = {"mallocx": "mallocx", "rallocx": "realloc", "dallocx": "free", "sdallocx": "freesized"}
JEMALLOC_NAMES = {**_JE, **{"je_" + k: v for k, v in {**LIBC_NAMES, **_JE}.items()}}
MIMALLOC_NAMES = {
    "mi_malloc": "malloc", "mi_malloc_small": "malloc", "mi_new": "malloc",
    "mi_new_nothrow": "malloc", "mi_zalloc": "zalloc", "mi_zalloc_small": "zalloc",
    "mi_calloc": "calloc", "mi_mallocn": "mallocn", "mi_new_n": "mallocn",
    "mi_realloc": "realloc", "mi_reallocf": "realloc", "mi_rezalloc": "realloc",
    "mi_new_realloc": "realloc", "mi_reallocn": "reallocn", "mi_reallocarray": "reallocn",
    "mi_recalloc": "reallocn", "mi_new_reallocn": "reallocn",
    "mi_malloc_aligned": "alignedsz", "mi_malloc_aligned_at": "alignedsz",
    "mi_zalloc_aligned": "alignedsz", "mi_zalloc_aligned_at": "alignedsz",
    "mi_new_aligned": "alignedsz", "mi_new_aligned_nothrow": "alignedsz",
    "mi_calloc_aligned": "callocaligned", "mi_calloc_aligned_at": "callocaligned",
    "mi_realloc_aligned": "realloc", "mi_realloc_aligned_at": "realloc",
    "mi_rezalloc_aligned": "realloc", "mi_rezalloc_aligned_at": "realloc",
    "mi_aligned_alloc": "memalign", "mi_memalign": "memalign",
    "mi_posix_memalign": "posixmemalign", "mi_valloc": "valloc", "mi_pvalloc": "valloc",
    "mi_free": "free", "mi_cfree": "free", "mi_free_aligned": "free",
    "mi_free_size": "freesized", "mi_free_size_aligned": "freesized",
}  # fmt: skip
TCMALLOC_NAMES = {
    "tc_malloc": "malloc", "tc_malloc_skip_new_handler": "malloc", "tc_new": "malloc",
    "tc_newarray": "malloc", "tc_new_nothrow": "malloc", "tc_newarray_nothrow": "malloc",
    "tc_calloc": "calloc", "tc_realloc": "realloc", "tc_memalign": "memalign",
    "tc_posix_memalign": "posixmemalign", "tc_valloc": "valloc", "tc_pvalloc": "valloc",
    "tc_new_aligned": "alignedsz", "tc_newarray_aligned": "alignedsz",
    "tc_new_aligned_nothrow": "alignedsz", "tc_newarray_aligned_nothrow": "alignedsz",
    "tc_free": "free", "tc_cfree": "free", "tc_delete": "free", "tc_deletearray": "free",
    "tc_delete_nothrow": "free", "tc_deletearray_nothrow": "free",
    "tc_delete_aligned": "free", "tc_deletearray_aligned": "free",
    "tc_delete_aligned_nothrow": "free", "tc_deletearray_aligned_nothrow": "free",
    "tc_free_sized": "freesized", "tc_delete_sized": "freesized",
    "tc_deletearray_sized": "freesized", "tc_delete_sized_aligned": "freesized",
    "tc_deletearray_sized_aligned": "freesized",
}  # fmt: skip

# Internal kinds of bpf/alloc.c, resolved at return into an EventKind.
KIND_POSIX_MEMALIGN = 100  # the address is written to the out-pointer
KIND_MALLOCX = 101  # jemalloc's flags decide: aligned, zeroed or plain

# bpf/alloc.c MT_CK_*: where each field sits in a probe's attach cookie.
CK_ALLOCATOR, CK_SIZE, CK_MUL, CK_OLD, CK_OUTP, CK_FLAGS = 8, 16, 18, 20, 22, 24


@dataclass(frozen=True)
class Shape:
    """What a probed function's arguments mean: the event kind and which integer
    argument (1-3; 0 = none) holds the size, its multiplier, the old pointer, the
    out-pointer and the flags. A free's pointer is always its first argument."""

    kind: int
    size: int = 0
    mul: int = 0
    old: int = 0
    outp: int = 0
    flags: int = 0

    @property
    def arg_regs(self) -> int:
        """Integer argument registers the BPF program reads at entry: the placement
        may skip instructions that overwrite the others."""
        return max(self.size, self.mul, self.old, self.outp, self.flags,
                   1 if self.kind == EventKind.FREE else 0)

    def cookie(self, family: Allocator) -> int:
        return (self.kind | int(family) << CK_ALLOCATOR | self.size << CK_SIZE
                | self.mul << CK_MUL | self.old << CK_OLD | self.outp << CK_OUTP
                | self.flags << CK_FLAGS)


_K = EventKind
SHAPES = {
    "malloc": Shape(_K.MALLOC, size=1),
    "valloc": Shape(_K.ALIGNED_ALLOC, size=1),
    "calloc": Shape(_K.CALLOC, size=1, mul=2),
    "zalloc": Shape(_K.CALLOC, size=1),
    "mallocn": Shape(_K.MALLOC, size=1, mul=2),
    "realloc": Shape(_K.REALLOC, size=2, old=1),
    "reallocn": Shape(_K.REALLOC, size=2, mul=3, old=1),
    "memalign": Shape(_K.ALIGNED_ALLOC, size=2),
    "alignedsz": Shape(_K.ALIGNED_ALLOC, size=1),
    "callocaligned": Shape(_K.ALIGNED_ALLOC, size=1, mul=2),
    "posixmemalign": Shape(KIND_POSIX_MEMALIGN, size=3, outp=1),
    "mallocx": Shape(KIND_MALLOCX, size=1, flags=2),
    "free": Shape(_K.FREE),
    "freesized": Shape(_K.FREE, size=2),
    "freealignedsized": Shape(_K.FREE, size=3),
}
SHAPE_ARG_REGS = {name: shape.arg_regs for name, shape in SHAPES.items()}

_FAMILY_NAMES = {
    Allocator.JEMALLOC: {**LIBC_NAMES, **CXX_NAMES, **JEMALLOC_NAMES},
    Allocator.MIMALLOC: {**LIBC_NAMES, **CXX_NAMES, **MIMALLOC_NAMES},
    Allocator.TCMALLOC: {**LIBC_NAMES, **CXX_NAMES, **TCMALLOC_NAMES},
    Allocator.LIBC: LIBC_NAMES,
    Allocator.OTHER: {**LIBC_NAMES, **CXX_NAMES},
    Allocator.CXX: CXX_NAMES,
}
_MARKERS = ("mallocx", "je_mallocx", "mi_malloc", "tc_malloc", "malloc", "_Znwm",
            "__libc_start_main")
ALL_NAMES = set().union(*_FAMILY_NAMES.values(), _MARKERS)

SHT_SYMTAB, SHT_DYNSYM = 2, 11
STT_FUNC = 2
PT_LOAD = 1
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                 ("value", "<u8"), ("size", "<u8")])


class ElfError(Exception):
    pass


@dataclass(frozen=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int
    flags: int


@dataclass(frozen=True)
class Probe:
    """One function to probe: its file offset is where the uprobe goes."""

    name: str
    vaddr: int
    size: int
    file_offset: int
    shape: str
    family: Allocator

    @property
    def is_free(self) -> bool:
        return self.shape.startswith("free")

    @property
    def arg_regs(self) -> int:
        return SHAPE_ARG_REGS[self.shape]

    @property
    def program(self) -> str:
        """The bpf/alloc.c program of its entry probe."""
        return "mt_free" if self.is_free else "mt_alloc"

    @property
    def cookie(self) -> int:
        """The attach cookie that tells the program what this function is."""
        return SHAPES[self.shape].cookie(self.family)


@dataclass
class ElfInfo:
    path: str
    segments: list[Segment]
    functions: dict[str, tuple[int, int]]  # defined function name -> (vaddr, size)
    is_dyn: bool

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return vaddr - s.vaddr + s.offset
        return None


def read_elf(path: str | Path, wanted: set[str] = ALL_NAMES) -> ElfInfo:
    """Program headers and the defined functions named in `wanted` (both symbol tables)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        raise ElfError(f"{path}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ElfError(f"{path}: not a 64-bit little-endian ELF file")
    try:
        e_type = struct.unpack_from("<H", data, 16)[0]
        phoff, shoff = struct.unpack_from("<QQ", data, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
        segments = []
        for i in range(phnum):
            p_type, p_flags, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize)
            if p_type == PT_LOAD:
                segments.append(Segment(p_vaddr, p_offset, p_filesz, p_flags))
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                    for i in range(shnum)] if shoff else []
    except struct.error:
        raise ElfError(f"{path}: truncated ELF headers") from None
    functions: dict[str, tuple[int, int]] = {}
    for sh in sections:
        sh_type, sh_offset, sh_size, sh_link = sh[1], sh[4], sh[5], sh[6]
        if sh_type not in (SHT_SYMTAB, SHT_DYNSYM) or sh_link >= len(sections):
            continue
        strsec = sections[sh_link]
        strtab = data[strsec[4]:strsec[4] + strsec[5]]
        n = sh_size // _SYM.itemsize
        if sh_offset + n * _SYM.itemsize > len(data):
            raise ElfError(f"{path}: symbol table runs past the end of the file")
        syms = np.frombuffer(data, dtype=_SYM, count=n, offset=sh_offset)
        funcs = syms[((syms["info"] & 0xF) == STT_FUNC) & (syms["shndx"] != 0)
                     & (syms["value"] != 0)]
        if not funcs.size:
            continue
        offsets: dict[int, str] = {}
        for name in wanted:
            needle = name.encode() + b"\0"
            pos = strtab.find(needle)
            while pos >= 0:
                offsets[pos] = name
                pos = strtab.find(needle, pos + 1)
        if not offsets:
            continue
        hit = funcs[np.isin(funcs["name"], np.fromiter(offsets, dtype=np.uint32))]
        for s in hit:
            functions.setdefault(offsets[int(s["name"])], (int(s["value"]), int(s["size"])))
    return ElfInfo(str(path), segments, functions, e_type == 3)


def classify(info: ElfInfo) -> Allocator | None:
    """The allocator family of a module, or None when it defines no allocator."""
    f = info.functions
    if "mallocx" in f or "je_mallocx" in f:
        return Allocator.JEMALLOC
    if "mi_malloc" in f:
        return Allocator.MIMALLOC
    if "tc_malloc" in f:
        return Allocator.TCMALLOC
    if "malloc" in f:
        return Allocator.LIBC if "__libc_start_main" in f else Allocator.OTHER
    if "_Znwm" in f:
        return Allocator.CXX
    return None


def probes_for(info: ElfInfo) -> list[Probe]:
    """Every function of the module to probe, one per code address (aliases such as
    tcmalloc's malloc = tc_malloc, glibc's aligned_alloc = memalign are probed once)."""
    family = classify(info)
    if family is None:
        return []
    names = _FAMILY_NAMES[family]
    out: list[Probe] = []
    seen: set[int] = set()
    for name, shape in names.items():
        if name not in info.functions:
            continue
        vaddr, size = info.functions[name]
        off = info.vaddr_to_offset(vaddr)
        if off is None or vaddr in seen:
            continue
        seen.add(vaddr)
        out.append(Probe(name, vaddr, size, off, shape, family))
    return out
