"""Where to put an allocator's entry uprobe so that the kernel emulates it.

A uprobe replaces one instruction with int3. On a hit the kernel either *emulates* the
displaced instruction (cheap: about 0.7-0.9 us per hit on our VMs) or copies it to an
out-of-line slot and *single-steps* it there (about 10-11 us per hit: a second trap).
What x86 emulates (arch/x86/kernel/uprobes.c, `branch_setup_xol_ops` and
`push_setup_xol_ops`; checked on this kernel by bench/bench_probes.py and by
tests/test_placement_bpf.py, which measure a bare uprobe on each kind):

- `call rel32`, `jmp rel8/rel32`, `jcc rel8/rel32` (no 0x66 prefix: 16-bit branches
  are refused);
- `push r64` (`50+r`, or `41 50+r` for r8-r15; no other REX);
- nops: `90` with prefixes other than f3 (pause), and the kernel's x86_nops table of
  1-8 byte nops (`66 90`, `0f 1f 00`, `0f 1f 40 00`, `0f 1f 44 00 00`, ...).

Everything else is single-stepped, including `endbr64` (every libstdc++ operator
new/delete starts with it), `test`, `mov` (even `mov %rdi,%rdi`), `sub $n,%rsp` and
`ret`. Instructions with a cs/ds/es/ss or lock prefix cannot be probed at all.

The rule `choose_probe_offset` applies:

1. Offset 0 when the first instruction is emulated.
2. Otherwise walk the fall-through path and put the probe on the first emulated
   instruction, provided every instruction skipped on the way is harmless for the
   probe: it writes no memory, does not call, does not move rsp (the probe reads the
   return address at [rsp] and copies the stack from rsp), and writes no register but
   rax, r10, r11 and the flags. That excludes the argument registers rdi, rsi, rdx,
   rcx, r8, r9 (what the probe records; with `arg_regs` the caller says it reads only
   the first n of them), rsp, and the callee-saved registers the unwinder restores.
   Since the stack pointer is untouched, a uretprobe attached at the same offset also
   finds the return address at [rsp]: attach both there, they then share one
   breakpoint (measured here: entry probe and uretprobe sharing one emulated
   breakpoint cost about what the uretprobe alone costs, while a uretprobe left at a
   single-stepped offset 0 adds a full single-step to every call).
3. A conditional branch on the way is skipped only if its taken path provably emits
   no event: followed instruction by instruction (both ways at each further
   conditional branch, direct jumps followed while they stay inside `code`), every
   path must reach `ret` (or `ud2`) without a call, an indirect or outside jump, a
   memory write, a write to rsp or to a callee-saved register, and without coming back
   to the instructions before the probe. glibc's `free` starts `test %rdi,%rdi; je`
   to a bare `ret` (free(NULL)): that branch is skipped, so free(NULL) costs nothing
   and every other free is probed on the emulated `push` after it.
   When the taken path may allocate (it calls, jumps out, stores, ...), the branch is
   not skipped: if the kernel emulates the branch itself the probe goes *on* it (it
   fires before the branch with the arguments intact, so every call is seen), and
   otherwise (jrcxz, loop, 0x66-prefixed jcc) the choice is offset 0.
4. Anything else ends the walk at offset 0: an instruction that writes an argument
   register, stores, calls indirectly, returns, or cannot be decoded.

Reach: the analysis is intra-procedural over the bytes given. Pass the whole function
(its symbol size) so that taken targets can be followed; a target outside `code` is
treated as one that may allocate. Writes to rax/r10/r11 are allowed because neither
the entry probe nor the unwinder reads them at entry (a variadic function's %al would
be the exception; allocators are not variadic). Emulation facts are those of x86-64
Linux 6.x with the nop-table emulation (6.12+); an older kernel single-steps multi-byte
nops, which costs time but never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import capstone as cs
from capstone import x86 as csx86

from memtrack.elf.image import ElfImage

MAX_WALK = 32  # instructions on the fall-through path before giving up
MAX_PATH = 256  # instructions examined per skipped branch's taken path

# The kernel's x86_nops table (BYTES_NOP1..8 on x86-64), compared byte for byte.
X86_NOPS = frozenset(bytes.fromhex(h) for h in (
    "90", "6690", "0f1f00", "0f1f4000", "0f1f440000", "660f1f440000", "0f1f8000000000",
    "0f1f840000000000",
))
LEGACY_PREFIXES = frozenset(b"\xf0\xf2\xf3\x2e\x36\x3e\x26\x64\x65\x66\x67")
BAD_PREFIXES = frozenset(b"\x26\x2e\x36\x3e\xf0")  # uprobes refuse these outright

ARG_REGS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
CALLEE_SAVED = ("rbx", "rbp", "r12", "r13", "r14", "r15")


def _family(reg64: str) -> frozenset[str]:
    if reg64.startswith("r") and reg64[1:].isdigit():
        return frozenset({reg64, reg64 + "d", reg64 + "w", reg64 + "b"})
    base = reg64[1:]  # "di", "ax", "bp", ...
    names = {reg64, "e" + base, base}
    if base.endswith("x"):
        names |= {base[0] + "l", base[0] + "h"}
    else:
        names.add(base + "l")
    return frozenset(names)


_REG_OWNER = {name: reg for reg in (*ARG_REGS, *CALLEE_SAVED, "rsp", "rax", "r10", "r11")
              for name in _family(reg)}
SCRATCH_WRITES = _family("rax") | _family("r10") | _family("r11") | {"rflags"}
STOPPING_MNEMONICS = frozenset({"ud2"})  # the program dies here: no event follows


@dataclass(frozen=True)
class Placement:
    """The chosen entry-probe offset (bytes into the function) and why."""

    offset: int
    reason: str
    emulated: bool  # the kernel emulates the instruction at `offset` (else single-steps)
    instruction: str = ""  # the instruction at `offset`, as capstone prints it
    skipped: tuple[str, ...] = field(default=())  # instructions the probe no longer sees


def kernel_emulates(raw: bytes) -> bool:
    """True where an x86-64 uprobe on this instruction is emulated, not single-stepped."""
    raw = bytes(raw)
    i = 0
    while i < len(raw) and raw[i] in LEGACY_PREFIXES:
        i += 1
    prefixes = raw[:i]
    if any(p in BAD_PREFIXES for p in prefixes):
        return False
    if raw in X86_NOPS:
        return True
    rex = raw[i] if i < len(raw) and 0x40 <= raw[i] <= 0x4F else None
    body = raw[i + (rex is not None):]
    if not body:
        return False
    op = body[0]
    if op == 0x90 and rex is None:
        return 0xF3 not in prefixes
    if 0x50 <= op <= 0x57:
        return len(raw) == 1 or (len(raw) == 2 and rex == 0x41)
    if 0x66 in prefixes:
        return False
    if op in (0xE8, 0xE9, 0xEB) or 0x70 <= op <= 0x7F:
        return True
    return op == 0x0F and len(body) > 1 and 0x80 <= body[1] <= 0x8F


def _text(insn: cs.CsInsn) -> str:
    return f"{insn.mnemonic} {insn.op_str}".strip()


def _writes(insn: cs.CsInsn) -> tuple[set[str], bool]:
    """Registers written (capstone names, implicit ones too) and whether memory is."""
    _, written = insn.regs_access()
    regs = {insn.reg_name(r) for r in written}
    mem = any(op.type == csx86.X86_OP_MEM and op.access & cs.CS_AC_WRITE
              for op in insn.operands)
    return regs, mem


def _is_branch(insn: cs.CsInsn) -> bool:
    return insn.group(cs.CS_GRP_JUMP)


def _is_conditional(insn: cs.CsInsn) -> bool:
    return _is_branch(insn) and insn.mnemonic != "jmp"


def _direct_target(insn: cs.CsInsn) -> int | None:
    ops = insn.operands
    if len(ops) == 1 and ops[0].type == csx86.X86_OP_IMM:
        return int(ops[0].imm)
    return None


def _clobber(insn: cs.CsInsn, scratch: frozenset[str] = SCRATCH_WRITES) -> str | None:
    """Why skipping `insn` would change what the entry probe sees, or None. `scratch`:
    the registers it may write without that."""
    if insn.group(cs.CS_GRP_CALL):
        return "calls"
    if insn.group(cs.CS_GRP_RET) or insn.group(cs.CS_GRP_IRET):
        return "returns"
    if insn.group(cs.CS_GRP_INT) or insn.group(cs.CS_GRP_PRIVILEGE) or \
            insn.mnemonic in ("syscall", "sysenter"):
        return "traps into the kernel"
    regs, mem = _writes(insn)
    if mem:
        return "writes memory"
    bad = sorted({_REG_OWNER.get(r, r) for r in regs - scratch})
    if bad:
        kind = ("an argument register" if bad[0] in ARG_REGS else
                "the stack pointer" if bad[0] == "rsp" else "a register the unwinder needs"
                if bad[0] in CALLEE_SAVED else "a register")
        return f"writes {bad[0]} ({kind})"
    return None


class _Code:
    """Decoded instructions of one function, by offset, decoded on demand."""

    def __init__(self, code: bytes, func_vaddr: int) -> None:
        self.code = code
        self.base = func_vaddr
        self.md = cs.Cs(cs.CS_ARCH_X86, cs.CS_MODE_64)
        self.md.detail = True
        self._cache: dict[int, cs.CsInsn | None] = {}

    def at(self, off: int) -> cs.CsInsn | None:
        if off not in self._cache:
            insn = None
            if 0 <= off < len(self.code):
                insn = next(self.md.disasm(self.code[off:off + 16], self.base + off, 1), None)
            self._cache[off] = insn
        return self._cache[off]

    def silent_path(self, start: int, before: int) -> tuple[bool, str]:
        """Whether every path from `start` returns without emitting an event.

        `before`: offsets below it (the prologue walked so far) must not be reached.
        """
        todo, seen = [start], set()
        while todo:
            off = todo.pop()
            if off in seen:
                continue
            if len(seen) >= MAX_PATH:
                return False, "taken path too long to follow"
            seen.add(off)
            if 0 <= off < before:
                return False, f"taken path comes back to +{off:#x}"
            insn = self.at(off)
            if insn is None:
                return False, f"taken path leaves the code given at +{off:#x}"
            if insn.group(cs.CS_GRP_RET) or insn.mnemonic in STOPPING_MNEMONICS:
                continue
            nxt = off + insn.size
            if _is_branch(insn):
                target = _direct_target(insn)
                if target is None:
                    return False, f"taken path jumps indirectly ({_text(insn)})"
                todo.append(target - self.base)
                if _is_conditional(insn):
                    todo.append(nxt)
                continue
            why = _path_clobber(insn)
            if why:
                return False, f"taken path {why} ({_text(insn)} at +{off:#x})"
            todo.append(nxt)
        return True, "taken path returns without a call or a store"


def _path_clobber(insn: cs.CsInsn) -> str | None:
    """Why `insn`, on a path that should return quietly, might emit an event."""
    if insn.group(cs.CS_GRP_CALL):
        return "calls"
    if insn.group(cs.CS_GRP_INT) or insn.group(cs.CS_GRP_IRET) or \
            insn.group(cs.CS_GRP_PRIVILEGE) or insn.mnemonic in ("syscall", "sysenter"):
        return "traps into the kernel"
    regs, mem = _writes(insn)
    if mem:
        return "writes memory"
    owners = {_REG_OWNER.get(r, r) for r in regs}
    for reg in ("rsp", *CALLEE_SAVED):
        if reg in owners:
            return f"writes {reg}"
    return None


def choose_probe_offset(code: bytes, func_vaddr: int, *, name: str,
                        arg_regs: int = len(ARG_REGS)) -> Placement:
    """Choose the entry-probe offset in a function whose machine code is `code`.

    `code` should be the whole function (from its symbol's value, st_size bytes) and
    `func_vaddr` its address (only used to resolve branch targets). `arg_regs`: how many
    integer argument registers (rdi, rsi, rdx, rcx, r8, r9 in that order) the entry
    probe reads; the others may be overwritten by skipped instructions (a probe that
    reads only malloc's size passes 1, which lets the placement go past e.g. mimalloc's
    `mov %rdi,%rsi`). The default, all six, is always safe. See the module docstring
    for the rule; `.reason` says what was decided and why, for `--verbose` logs and the
    manifest.
    """
    if not 0 <= arg_regs <= len(ARG_REGS):
        raise ValueError(f"arg_regs {arg_regs}: expected 0..{len(ARG_REGS)}")
    scratch = SCRATCH_WRITES.union(*(_family(r) for r in ARG_REGS[arg_regs:]))
    fn = _Code(code, func_vaddr)
    first = fn.at(0)
    if first is None:
        return Placement(0, f"{name}: cannot decode the first instruction; offset 0", False)
    if kernel_emulates(first.bytes):
        return Placement(0, f"{name}: {_text(first)} at +0 is emulated", True, _text(first))

    def at_zero(why: str) -> Placement:
        return Placement(0, f"{name}: {_text(first)} at +0 is single-stepped; {why}; "
                            "offset 0", False, _text(first))

    skipped: list[str] = []
    notes: list[str] = []
    off = 0
    for _ in range(MAX_WALK):
        insn = fn.at(off)
        if insn is None:
            return at_zero(f"nothing decodable at +{off:#x}")
        text = _text(insn)
        where = "it" if off == 0 else f"{text} at +{off:#x}"
        if _is_conditional(insn):
            regs, _ = _writes(insn)
            if regs - scratch:  # loop/loope/loopne count down rcx
                return at_zero(f"{where} {_clobber(insn, scratch)}")
            target = _direct_target(insn)
            ok, why = (fn.silent_path(target - func_vaddr, off + insn.size)
                       if target is not None else (False, "indirect branch"))
            if ok:
                skipped.append(text)
                notes.append(f"{text} at +{off:#x}: {why}")
                off += insn.size
                continue
            if kernel_emulates(insn.bytes):
                return _chosen(name, off, insn, skipped,
                               notes + [f"not skipping {text}: {why}"])
            return at_zero(f"{where} is not emulated and its {why}")
        if kernel_emulates(insn.bytes):
            return _chosen(name, off, insn, skipped, notes)
        if _is_branch(insn):
            return at_zero(f"{where} is an unemulated jump")
        why = _clobber(insn, scratch)
        if why:
            return at_zero(f"{where} {why}")
        skipped.append(text)
        off += insn.size
    return at_zero(f"no emulated instruction in the first {MAX_WALK}")


def _chosen(name: str, off: int, insn: cs.CsInsn, skipped: list[str],
            notes: list[str]) -> Placement:
    text = _text(insn)
    reason = f"{name}: {text} at +{off:#x} is emulated; skipped {'; '.join(skipped)}"
    if notes:
        reason += " (" + "; ".join(notes) + ")"
    return Placement(off, reason, True, text, tuple(skipped))


def function_code(path: str | Path, symbol: str) -> tuple[bytes, int]:
    """The machine code of `symbol` in ELF file `path` (st_size bytes) and its address;
    ValueError when the symbol is missing or not in a loaded segment."""
    with ElfImage(path) as img:
        return img.function_code(symbol)


def place_symbol(path: str | Path, symbol: str) -> Placement:
    """`choose_probe_offset` for a function named in an ELF file."""
    code, vaddr = function_code(path, symbol)
    return choose_probe_offset(code, vaddr, name=symbol)
