"""Frame 0 without CFI: how to step out of the allocator's own frame where no FDE covers
its pc (hand-written assembly, a stripped .eh_frame), from the code at the pc and the
straight-line code from the function's start to it.

Only frame 0 needs this (its pc is the exact instruction the probe interrupted; every
other frame is at a return address). Its rows are extracted up front, one per stack,
before the walk starts: disassembly (capstone) happens here, never in a step.

They are not rows of the module's unwind table (memtrack.process.unwind.tables): each
holds at one exact pc only, is found by disassembling the code up to that pc, and is
needed only where a stack starts in an FP row; the table is built once per module from
its files, before any stack is known. The walk uses them for frame 0 in an FP row.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from memtrack.addrspace.modules import Module
from memtrack.dwarf.cfi import RBP
from memtrack.elf import ElfImage, ElfReadError

PROLOGUE_MAX = 256  # bytes from a function's start simulated for frame 0 without CFI
_REGNUM = {"rbx": 3, "rbp": RBP, "r12": 12, "r13": 13, "r14": 14, "r15": 15}


def frame0_rule(code: bytes, prologue: bytes | None) -> tuple[int, dict[int, int]] | None:
    """How to step out of frame 0 where no CFI covers it, from the code at the pc and
    (when the function's start is known) the straight-line code before it:
    (CFA = rsp + k, {register: its slot's offset from the CFA}), or None where rbp is
    the frame (the frame-pointer rule)."""
    import capstone

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    here = [f"{i.mnemonic} {i.op_str}".strip() for i in md.disasm(code, 0, 2)]
    if here[:1] == ["ret"]:
        return 8, {}
    if here[:2] == ["pop rbp", "ret"]:
        return 16, {RBP: -16}
    if prologue is None:
        if here[:1] in (["endbr64"], ["push rbp"]):
            return 8, {}
        if here[:1] == ["mov rbp, rsp"]:
            return 16, {RBP: -16}
        return None
    pushed = 0
    saved: dict[int, int] = {}
    done = 0
    for insn in md.disasm(prologue, 0):
        done = insn.address + insn.size
        text = f"{insn.mnemonic} {insn.op_str}".strip()
        ops = insn.op_str.split(", ")
        if text == "mov rbp, rsp":
            return None
        if insn.mnemonic == "push":
            pushed += 8
            if ops[0] in _REGNUM:
                saved.setdefault(_REGNUM[ops[0]], -8 - pushed)
        elif insn.mnemonic in ("sub", "add") and ops[0] == "rsp" and len(ops) == 2:
            try:
                k = int(ops[1], 0)
            except ValueError:
                return None
            pushed += k if insn.mnemonic == "sub" else -k
        elif insn.mnemonic in ("endbr64", "nop") or (insn.mnemonic == "mov"
                                                     and ops[0] not in ("rsp", "rbp")):
            continue
        else:
            return None  # a branch or anything else: not a straight prologue
    if done != len(prologue):
        return None
    return 8 + pushed, saved


@functools.lru_cache(maxsize=64)
def function_starts(elf_path: Path, debug_path: Path | None) -> np.ndarray:
    """Sorted start addresses of a module's functions (its debug file's too): the symbol
    tables the symbolizer names frames from."""
    starts = [np.zeros(0, np.uint64)]
    for path in (elf_path, debug_path):
        if path is None:
            continue
        try:
            with ElfImage(path) as image:
                starts.append(image.symbol_table()[0].start)
        except ElfReadError:
            continue
    return np.unique(np.concatenate(starts)).astype(np.int64)


def frame0_rows(modules: list[Module | None], module: np.ndarray, vaddr: np.ndarray
                ) -> dict[int, tuple[int, dict[int, int]]]:
    """The frame-0 rule of each entry (index -> rule) whose module is known, for pcs no
    CFI row covers (the caller picks them); entries where rbp is the frame are left out."""
    out: dict[int, tuple[int, dict[int, int]]] = {}
    images: dict[int, ElfImage | None] = {}
    try:
        for j, (m, pc) in enumerate(zip(module.tolist(), vaddr.tolist(), strict=True)):
            mod = modules[m] if m >= 0 else None
            if mod is None or pc < 0:
                continue
            if m not in images:
                try:
                    images[m] = ElfImage(mod.elf_path)
                except ElfReadError:
                    images[m] = None
            img = images[m]
            if img is None:
                continue
            prologue = None
            starts = function_starts(mod.elf_path, mod.debug_path)
            k = int(np.searchsorted(starts, pc, side="right")) - 1
            if k >= 0 and pc - int(starts[k]) <= PROLOGUE_MAX:
                n = pc - int(starts[k])
                prologue = img.code(pc - n, n) if n else b""
            rule = frame0_rule(img.code(pc, 16), prologue)
            if rule is not None:
                out[j] = rule
    finally:
        for img in images.values():
            if img is not None:
                img.close()
    return out
