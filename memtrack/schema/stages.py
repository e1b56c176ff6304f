"""The tables `memtrack process` moves between its stages (Arrow), in pipeline order.

Names follow the run database the stages feed (memtrack.schema.ddl): a *stack record*
is one row of the artifact's stacks.arrow; a *stack* one distinct (stack hash, pid)
as unwound (-> `stacks`); a *stack frame* one physical frame of a stack at a depth
(-> `stack_frames`); a *frame* one code location with its inline levels (-> `frames`).
The codes in uint8 columns are memtrack.schema.enums'.
"""

from __future__ import annotations

import pyarrow as pa

from memtrack.schema import NUM_REGS

# decode (memtrack.process.decode): one row per stack record that decoded and verified,
# its copy rebuilt (`stack`, from sp upward) and its registers (DWARF order).
DECODED_RECORDS = pa.schema([
    ("stack_hash", pa.uint64()),
    ("pid", pa.uint32()),
    ("tid", pa.uint32()),
    ("ts", pa.uint64()),
    ("sp", pa.uint64()),
    ("copy_len", pa.uint32()),
    # the budget cut the copy before the stack's end (stacks.arrow's `truncated`)
    ("copy_truncated", pa.bool_()),
    ("regs", pa.list_(pa.uint64(), NUM_REGS)),
    ("stack", pa.binary()),
    ("fp_chain", pa.list_(pa.uint64())),
    ("python_cut", pa.bool_()),  # stacks.arrow's `python_cut`
])

# pair (memtrack.process.pair): one row per allocation, in event order.
ALLOCATIONS = pa.schema([
    ("alloc_id", pa.uint64()),
    ("event_id", pa.uint64()),
    ("pid", pa.uint32()),
    ("tid", pa.uint32()),
    ("ts", pa.uint64()),
    ("kind", pa.uint8()),  # EventKind
    ("allocator", pa.uint8()),  # Allocator
    ("addr", pa.uint64()),
    ("size", pa.uint64()),
    ("stack_hash", pa.uint64()),
    ("free_ts", pa.uint64()),
    ("free_event_id", pa.uint64()),
    ("free_tid", pa.uint32()),
    ("end_ts", pa.uint64()),
    ("end_event_id", pa.uint64()),
    ("end_reason", pa.uint8()),  # EndReason
    ("lifetime_ns", pa.uint64()),
    ("realloc_of", pa.uint64()),
    ("temporary", pa.bool_()),
    ("inherited_from", pa.uint64()),  # a forked child's copy: the parent's block (alloc_id)
])

# pair: heap bytes in use per process after each event that changed them.
HEAP_TIMELINE = pa.schema([
    ("pid", pa.uint32()),
    ("event_id", pa.uint64()),
    ("ts", pa.uint64()),
    ("delta", pa.int64()),
    ("heap_bytes", pa.int64()),
])

# regions (memtrack.process.regions): one row per region, by region_id (-> `regions`).
# A region opens at its begin event and closes at its end event, or, never ended, at
# its thread's exit or its process's exec (that event: ended = false), or at the
# capture's end (end_event_id null). Per thread, regions nest: parent_id is the
# innermost region open at its begin (null at depth 0).
REGIONS = pa.schema([
    ("region_id", pa.uint64()),
    ("name", pa.string()),
    ("pid", pa.uint32()),
    ("tid", pa.uint32()),
    ("parent_id", pa.uint64()),
    ("depth", pa.uint32()),
    ("begin_event_id", pa.uint64()),
    ("end_event_id", pa.uint64()),
    ("begin_ts", pa.uint64()),
    ("end_ts", pa.uint64()),
    ("ended", pa.bool_()),  # its end arrived (false: closed at exit, exec or the end)
])

# rss (memtrack.process.rss): each process's resident bytes per member over time as the
# stage makes them effective, ts-ordered (-> `rss`).
EFFECTIVE_RSS = pa.schema([
    ("ts", pa.uint64()),
    ("pid", pa.uint32()),
    ("member", pa.uint8()),  # RssMember
    ("bytes", pa.int64()),
    ("cause", pa.uint8()),  # RssCause
])

# rss: the peak per process and member; member "total" is file + anon + shmem.
RSS_PEAKS = pa.schema([
    ("pid", pa.uint32()),
    ("member", pa.string()),
    ("bytes", pa.int64()),
    ("ts", pa.uint64()),
])

# unwind (memtrack.process.unwind): one row per distinct stack_hash (-> `stacks`).
UNWOUND_STACKS = pa.schema([
    ("stack_hash", pa.uint64()),
    ("pid", pa.uint32()),
    ("depth", pa.uint16()),  # number of frames
    ("truncated", pa.bool_()),  # unwinding needed bytes beyond the copy (stop truncated)
    ("complete", pa.bool_()),  # reached _start / a thread start (RA undefined)
    ("stop", pa.string()),  # why the unwinding ended (Stop)
])

# unwind: the physical frames of each stack, outward from depth 0 (-> `stack_frames`),
# each normalized to its module and the ELF virtual address looked up (pc - 1 for a
# return address).
# A string column of few values (labels, a module's build id and path per frame), as a
# dictionary: a frame costs an index, not its strings.
LABEL = pa.dictionary(pa.int32(), pa.string())
UNWOUND_STACK_FRAMES = pa.schema([
    ("stack_hash", pa.uint64()),
    ("pid", pa.uint32()),
    ("depth", pa.uint16()),
    ("address", pa.uint64()),  # the runtime pc / return address
    ("method", LABEL),  # Method
    ("build_id", LABEL),  # null: no module identified (`reason` says why)
    ("path", LABEL),  # where the module was mapped
    ("lookup_vaddr", pa.uint64()),  # null where normalization failed
    ("reason", LABEL),  # Unresolved from normalization, null when it succeeded
])

# symbolize (memtrack.symbolize): one row per (input location, inline level), innermost
# level first (-> `frames`).
SYMBOLIZED_FRAMES = pa.schema([
    ("row", pa.uint32()),  # index of the input (build id, vaddr) row
    ("inline_depth", pa.uint8()),  # 0 = innermost; the last is the real function
    ("function", pa.string()),  # demangled, or `[unknown] (module+0xVADDR)`
    ("symbol", pa.string()),  # raw (mangled) name; null when unknown
    # vaddr - start of the ELF symbol holding it (the same on every inline level);
    # the vaddr itself when no symbol holds it
    ("offset", pa.uint64()),
    ("file", pa.string()),  # null when unknown
    ("line", pa.uint32()),  # 0 when unknown
    ("column", pa.uint32()),
    ("reason", pa.string()),  # Unresolved, null when the function is known
])

# the modules met (mapped, or landed in while unwinding), one row per build id.
MODULES = pa.schema([
    ("module_id", pa.int32()),
    ("build_id", pa.string()),
    ("path", pa.string()),
    ("elf_path", pa.string()),
    ("has_debuginfo", pa.bool_()),
    ("in_artifact", pa.bool_()),
])
