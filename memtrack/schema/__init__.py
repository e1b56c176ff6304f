"""The artifact contract: the one place that says what every file of an artifact holds.

Writer (capture) and reader (process, info) both import from here; the codes of its
columns are in memtrack.schema.enums, the stack-record format in
memtrack.schema.stackrecord. A change to a
schema or to the meaning of a field bumps FORMAT_VERSION: the minor number when old
readers can still read the new files (an added column or table), the major number
otherwise.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from memtrack.schema.enums import ALLOC_KINDS, CLONE_THREAD, Allocator, EventKind, RssMember

# the codes of the artifact's columns, re-exported: the contract is read from here
__all__ = ["ALLOC_KINDS", "Allocator", "EventKind", "RssMember"]

FORMAT_VERSION = "2.6"
FORMAT_MAJOR = int(FORMAT_VERSION.split(".")[0])

MANIFEST = "manifest.json"
MODULES_DIR = "modules"
# modules/BUILD_ID/module.json describes the copy: {"build_id", "path" (where it was
# mapped on the traced host), "file" (the copied ELF's name in that directory),
# "debug_file" (the separate debug file's name there, or null)}.
MODULE_INFO = "module.json"
VDSO_PATH = "[vdso]"


# Meaning of the event columns by kind (every column is always present):
#   alloc kinds  addr = returned pointer, size = requested bytes (calloc: n*size),
#                old_addr = realloc's input pointer (0 otherwise)
#   FREE         addr = freed pointer, size = the size passed to probed sized frees or 0
#   MMAP         addr = start, size = length, flags = mmap flags | (prot << 32)
#                old_addr = fd (as unsigned, -1 for anonymous)
#   MUNMAP       addr = start, size = length
#   BRK          addr = new break, old_addr = previous break
#   FORK         pid/tid = the parent, addr = the child pid, flags = clone flags
#                (a new thread is a FORK with addr = new tid and CLONE_THREAD set)
#   EXEC         pid = the process, addr = old pid (a non-leader thread can exec)
#   EXIT         pid/tid = the exiting task, size = exit code (the kernel's
#                exit_code: status << 8 | signal), flags = 1 when the whole process exits
#   MADVISE      addr = start, size = length, flags = advice (MADV_*)
#   MREMAP       addr = new address, old_addr = old address, size = new length,
#                flags = mremap flags (low 8 bits) | old length << 8
#   REGION       pid/tid = the thread that sent begin/end on the control FIFO,
#                flags = REGION_BEGIN (1) at its begin, 0 at its end,
#                addr = the region id (region_names.arrow names it; ids start at 1);
#                written by capture into the events ring before it answers "ok"
# stack_hash is 0 where no stack was captured.
EVENTS = pa.schema(
    [
        ("ts", pa.uint64()),  # CLOCK_MONOTONIC ns
        ("pid", pa.uint32()),
        ("tid", pa.uint32()),
        ("kind", pa.uint8()),
        ("allocator", pa.uint8()),
        ("flags", pa.uint64()),
        ("addr", pa.uint64()),
        ("old_addr", pa.uint64()),
        ("size", pa.uint64()),
        ("stack_hash", pa.uint64()),
    ]
)


def clones(kind: np.ndarray, flags: np.ndarray, addr: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The FORK events among events' columns as everything reads them (the lifecycle
    stage; capture, for the processes rows of new children): their positions, each
    one's new task (addr: a child's pid, a new thread's tid) and whether it is a thread
    (CLONE_THREAD)."""
    at = np.flatnonzero(kind == EventKind.FORK)
    return at, addr[at].astype(np.uint32), (flags[at] & CLONE_THREAD) != 0


