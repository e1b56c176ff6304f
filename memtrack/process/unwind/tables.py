"""A module's unwind table: one flat table of address ranges -> rule, sorted by ELF
virtual address, built once per module before any step needs it (as the OpenTelemetry
eBPF profiler keeps its unwind rules), so that each step of the walk is one lookup into
it. Its rows (memtrack.dwarf.cfi.CFITable, `Kind`):

- the CFI rows (`CFI`, `EXPR`, `SIGNAL`) and the gaps between FDEs (`FP`: the
  frame-pointer rule) of memtrack.dwarf.cfi;
- `ENTRY`: the module's entry code when no CFI covers it (ld.so's `_start` /
  `_dl_start_user`, which calls the libraries' constructors; a `_start` built without
  CFI), from the ELF header's entry point to the next CFI row: the outermost frame of a
  process's first thread, where the stack is complete;
- `SIGRETURN`: a signal-return trampoline without CFI (musl's `__restore_rt`, a restorer
  of a program's own), found by the kernel's rt_sigreturn code; its rules read the
  registers out of the kernel's rt_sigframe (`SIGRETURN_RULES`).

The address a frame is looked up with: a return address points after its call, so every
frame but two is looked up at pc - 1 (in the call's own row); frame 0 (the instruction
the probe interrupted) and the frame after a signal frame (the instruction the signal
interrupted) are exact, and are looked up at pc. Rows are placed for that rule, once, when
the table is built: a handler returns to its trampoline's first instruction S (the
kernel put S in the signal frame; nothing called it), so S is reached as a return address
and looked up at S - 1. glibc starts `__restore_rt`'s FDE one byte early for this; a
`SIGRETURN` row does the same and covers S - 1 where no CFI covers it or where its CFI row
ends at S (the trampoline right after a function whose FDE ends there, as musl's), and S
where no CFI covers S (an exact pc at the trampoline). A frame looked up at S - 1 from an
exact pc S - 1 reads as the trampoline: that byte is the padding or `nop` before it, which
never runs. `ENTRY` rows are looked up with the same address as every row.

Building reads the module's files; it happens the first time a frame lands in the
module, between two depths of the walk, never inside a step. The tables are cached per
module under CACHE_DIR/cfi/ (one .npz per module, named by Module.cache_key: its build
id and a hash of its files' bytes), with `process --cache-dir`'s directory, none with
`--cache off`. An entry that does not load is rebuilt; one that cannot be written is a
warning, and the table is still used.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from memtrack.addrspace.modules import Module
from memtrack.dwarf.cfi import CFA_EXPR, CFA_NONE, TRACKED, CFITable, Kind, Rule, build_table
from memtrack.elf import ElfImage, ElfReadError

CACHE_VERSION = 6  # bump when the rows built from the same files change
SIGRETURN_CODE = bytes.fromhex("48c7c00f0000000f05")  # mov $15, %rax; syscall
# rt_sigframe: uc_mcontext starts 40 bytes above the sp __restore_rt runs with; its
# register array is r8..r15, rdi, rsi, rbp, rbx, rdx, rax, rcx, rsp, rip.
_SIGCTX = {8: 0, 9: 1, 10: 2, 11: 3, 12: 4, 13: 5, 14: 6, 15: 7, 5: 8, 4: 9, 6: 10, 3: 11,
           1: 12, 0: 13, 2: 14, 7: 15, 16: 16}


def _sleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if (v == 0 and not b & 0x40) or (v == -1 and b & 0x40):
            return bytes(out + bytes([b]))
        out.append(b | 0x80)


# A SIGRETURN row's rules: CFA = the interrupted rsp, every register from uc_mcontext.
SIGRETURN_RULES: dict[str, Any] = {
    "cfa": ["expr", bytes([0x77]) + _sleb(40 + 8 * 15) + bytes([0x06])],
    "regs": {r: [int(Rule.EXPRESSION), bytes([0x77]) + _sleb(40 + 8 * i)]
             for r, i in _SIGCTX.items()},
}


def sigreturn_pcs(elf_path: Path) -> tuple[np.ndarray, list[str]]:
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


def _splice(t: CFITable, lo: int, hi: int, kind: Kind, extra: int) -> CFITable:
    """`t` with one row of `kind` over [lo, hi) (its rules complex_rules[extra], none for
    -1); the row that held hi holds again from hi on."""
    n = len(t)
    a, b = int(np.searchsorted(t.pc, lo)), int(np.searchsorted(t.pc, hi))
    resume = [] if b < n and int(t.pc[b]) == hi else [b - 1 if b > 0 else n + 1]
    take = np.array([*range(a), n, *resume, *range(b, n)], dtype=np.int64)
    k = len(TRACKED)
    same = np.full((2, k), Rule.SAME, np.int8)
    return CFITable(
        pc=np.array([*t.pc[:a].tolist(), lo, *[hi] * len(resume), *t.pc[b:].tolist()],
                    dtype=np.uint64),
        cfa_reg=np.r_[t.cfa_reg, CFA_EXPR if extra >= 0 else CFA_NONE, CFA_NONE
                      ].astype(np.int8)[take],
        cfa_off=np.r_[t.cfa_off, 0, 0].astype(np.int64)[take],
        rule=np.concatenate([t.rule.reshape(-1, k), same])[take],
        off=np.concatenate([t.off.reshape(-1, k), np.zeros((2, k), np.int64)])[take],
        kind=np.r_[t.kind, kind, Kind.FP].astype(np.uint8)[take],
        extra=np.r_[t.extra, extra, -1].astype(np.int32)[take],
        complex_rules=t.complex_rules, problems=t.problems)


def module_table(cfi: CFITable, sigreturn: np.ndarray, entry: np.ndarray) -> CFITable:
    """The unwind table of a module: its CFI rows with ENTRY rows over `entry` ([start,
    end), empty for none) and SIGRETURN rows at the `sigreturn` pcs placed for the lookup
    rule (the module docstring): over S - 1 where no CFI covers it or its row ends at S,
    over S where no CFI covers S. Where both cover an address, SIGRETURN wins."""
    t = CFITable(cfi.pc, cfi.cfa_reg, cfi.cfa_off, cfi.rule, cfi.off, cfi.kind, cfi.extra,
                 list(cfi.complex_rules), cfi.problems)
    if entry[1] > entry[0]:
        t = _splice(t, int(entry[0]), int(entry[1]), Kind.ENTRY, -1)
    s = np.asarray(sigreturn, dtype=np.uint64)
    exact = cfi.lookup(s) < 0
    called = (s > 0) & ((cfi.lookup(s - (s > 0)) < 0) | np.isin(s, cfi.pc))
    if (exact | called).any():
        t.complex_rules.append(SIGRETURN_RULES)
    for pc, at, before in zip(s.tolist(), exact.tolist(), called.tolist(), strict=True):
        if at or before:
            t = _splice(t, pc - before, pc + at, Kind.SIGRETURN, len(t.complex_rules) - 1)
    return t


_memo: dict[str, CFITable] = {}  # by Module.cache_key


def extract(module: Module, cache: Path | None = None) -> CFITable:
    """The unwind table of a module, from memory, the on-disk cache under `cache` (None:
    no disk cache) or its files."""
    key = module.cache_key
    if key is not None and key in _memo:
        return _memo[key]
    cfile = cache / f"{key}.v{CACHE_VERSION}.npz" if cache is not None and key else None
    if cfile is not None and cfile.is_file():
        try:
            with np.load(cfile, allow_pickle=False) as z:
                table = CFITable.from_arrays(z)
            _memo[key] = table  # type: ignore[index]
            return table
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            cfile.unlink(missing_ok=True)
    cfi = build_table(module.elf_path, module.debug_path)
    pcs, problems = sigreturn_pcs(module.elf_path)
    entry, more = entry_code(module.elf_path, cfi)
    cfi.problems += problems + [p for p in more if p not in problems]
    table = module_table(cfi, pcs, entry)
    if key is not None:
        _memo[key] = table
    if cfile is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=".cfi.", suffix=".npz")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **table.arrays())
            os.replace(tmp, cfile)
        except OSError as e:
            table.problems.append(f"{cache}: cannot write the unwind cache "
                                  f"({e.strerror or e}); unwinding goes on without it")
    return table
