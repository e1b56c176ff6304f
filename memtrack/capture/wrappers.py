"""Allocator wrappers: functions whose allocation is a call of another probed allocator,
recorded at that inner call instead of being probed themselves.

libstdc++'s `operator new` is `malloc` in a loop that calls the new-handler; probing
both takes four traps per `new` (two entries, two returns) where two say everything.
So a wrapper is left unprobed and the call sites it allocates through are registered
with the BPF program (bpf/alloc.c `mt_wrap_sites`, keyed by each site's return address
in each process): when the inner function's entry probe finds a registered site at
[sp], the allocation takes the wrapper's family and its stack is taken as at the
wrapper's entry (sp above the wrapper's frame, ip at its start, the callee-saved
registers it pushed read back from the stack): the events and stacks are those the
wrapper's own probe would give. Chains (nothrow `new` -> `new` -> `malloc`) are
followed a few levels. Frees that only jump to another probed free of the module
(`operator delete[](void*)` -> `operator delete(void*)`, and the sized deletes
`operator delete(void*, size_t)` -> `operator delete(void*)`) are left unprobed too:
the jump's target reports the same pointer, in the same family. Their free events then
carry size 0, as an unsized delete's do: the block's size is the allocation's, which
pairing gives; a trap per sized delete (most deletes of C++14 code) is not worth the
copy. Every free that reaches `free` itself keeps its probe: at `free` nothing else
tells a delete from a C `free` (deletes tail-call it).

Only the C++ runtime's own functions are treated so (libstdc++, libc++: code whose
shape is known); a program's own `operator new` may allocate without malloc and stays
probed. A function is a wrapper when its code, disassembled, allocates only through
direct calls and jumps (PLT stubs included) to probed allocating functions that keep
the size (malloc-shaped), and the path from its entry to each such call is straight
code that moves rsp by pushes and immediate adds and subtracts alone, saves at most
two callee-saved registers other than rbp (the kernel's frame-pointer chain of a cut
copy starts from the live rbp), and has no branch. Anything else keeps its probe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import capstone as cs
from capstone import x86 as csx86

from memtrack.capture.allocators import CXX_NAMES, ElfInfo, Probe
from memtrack.elf.image import ElfImage, ElfReadError
from memtrack.schema import Allocator

# the modules whose wrappers are known (file names, versions after .so)
RUNTIME_FILES = re.compile(r"^lib(std)?c\+\+\.so(\.|$)")
MALLOC_SHAPED = frozenset({"malloc"} | {n for n, s in CXX_NAMES.items() if s == "malloc"})
MAX_SAVED = 2  # bpf/alloc.c struct mt_wrap
# DWARF numbers of the callee-saved registers a wrapper may push (rbp excluded)
_SAVED_DWARF = {"rbx": 3, "r12": 12, "r13": 13, "r14": 14, "r15": 15}


@dataclass(frozen=True)
class Site:
    """A call of a probed allocator inside a wrapper, as bpf/alloc.c needs it."""

    function: str  # the wrapper
    family: Allocator  # the wrapper's
    offset: int  # file offset of the return address (the instruction after the call)
    delta: int  # bytes from the wrapper's start to the return address
    cfa: int  # CFA - rsp at the return address
    saved: tuple[tuple[int, int], ...]  # (DWARF register, offset from the CFA) pushed


@dataclass
class Wrapping:
    """What a module's wrappers change: the probes left out (name -> why) and the
    call sites to register in each process that maps the module."""

    unprobed: dict[str, str]
    sites: list[Site]


def _resolve(img: ElfImage, md: cs.Cs, target: int, names: dict[int, str],
             slots: dict[int, str]) -> str | None:
    """The function a direct call or jump to `target` reaches: a function of the module
    by its address, or the symbol a PLT stub's GOT slot is bound to."""
    if target in names:
        return names[target]
    for insn in md.disasm(img.code(target, 16), target, 2):
        if insn.mnemonic == "endbr64":
            continue
        if insn.mnemonic in ("jmp", "bnd jmp") and len(insn.operands) == 1:
            op = insn.operands[0]
            if op.type == csx86.X86_OP_MEM and op.mem.base == csx86.X86_REG_RIP:
                return slots.get(insn.address + insn.size + op.mem.disp)
        return None
    return None


def _frame_at(insns: list[cs.CsInsn]) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """(CFA - rsp, pushed callee-saved registers) after the straight code `insns` from a
    function's entry and a call at their end; None when it does not qualify."""
    depth = 0  # bytes pushed below the return address
    saved: list[tuple[int, int]] = []
    for insn in insns:
        m, ops = insn.mnemonic, insn.operands
        if insn.group(cs.CS_GRP_JUMP) or insn.group(cs.CS_GRP_RET) or \
                insn.group(cs.CS_GRP_CALL):
            return None
        if m == "push" and ops[0].type == csx86.X86_OP_REG:
            depth += 8
            reg = insn.reg_name(ops[0].reg)
            if reg in _SAVED_DWARF and all(r != _SAVED_DWARF[reg] for r, _ in saved):
                saved.append((_SAVED_DWARF[reg], -8 - depth))
            elif reg == "rbp":
                return None
            continue
        if m in ("sub", "add") and ops[0].type == csx86.X86_OP_REG and \
                insn.reg_name(ops[0].reg) == "rsp" and ops[1].type == csx86.X86_OP_IMM:
            depth += ops[1].imm if m == "sub" else -ops[1].imm
            continue
        _, written = insn.regs_access()
        if any(insn.reg_name(r) in ("rsp", "esp", "rbp", "ebp") for r in written) or \
                m == "pop":
            return None
    if depth < 0 or depth % 8 or len(saved) > MAX_SAVED:
        return None
    return 8 + depth, tuple(saved)


