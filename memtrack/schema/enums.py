"""Every enumeration and flag of memtrack in one place: the codes the artifact's columns
hold, the codes the stages write into their tables (the run database turns each into a
DuckDB ENUM of the lowercase names, memtrack.schema.ddl), and the kernel's flag bits
that events carry (Linux x86-64 uapi values)."""

from __future__ import annotations

import enum


def names(kind: type[enum.IntEnum]) -> list[str]:
    """The lowercase names of an enum whose codes run 0, 1, 2 ... (EventKind: 1, 2 ...)."""
    return [k.name.lower().replace("_", "-") if kind in _DASHED else k.name.lower()
            for k in kind]


# ---------------------------------------------------------------- the artifact's codes


class EventKind(enum.IntEnum):
    """`events.kind`. Allocation kinds first, then address-space and lifecycle kinds."""

    MALLOC = 1
    CALLOC = 2
    REALLOC = 3
    ALIGNED_ALLOC = 4  # aligned_alloc, memalign, posix_memalign, valloc, pvalloc, aligned new
    FREE = 5
    MMAP = 6
    MUNMAP = 7
    BRK = 8
    FORK = 9
    EXEC = 10
    EXIT = 11
    MADVISE = 12  # from the rss part (memtrack/bpf/rss.c), successful calls only
    MREMAP = 13  # idem
    REGION = 14  # a region's begin or end (the control FIFO's begin/end: capture/regions.py)


ALLOC_KINDS = (EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC, EventKind.ALIGNED_ALLOC)


class Allocator(enum.IntEnum):
    """`events.allocator`: which family of functions produced the event."""

    NONE = 0  # lifecycle and syscall events
    LIBC = 1  # malloc family of the C library (glibc, musl)
    CXX = 2  # operator new / delete (libstdc++, libc++)
    JEMALLOC = 3
    MIMALLOC = 4
    TCMALLOC = 5
    SYSCALL = 6  # mmap, munmap, brk
    OTHER = 7  # a fixture's or program's own allocator that exports a known API
    PYMALLOC = 8  # CPython's object allocator (capture --python-allocators on)


class RssMember(enum.IntEnum):
    """kmem:rss_stat `member`, as the kernel numbers it (MM_FILEPAGES ...)."""

    FILE = 0
    ANON = 1
    SWAP = 2
    SHMEM = 3


# ---------------------------------------------------------------- the stages' codes


class RssCause(enum.IntEnum):
    """`rss.cause`: why a row of the RSS stage holds its value."""

    UPDATE = 0  # the process's own rss_stat update
    EXTERNAL = 1  # an update from another context, allowed only to lower
    FORK = 2  # seeded from the parent at fork
    EXEC = 3  # reset by exec
    EXIT = 4  # reset by the process's exit


class EndReason(enum.IntEnum):
    """`allocations.end_reason`: how an allocation's lifetime ended."""

    FREE = 0  # free / delete
    REALLOC = 1  # realloc'd away
    REUSED = 2  # its address handed out again with no free seen (a free was not recorded)
    EXEC = 3  # its process exec'd
    EXIT = 4  # its process exited
    END = 5  # the capture ended with it alive


class StopReason(enum.IntEnum):
    """Why capture held a traced process stopped (stops.arrow)."""

    ATTACH = 0  # it exec'd, forked or mapped an executable file: its probes were attached
    PAUSE = 1  # a ring was half full (--on-ring-full pause) until the drain emptied it


class Method(enum.IntEnum):
    """`stack_frames.method`: how the unwinder found a frame."""

    REGS = 0  # the registers at allocator entry (frame 0)
    CFI = 1  # DWARF call frame information (or a frame-0 prologue / signal row)
    FP = 2  # the frame pointer, where no CFI covers the pc
    FP_KERNEL = 3  # the kernel's frame-pointer chain, past the end of the copy
    PYTHON = 4  # an interpreter frame of CPython, in place of the evaluation frame


class Stop(enum.IntEnum):
    """`stacks.stop`: why unwinding a stack ended (NONE while it goes on)."""

    NONE = 0
    COMPLETE = 1  # RA undefined: _start or a thread start, the stack is whole
    TRUNCATED = 2  # the next frame lies beyond the copied bytes (the copy was too short)
    NO_MAPPING = 3  # the pc is in no file-backed mapping (nor the vDSO)
    NO_ADVANCE = 4  # the CFA would not move up the stack
    NO_RULE = 5  # no rule recovers the return address
    BAD_REGISTER = 6  # the CFA's register is unknown in this frame
    BAD_ADDRESS = 7  # a saved register's slot is below the copy
    BAD_EXPRESSION = 8  # a DWARF expression that cannot be evaluated
    MAX_DEPTH = 9
    NULL_RETURN = 10  # the return address is 0
    PYTHON = 11  # a Python cut: the allocator's caller, the Python frames stand for the rest


class Unresolved(enum.IntEnum):
    """`frames.reason`: why a code location has no function name (null when it has one).
    The first five come from normalization (runtime address -> module and ELF virtual
    address, memtrack.addrspace.normalize), the rest from symbolization."""

    NO_MAPPING = 0  # no file-backed mapping (nor the vDSO) holds the address
    NO_BUILD_ID = 1  # the mapped file has no build id: nothing identifies the module
    NO_MODULE = 2  # the module is neither in the artifact nor (same build id) on this host
    CORRUPT_ELF = 3  # the module file cannot be read as an ELF
    NO_SEGMENT = 4  # the file offset lies in no PT_LOAD segment of the module
    STRIPPED = 5  # the module has neither symbols nor DWARF
    NO_SYMBOL = 6  # the module has symbols, none covers the address


_DASHED = frozenset((Method, Stop, Unresolved))

# ---------------------------------------------------------------- kernel flag bits

CLONE_THREAD = 0x10000  # FORK `flags`: a new thread, not a new process
CLONE_VM = 0x100  # FORK `flags`: the child shares its parent's memory (vfork, posix_spawn)
CLONE_VFORK = 0x4000  # FORK `flags`: the parent waits for the child's exec or exit
EXIT_PROCESS = 0x1  # EXIT `flags`: the whole process exits (its last thread)
REGION_BEGIN = 0x1  # REGION `flags`: the region begins (else it ends)

# MMAP `flags` (low 32 bits; prot is in the high 32 bits)
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_SHARED_VALIDATE = 0x03
MAP_TYPE = 0x0F
MAP_ANONYMOUS = 0x20
MAP_POPULATE = 0x8000
PROT_WRITE = 0x2

MREMAP_DONTUNMAP = 4  # MREMAP `flags` (low 8 bits)

# MADVISE `flags`: the advice (uapi/asm-generic/mman-common.h)
MADV_DONTNEED = 4
MADV_FREE = 8
MADV_REMOVE = 9
MADV_MERGEABLE = 12
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_PAGEOUT = 21
MADV_POPULATE_WRITE = 23
MADV_DONTNEED_LOCKED = 24
MADV_COLLAPSE = 25

# faults.error_code: the x86 page-fault error code
FAULT_PRESENT = 0x1  # a protection violation (else the page was not present)
FAULT_WRITE = 0x2
