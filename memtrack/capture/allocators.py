"""Which functions of a module to probe: classify an ELF file by its defined symbols.

A module's allocator family comes from the symbols it defines (dynamic and static
symbol tables, so that allocators linked statically into an executable are found):
`mallocx`/`je_mallocx` = jemalloc (distro builds are unprefixed), `mi_malloc` =
mimalloc, `tc_malloc` = tcmalloc, `malloc` with `__libc_start_main` = the C library,
`malloc` otherwise = a program's own allocator, `operator new` alone = the C++
runtime. CPython's object allocator (pymalloc) is probed too where asked
(`--python-allocators on`) and its functions can be. Every probed function has a shape
(what its arguments mean), carried to the BPF programs of alloc.c as the probe's attach
cookie.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memtrack.elf.image import ElfImage, Segments
from memtrack.schema import Allocator, EventKind

# name -> shape (SHAPES); shapes of kind FREE are entry-only frees (alloc.c mt_free), the
# others allocating entries (mt_alloc) paired with their return (mt_ret).
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
# CPython's object allocator: the functions its default PyMemAllocatorEx tables
# (`_PyObject`, and `_PyMem`, which pymalloc builds route to it since 3.6) point to. The
# exported PyObject_Malloc ... PyMem_Free call them through the table, every object
# allocation of the interpreter too; their first argument is the table's ctx. Local
# symbols (.symtab): a stripped interpreter has none.
PYMALLOC_NAMES = {"_PyObject_Malloc": "objmalloc", "_PyObject_Calloc": "objcalloc",
                  "_PyObject_Realloc": "objrealloc", "_PyObject_Free": "objfree"}
PY_EXPORTED = "PyObject_Malloc"  # an interpreter's: where a build's inlining shows

# Internal kinds of bpf/alloc.c, resolved at return into an EventKind.
KIND_POSIX_MEMALIGN = 100  # the address is written to the out-pointer
KIND_MALLOCX = 101  # jemalloc's flags decide: aligned, zeroed or plain

# bpf/alloc.c MT_CK_*: where each field sits in a probe's attach cookie.
CK_ALLOCATOR, CK_SIZE, CK_MUL, CK_OLD, CK_OUTP, CK_FLAGS, CK_WRAPPABLE = 8, 16, 18, 20, 22, 24, 26


@dataclass(frozen=True)
class Shape:
    """What a probed function's arguments mean: the event kind and which integer
    argument (1-3; 0 = none) holds the size, its multiplier, the old pointer (a free's:
    the pointer freed), the out-pointer and the flags.
    `wrappable`: an unprobed wrapper may call it (memtrack.capture.wrappers), so its
    entry looks for the wrapper's call site at [sp]."""

    kind: int
    size: int = 0
    mul: int = 0
    old: int = 0
    outp: int = 0
    flags: int = 0
    wrappable: bool = False

    @property
    def arg_regs(self) -> int:
        """Integer argument registers the BPF program reads at entry: the placement
        may skip instructions that overwrite the others."""
        return max(self.size, self.mul, self.old, self.outp, self.flags)

    def cookie(self, family: Allocator) -> int:
        return (self.kind | int(family) << CK_ALLOCATOR | self.size << CK_SIZE
                | self.mul << CK_MUL | self.old << CK_OLD | self.outp << CK_OUTP
                | self.flags << CK_FLAGS | int(self.wrappable) << CK_WRAPPABLE)


_K = EventKind
SHAPES = {
    "malloc": Shape(_K.MALLOC, size=1, wrappable=True),
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
    "free": Shape(_K.FREE, old=1),
    "freesized": Shape(_K.FREE, size=2, old=1),
    "freealignedsized": Shape(_K.FREE, size=3, old=1),
    "objmalloc": Shape(_K.MALLOC, size=2),
    "objcalloc": Shape(_K.CALLOC, size=2, mul=3),
    "objrealloc": Shape(_K.REALLOC, size=3, old=2),
    "objfree": Shape(_K.FREE, old=2),
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
ALL_NAMES = set().union(*_FAMILY_NAMES.values(), _MARKERS, PYMALLOC_NAMES, {PY_EXPORTED})


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
        return SHAPES[self.shape].kind == EventKind.FREE

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
    """What classifying and probing a module needs of its ELF file (memtrack.elf)."""

    path: str
    segments: Segments
    functions: dict[str, tuple[int, int]]  # defined function name -> (vaddr, size)

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        return self.segments.vaddr_to_offset(vaddr)


def read_elf(path: str | Path, wanted: set[str] = ALL_NAMES) -> ElfInfo:
    """The load segments and the defined functions named in `wanted` (both symbol
    tables); ElfReadError when the file is not a readable ELF file."""
    with ElfImage(path) as img:
        return ElfInfo(str(path), img.segments, img.functions(wanted))


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


def probes_for(info: ElfInfo, *, python_allocators: bool = False) -> list[Probe]:
    """Every function of the module to probe, one per code address (aliases such as
    tcmalloc's malloc = tc_malloc, glibc's aligned_alloc = memalign are probed once);
    with `python_allocators`, a CPython's object allocator too (pymalloc_refusal says
    whether it can be)."""
    family = classify(info)
    named = [(n, s, family) for n, s in _FAMILY_NAMES[family].items()] if family else []
    if python_allocators:
        named += [(n, s, Allocator.PYMALLOC) for n, s in PYMALLOC_NAMES.items()]
    out: list[Probe] = []
    seen: set[int] = set()
    for name, shape, fam in named:
        if name not in info.functions:
            continue
        vaddr, size = info.functions[name]
        off = info.vaddr_to_offset(vaddr)
        if off is None or vaddr in seen:
            continue
        seen.add(vaddr)
        out.append(Probe(name, vaddr, size, off, shape, fam))
    return out


def pymalloc_refusal(path: str | Path, info: ElfInfo) -> str | None:
    """Why the object allocator of the CPython in this module is not probed (None: it
    is, or the module is no interpreter). An LTO build with profile-guided
    optimization (Debian's python3.11) turns the call through the allocator table into
    `if (table.malloc == _PyObject_Malloc) <its body, inlined> else call`, in
    PyObject_Malloc and at ~190 other call sites: most objects would never reach a probe,
    and their frees (inlined too, ~50 sites) would be unmatched."""
    if PY_EXPORTED not in info.functions:
        return None
    import capstone as cs
    from capstone import x86 as csx86

    with ElfImage(path) as img:
        code, vaddr = img.function_code(PY_EXPORTED)
        exec_ranges = img.exec_ranges()
    md = cs.Cs(cs.CS_ARCH_X86, cs.CS_MODE_64)
    md.detail = True
    for insn in md.disasm(code, vaddr):
        if insn.mnemonic != "cmp" or len(insn.operands) != 2:
            continue
        op = insn.operands[1]
        if op.type == csx86.X86_OP_IMM and any(a <= op.imm < b for a, b in exec_ranges):
            return (f"{PY_EXPORTED} compares the allocator table with {op.imm:#x} and "
                    "inlines that function (a build with profile-guided indirect-call "
                    "promotion): most objects would never reach a probe")
    if PYMALLOC_NAMES.keys() - info.functions.keys():
        return ("no symbols of its object allocator (_PyObject_Malloc ...: a stripped build, "
                "or one without pymalloc)")
    return None