def find_wrappers(path: str | Path, mapped_path: str, info: ElfInfo, probes: list[Probe]
                  ) -> Wrapping:
    """The wrappers among a C++ runtime's probes (nothing for any other module): the
    file read at `path`, named `mapped_path` in the process."""
    none = Wrapping({}, [])
    if not RUNTIME_FILES.match(Path(mapped_path).name):
        return none
    probed = {p.name: p for p in probes}
    names = {p.vaddr: p.name for p in probes}
    md = cs.Cs(cs.CS_ARCH_X86, cs.CS_MODE_64)
    md.detail = True
    try:
        with ElfImage(path) as img:
            slots = img.import_slots()
            out = Wrapping({}, [])
            for p in probes:
                code = img.code(p.vaddr, p.size)
                if not code or len(code) < p.size:
                    continue
                insns = list(md.disasm(code, p.vaddr))
                if not insns or insns[-1].address + insns[-1].size != p.vaddr + p.size:
                    continue  # not all of it decodes: keep the probe
                if p.is_free:
                    why = _free_jump(img, md, p, names, slots, probed)
                    if why:
                        out.unprobed[p.name] = why
                    continue
                if p.name in CXX_NAMES and p.shape == "malloc":
                    sites = _calls(img, md, p, insns, names, slots)
                    if sites is not None:
                        out.sites += sites
                        out.unprobed[p.name] = (
                            "not probed: recorded at the allocator it calls" +
                            (f" (returning to +{', +'.join(f'{s.delta:#x}' for s in sites)})"
                             if sites else " (a tail call)"))
            return out
    except ElfReadError:
        return none


def _calls(img: ElfImage, md: cs.Cs, p: Probe, insns: list[cs.CsInsn],
           names: dict[int, str], slots: dict[int, str]) -> list[Site] | None:
    """The sites of a wrapper `p` (empty: it only tail-calls one), or None when `p`
    is not one."""
    sites: list[Site] = []
    allocates = False
    for i, insn in enumerate(insns):
        ops = insn.operands
        call, jump = insn.group(cs.CS_GRP_CALL), insn.mnemonic == "jmp"
        if not (call or jump) or len(ops) != 1 or ops[0].type != csx86.X86_OP_IMM:
            continue
        target = int(ops[0].imm)
        if p.vaddr <= target < p.vaddr + p.size:
            continue  # a jump inside the function
        name = _resolve(img, md, target, names, slots)
        if name not in MALLOC_SHAPED:
            continue  # the new-handler, a throw: no allocation
        allocates = True
        if jump:
            continue
        frame = _frame_at(insns[:i])
        ret = insn.address + insn.size
        offset = img.segments.vaddr_to_offset(ret)
        if frame is None or offset is None:
            return None
        sites.append(Site(p.name, p.family, offset, ret - p.vaddr, frame[0], frame[1]))
    return sites if allocates else None


def _jump_of(img: ElfImage, md: cs.Cs, p: Probe, names: dict[int, str],
             slots: dict[int, str], probed: dict[str, Probe]) -> Probe | None:
    """The probed free `p`'s code only jumps to (it is `[endbr64] jmp F`), or None."""
    code = img.code(p.vaddr, p.size)
    body = [i for i in md.disasm(code, p.vaddr) if i.mnemonic not in ("endbr64", "nop")]
    if not body or body[0].mnemonic != "jmp" or len(body[0].operands) != 1 or \
            body[0].operands[0].type != csx86.X86_OP_IMM:
        return None
    target = probed.get(_resolve(img, md, int(body[0].operands[0].imm), names, slots) or "")
    return target if target is not None and target.is_free and target is not p else None


def _free_jump(img: ElfImage, md: cs.Cs, p: Probe, names: dict[int, str],
               slots: dict[int, str], probed: dict[str, Probe]) -> str | None:
    """Why a free is left unprobed (its code only jumps, through other such frees, to a
    probed free of the module that reports the same pointer), or None."""
    seen = {p.name}
    end = _jump_of(img, md, p, names, slots, probed)
    while end is not None:
        nxt = _jump_of(img, md, end, names, slots, probed)
        if nxt is None:
            return f"not probed: a jump to {end.name}, which reports the free"
        if nxt.name in seen:
            return None
        seen.add(end.name)
        end = nxt
    return None