# The in-kernel event record as drained from the events ring buffer, one fixed size so
# that a span of the ring is a strided numpy array (bpf/common.h `struct mt_event`
# must match this byte for byte).
EVENT_DTYPE = np.dtype(
    [
        ("ts", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("kind", "u1"),
        ("allocator", "u1"),
        ("_pad", "<u2"),
        ("_pad2", "<u4"),
        ("flags", "<u8"),
        ("addr", "<u8"),
        ("old_addr", "<u8"),
        ("size", "<u8"),
        ("stack_hash", "<u8"),
    ]
)
assert EVENT_DTYPE.itemsize == 64

# DWARF register numbers of x86_64 for the 17 entries of `stacks.regs`.
DWARF_REGS = (
    "rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip",
)  # fmt: skip
NUM_REGS = len(DWARF_REGS)


# One stack record per distinct stack skeleton (memtrack.schema.stackrecord): the words
# of the copy from sp upward, and the registers, that point into kept regions
# (executable code, thread stacks), every other word read as 0; `hash` identifies it
# and is what events.stack_hash refers to. `payload` is the kept bitmap then the kept
# words; `regs` the registers at allocator entry in DWARF order, 0 where not kept.
# `truncated`: the budget cut the copy before the stack's end. `fp_chain` is the
# kernel's frame-pointer walk (return addresses, rip first), recorded for cut copies.
# `ret_fixups` lists stack slots whose original return address capture recorded (a
# live uretprobe replaces it with its trampoline); the kernel writes the original back
# into the copy before hashing, so payload and hash never hold the trampoline.
# `python_cut` (format 2.5): a Python cut (capture --python-stacks python): the copy is
# the allocator's return address alone, the registers rip alone, the hash takes sp as 0;
# the record's Python stacks (py_stacks) stand for the frames beyond the caller.
STACKS = pa.schema(
    [
        ("hash", pa.uint64()),
        ("ts", pa.uint64()),
        ("pid", pa.uint32()),
        ("tid", pa.uint32()),
        ("sp", pa.uint64()),
        ("copy_len", pa.uint32()),
        ("truncated", pa.bool_()),  # the budget cut the copy before the stack's end
        ("regs", pa.list_(pa.uint64(), NUM_REGS)),
        ("payload", pa.binary()),
        ("fp_chain", pa.list_(pa.uint64())),
        (
            "ret_fixups",
            pa.list_(pa.struct([("slot", pa.uint64()), ("value", pa.uint64())])),
        ),
        ("python_cut", pa.bool_()),
    ]
)

# Every capture's raw copy, written only by `capture --stack-copies` (a debug option:
# the proof that a record's skeleton unwinds as each of its captures would). `hash` is
# the record the capture's allocation refers to; `regs` and `stack` are as copied.
STACK_COPIES = pa.schema(
    [
        ("hash", pa.uint64()),
        ("pid", pa.uint32()),
        ("tid", pa.uint32()),
        ("ts", pa.uint64()),
        ("sp", pa.uint64()),
        ("copy_len", pa.uint32()),
        ("truncated", pa.bool_()),
        ("regs", pa.list_(pa.uint64(), NUM_REGS)),
        ("stack", pa.binary()),
        ("fp_chain", pa.list_(pa.uint64())),
        ("python_cut", pa.bool_()),  # as STACKS' (format 2.5)
    ]
)


# kmem:rss_stat updates as the kernel gave them. `external`: the update ran in another
# task's context (reclaim, another process's madvise, the mm's teardown at exit/exec)
# and reached `pid` through capture's mm ownership map; memtrack.process.rss lets such
# an update only lower a counter.
RSS = pa.schema(
    [
        ("ts", pa.uint64()),
        ("pid", pa.uint32()),
        ("member", pa.uint8()),
        ("bytes", pa.int64()),  # absolute value after the update
        ("external", pa.bool_()),
    ]
)

# User page faults of tracked processes (exceptions:page_fault_user, and
# page_fault_kernel on user addresses with kernel = true), written with --track-faults
# only. error_code is the x86 page-fault error code (bit 0 protection violation,
# 1 write, 2 user, 4 instruction fetch). memtrack.process.anon_replay replays them.
FAULTS = pa.schema(
    [
        ("ts", pa.uint64()),
        ("pid", pa.uint32()),
        ("tid", pa.uint32()),
        ("address", pa.uint64()),
        ("error_code", pa.uint32()),
        ("kernel", pa.bool_()),
    ]
)

MAPPINGS = pa.schema(
    [
        ("ts", pa.uint64()),
        ("pid", pa.uint32()),
        ("start", pa.uint64()),
        ("end", pa.uint64()),
        ("offset", pa.uint64()),
        ("perms", pa.string()),  # e.g. "r-xp"
        ("dev", pa.string()),  # "fd:01"
        ("inode", pa.uint64()),
        ("path", pa.string()),  # "" for anonymous; "[vdso]", "[stack]", ...
        ("build_id", pa.string()),  # lowercase hex, null where none or not an ELF
    ]
)

# One row each time capture learns who a process is: at start, after each exec. `pid`
# and `ppid` are as the host sees them; `ns_pid` (format 2.5) is the pid the process
# has in its own pid namespace (a container's: NSpid's last value in /proc/PID/status;
# `pid` itself outside one), null where unknown (a child gone before capture read it).
PROCESSES = pa.schema(
    [
        ("ts", pa.uint64()),
        ("pid", pa.uint32()),
        ("ppid", pa.uint32()),
        ("comm", pa.string()),
        ("exe", pa.string()),
        ("cmdline", pa.list_(pa.string())),
        ("ns_pid", pa.uint32()),
    ]
)

# The name of each region (events of kind REGION carry its id), one row when it begins.
REGION_NAMES = pa.schema(
    [
        ("region_id", pa.uint64()),
        ("name", pa.string()),
    ]
)

# Labels said of a region (format 2.5): `label TID KEY=VALUE` on the control FIFO gives the
# thread's innermost open region one, a row each (a later row of a key replaces it).
# The pytest plugin's limits are labels `limit.peak`, `limit.leaked`, `limit.allocated`
# (bytes) and `limit.calls`, as decimal digits (memtrack check reads them).
REGION_LABELS = pa.schema(
    [
        ("region_id", pa.uint64()),
        ("key", pa.string()),
        ("value", pa.string()),
    ]
)

# Python frames (capture --python-frames, default on with stacks; format 2.2). A Python
# stack record per distinct chain of interpreter frames at an allocation: `hash` is what
# events.stack_hash refers to (the native stack's hash folded with the chain),
# `native_hash` the native stack record it extends; per frame, innermost first, the code
# key (a code object's address and immutable fields, hashed), the instruction index
# (code units from its first instruction) and whether the frame was entered from C (the
# first frame an evaluation-loop call ran). `cut`: the chain went on beyond the bound.
PY_STACKS = pa.schema(
    [
        ("hash", pa.uint64()),
        ("native_hash", pa.uint64()),
        ("pid", pa.uint32()),
        ("tid", pa.uint32()),
        ("cut", pa.bool_()),
        ("code_key", pa.list_(pa.uint64())),
        ("instr", pa.list_(pa.uint32())),
        ("entry", pa.list_(pa.bool_())),
    ]
)

# One row per code object a Python stack record names, read when first seen: its
# qualified name (3.10: co_name, it has no co_qualname), file name, first line and line
# table (co_linetable's bytes; a table longer than capture keeps is cut:
# `linetable_size` is its whole length). `python_version` (format 2.6): the interpreter's
# major << 8 | minor, which says the line table's format (3.10's is not 3.11's); 0 in
# older artifacts, which hold 3.11 to 3.13 only.
PY_CODES = pa.schema(
    [
        ("key", pa.uint64()),
        ("pid", pa.uint32()),
        ("address", pa.uint64()),
        ("qualname", pa.string()),
        ("filename", pa.string()),
        ("first_line", pa.uint32()),
        ("linetable", pa.binary()),
        ("linetable_size", pa.uint32()),
        ("python_version", pa.uint16()),
    ]
)

# Each time capture held a traced process stopped (format 2.3): why (StopReason), from the
# stop (BPF's time of the request or pause) to memtrack's SIGCONT, on the events' clock.
# Reports start a run's time at the end of its root's first attach stop: its first
# instruction after exec, once memtrack had attached to it.
STOPS = pa.schema(
    [
        ("pid", pa.uint32()),
        ("reason", pa.uint8()),
        ("begin_ts", pa.uint64()),
        ("end_ts", pa.uint64()),
    ]
)

# Every Arrow file of an artifact: name -> schema. All are IPC streams with zstd
# buffers, written batch by batch, so a capture killed mid-way leaves files that are
# readable up to their last whole batch.
TABLES: dict[str, pa.Schema] = {
    "events": EVENTS,
    "stacks": STACKS,
    "stack_copies": STACK_COPIES,
    "rss": RSS,
    "mappings": MAPPINGS,
    "processes": PROCESSES,
    "faults": FAULTS,
    "region_names": REGION_NAMES,
    "region_labels": REGION_LABELS,
    "py_stacks": PY_STACKS,
    "py_codes": PY_CODES,
    "stops": STOPS,
}

# Columns a minor format added, per table: (name, the format that added it, what the
# rows of an older artifact read as). Its files lack them; the reader fills them in.
ADDED_COLUMNS: dict[str, tuple[tuple[str, tuple[int, int], object], ...]] = {
    "stacks": (("python_cut", (2, 5), False),),
    "stack_copies": (("python_cut", (2, 5), False),),
    "processes": (("ns_pid", (2, 5), None),),  # not known
    "py_codes": (("python_version", (2, 6), 0),),  # 3.11 to 3.13: one line-table format
}

# Loss counters the manifest always carries (0 when nothing was lost). Stages may add
# more; a reader treats any key as a counter.
LOSS_COUNTERS = (
    "events_ring_full",
    "stacks_ring_full",
    "attach_requests_dropped",
    "unpaired_returns",
    "stack_copy_failed",
    "stack_copies_cut",
    "stack_dedupe_full",
    "module_copy_failed",
    "rss_ring_full",
    "rss_events_ring_full",  # madvise/mremap events of the rss part
    "faults_ring_full",
    "pyframes_ring_full",
    # allocator functions of the tree's modules the kernel refused to probe (which, and
    # why: manifest.probes "refused"): their calls are not recorded
    "probes_refused",
)


# Counters among those that report reduced fidelity, not lost data: a copy cut at the
# stack budget still holds its frames up to the cut. They are printed like losses (never
# silent) but do not fail `--fail-on-loss`.
FIDELITY_COUNTERS = frozenset({"stack_copies_cut", "python_frames_cut"})

# Three counts of stacks that do not fit their copy, one per stage that knows it:
# - capture (manifest losses) `stack_copies_cut`: allocations whose copy the budget cut
#   before the stack's end;
# - process (meta.counters) `unwind_stop_truncated`: distinct stacks whose unwinding
#   needed bytes beyond a cut copy (stacks.stop = 'truncated');
# - process (meta.counters) `unwind_stacks_fp_kernel`: distinct stacks continued with
#   the kernel's frame-pointer chain (frames of method 'fp-kernel').


def is_loss(counter: str) -> bool:
    return counter not in FIDELITY_COUNTERS


def loss_lines(losses: dict[str, int]) -> list[str]:
    """A manifest's non-zero counters for a person: lost data first, then fidelity notes."""
    lost = {k: v for k, v in losses.items() if v and is_loss(k)}
    notes = {k: v for k, v in losses.items() if v and not is_loss(k)}
    out = []
    if lost:
        out.append("capture losses: " + ", ".join(f"{k} {v}" for k, v in lost.items()))
    if notes:
        out.append("capture notes: " + ", ".join(f"{k} {v}" for k, v in notes.items()))
    return out


def table_file(name: str) -> str:
    return f"{name}.arrow"
