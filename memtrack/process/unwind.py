"""Offline unwinding: DWARF CFI, frame-pointer fallback, then the kernel's chain.

All stacks advance in lockstep, one frame depth at a time, with numpy: the registers of
every live stack are one (n, 17) array, each step looks the CFI row of every pc up per
module with one searchsorted, and reads the saved registers out of the stack copies
with one gather. Rows that need more than "CFA = rsp|rbp + k, registers at CFA + k"
(DWARF expressions: PLT entries, signal trampolines; a CFA on another register) take a
per-stack path through the DWARF expression evaluator. Where no CFI covers a pc the
step follows the frame pointer (for the first frame capstone first tells whether the
pc is in a prologue or epilogue where rbp is not the frame yet or any more); where the
copied bytes end, the kernel's frame-pointer chain continues the stack.

Stop rules: RA undefined (`_start`, thread start: the stack is complete), the CFA does
not advance, a read above the end of a copy the budget cut (truncated; above a copy that
reached the stack's end it is a bad address), a return address outside every executable
mapping (unknown mapping, and no frame: a stack record keeps only the words pointing
into code or stacks, so any other value must end the stack the same way), a pc outside
any file-backed mapping (unknown mapping, after its frame).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.process.addrspace import AddressSpaces
from memtrack.schema import NUM_REGS
from memtrack.symbolize.cfi import (
    COMPLEX,
    RBP,
    RIP,
    RSP,
    SIGNAL,
    TRACKED,
    CFITable,
    Rule,
    load_table,
)
from memtrack.symbolize.dwarfexpr import DwarfExprError, evaluate
from memtrack.symbolize.modules import Module, ModuleError, ModuleStore
from memtrack.symbolize.symtab import ElfImage, ElfReadError

METHODS = ("regs", "cfi", "fp", "fp-kernel")
M_REGS, M_CFI, M_FP, M_KERNEL = range(4)

STOPS = ("", "complete", "truncated", "unknown-mapping", "no-advance", "no-rule",
         "bad-register", "bad-address", "bad-expression", "max-depth", "null-return")
(S_NONE, S_COMPLETE, S_TRUNCATED, S_UNKNOWN, S_NO_ADVANCE, S_NO_RULE, S_BAD_REG,
 S_BAD_ADDR, S_BAD_EXPR, S_MAX_DEPTH, S_NULL) = range(len(STOPS))

FRAMES = pa.schema([
    ("stack_hash", pa.uint64()),
    ("pid", pa.uint32()),
    ("depth", pa.uint16()),
    ("address", pa.uint64()),
    ("method", pa.string()),
    ("build_id", pa.string()),
    ("path", pa.string()),
    ("lookup_vaddr", pa.uint64()),
])
STACKS = pa.schema([
    ("stack_hash", pa.uint64()),
    ("pid", pa.uint32()),
    ("depth", pa.uint16()),  # number of frames
    ("truncated", pa.bool_()),  # the unwinder needed bytes beyond the copy
    ("complete", pa.bool_()),  # reached _start / a thread start (RA undefined)
    ("stop", pa.string()),  # why the in-copy unwinding ended (STOPS)
])

CALLER_SAVED = (0, 1, 2, 4, 5, 8, 9, 10, 11)
# rt_sigframe: uc_mcontext starts 40 bytes above the sp __restore_rt runs with; its
# register array is r8..r15, rdi, rsi, rbp, rbx, rdx, rax, rcx, rsp, rip.
_SIGCTX = {8: 0, 9: 1, 10: 2, 11: 3, 12: 4, 13: 5, 14: 6, 15: 7, 5: 8, 4: 9, 6: 10, 3: 11,
           1: 12, 0: 13, 2: 14, 7: 15, 16: 16}
SIGRETURN_CODE = bytes.fromhex("48c7c00f0000000f05")  # mov $15, %rax; syscall


def _sleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if (v == 0 and not b & 0x40) or (v == -1 and b & 0x40):
            return bytes(out + bytes([b]))
        out.append(b | 0x80)


SIGRETURN_RULES: dict[str, Any] = {
    "cfa": ["expr", bytes([0x77]) + _sleb(40 + 8 * 15) + bytes([0x06])],
    "regs": {r: [int(Rule.EXPRESSION), bytes([0x77]) + _sleb(40 + 8 * i)]
             for r, i in _SIGCTX.items()},
}

_SAME, _OFFSET, _UNDEFINED, _VAL_OFFSET = (int(Rule.SAME), int(Rule.OFFSET),
                                          int(Rule.UNDEFINED), int(Rule.VAL_OFFSET))

# The frame-pointer step as a compact CFI row: CFA = rbp + 16, RA at CFA - 8, rbp at
# CFA - 16; other callee-saved registers are unknown afterwards.
_K = len(TRACKED)
_FP_RULE = np.array([Rule.OFFSET, *[Rule.UNDEFINED] * (_K - 1)], dtype=np.int8)
_FP_RULE[TRACKED.index(RBP)] = Rule.OFFSET
_FP_OFF = np.zeros(_K, dtype=np.int64)
_FP_OFF[0] = -8
_FP_OFF[TRACKED.index(RBP)] = -16


@dataclass
class UnwoundStacks:
    frames: pa.Table
    stacks: pa.Table
    counters: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # modules that could not be used


@dataclass
class _Mod:
    module: Module | None
    cfi: CFITable | None
    problem: str = ""


class _Memory:
    """The stack copies of all stacks, one byte array, read by (stack, address)."""

    def __init__(self, stacks: pa.Table, sel: np.ndarray) -> None:
        col = stacks.column("stack").combine_chunks().take(pa.array(sel))
        col = col.cast(pa.large_binary())
        bufs = col.buffers()
        offs = np.frombuffer(bufs[1], dtype=np.int64)[col.offset:col.offset + len(col) + 1] \
            if len(col) else np.zeros(1, np.int64)
        self.buf = np.frombuffer(bufs[2], dtype=np.uint8) if len(col) and bufs[2] is not None \
            else np.zeros(0, np.uint8)
        self.base = offs[:-1].astype(np.int64)
        self.ln = (offs[1:] - offs[:-1]).astype(np.uint64)
        self.sp = stacks.column("sp").to_numpy()[sel].astype(np.uint64)
        self.cut = stacks.column("truncated").to_numpy(zero_copy_only=False)[sel]

    def read(self, idx: np.ndarray, addr: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                               np.ndarray]:
        """(value, ok, beyond): 8 bytes at each address of each stack's copy; `beyond`
        where the address is above the end of a copy the budget cut (above a copy that
        reached the stack's end there is no stack: a bad address)."""
        sp = self.sp[idx]
        ln = self.ln[idx]
        above = addr >= sp
        off = addr - sp
        ok = above & (off < ln) & (ln - off >= np.uint64(8))
        beyond = above & ~ok & self.cut[idx]
        val = np.zeros(len(idx), dtype=np.uint64)
        if ok.any():
            pos = self.base[idx[ok]] + off[ok].astype(np.int64)
            b = self.buf[pos[:, None] + np.arange(8)]
            val[ok] = np.ascontiguousarray(b).view("<u8").ravel()
        return val, ok, beyond

    def read_one(self, i: int, addr: int, size: int) -> int:
        off = addr - int(self.sp[i])
        if off < 0 or off + size > int(self.ln[i]):
            if off >= 0 and self.cut[i]:
                raise _Beyond(addr)
            raise DwarfExprError(f"{addr:#x} outside the copy")
        p = int(self.base[i]) + off
        return int.from_bytes(self.buf[p:p + size].tobytes(), "little")


class _Beyond(DwarfExprError):
    """A read above the end of the stack copy."""


class _Unwinder:
    def __init__(self, stacks: pa.Table, mappings: pa.Table, store: ModuleStore,
                 max_depth: int) -> None:
        keys = np.stack([stacks.column("hash").to_numpy().astype(np.uint64),
                         stacks.column("pid").to_numpy().astype(np.uint64)], axis=1)
        _, first = np.unique(keys, axis=0, return_index=True)
        sel = np.sort(first).astype(np.int64)
        self.n = n = len(sel)
        self.hash = stacks.column("hash").to_numpy()[sel].astype(np.uint64)
        self.pid = stacks.column("pid").to_numpy()[sel].astype(np.uint32)
        ts = stacks.column("ts").to_numpy()[sel].astype(np.uint64)
        regs_col = stacks.column("regs").combine_chunks()
        flat = regs_col.flatten().to_numpy(zero_copy_only=False).astype(np.uint64)
        self.regs = flat.reshape(-1, NUM_REGS)[sel].copy() if n else np.zeros(
            (0, NUM_REGS), np.uint64)
        # At an allocator's entry the caller-saved registers are dead (its CFA is rsp + 8):
        # stack records do not keep them, so no rule may read them.
        self.valid = np.ones((n, NUM_REGS), dtype=bool)
        self.valid[:, list(CALLER_SAVED)] = False
        fpc = pc.fill_null(stacks.column("fp_chain"), pa.scalar([], pa.list_(pa.uint64())))
        fpc = fpc.combine_chunks().take(pa.array(sel))
        self.fp_offsets = fpc.offsets.to_numpy().astype(np.int64)
        self.fp_values = fpc.values.to_numpy(zero_copy_only=False).astype(np.uint64)
        self.mem = _Memory(stacks, sel)
        self.spaces = AddressSpaces(mappings)
        self.snap = self.spaces.snapshot_of(self.pid, ts)
        self.store = store
        self.max_depth = max_depth
        self.mods: list[_Mod] = []
        self._mod_of_bid = np.full(len(self.spaces.bid_values), -2, dtype=np.int64)
        self.counters: dict[str, int] = {"unwind_stacks": n, "unwind_expr_rows": 0,
                                         "unwind_sigreturn_by_code": 0,
                                         "unwind_kernel_frames": 0,
                                         "unwind_stacks_fp_kernel": 0}
        # Frames, appended per depth: parallel lists of arrays.
        self.f_stack: list[np.ndarray] = []
        self.f_depth: list[np.ndarray] = []
        self.f_addr: list[np.ndarray] = []
        self.f_method: list[np.ndarray] = []
        self.f_row: list[np.ndarray] = []
        self.f_lookup: list[np.ndarray] = []
        self.nframes = np.zeros(n, dtype=np.int64)
        self.last_addr = np.zeros(n, dtype=np.uint64)
        self.stop = np.zeros(n, dtype=np.int8)

    # -- modules ---------------------------------------------------------------------
    def _module_rows(self, row: np.ndarray) -> np.ndarray:
        """Module index (into self.mods) of each mapping row; -1 none/unreadable."""
        out = np.full(len(row), -1, dtype=np.int64)
        ok = row >= 0
        bi = self.spaces.bid_index[row[ok]]
        for b in np.unique(bi[(bi >= 0) & (self._mod_of_bid[np.maximum(bi, 0)] == -2)]):
            bid = self.spaces.bid_values[b]
            self._mod_of_bid[b] = len(self.mods)
            self.mods.append(self._open(bid, self.spaces.bid_path[b]))
        out[ok] = np.where(bi >= 0, self._mod_of_bid[np.maximum(bi, 0)], -1)
        return out

    def _open(self, bid: str, path: str | None) -> _Mod:
        mod = self.store.get(bid, path)
        if mod is None:
            return _Mod(None, None, f"module {bid} ({path}) is not available")
        try:
            table = load_table(bid, mod.elf_path, mod.debug_path)
        except OSError as e:
            return _Mod(mod, None, f"{mod.elf_path}: {e}")
        return _Mod(mod, table)

    def _resolve(self, idx: np.ndarray, addr: np.ndarray, minus1: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(mapping row, module, vaddr (int64, -1 unknown), lookup vaddr) per address."""
        row = self.spaces.find(self.snap[idx], addr)
        mod = self._module_rows(row)
        vaddr = np.full(len(idx), -1, dtype=np.int64)
        foff = self.spaces.file_offset(row, addr)
        for m in np.unique(mod[mod >= 0]).tolist():
            sel = np.flatnonzero(mod == m)
            module = self.mods[m].module
            if module is None:
                continue
            try:
                vaddr[sel] = module.file_offset_to_vaddr(foff[sel])
            except ModuleError as e:
                self.mods[m] = _Mod(None, None, str(e))
        lookup = np.where(vaddr >= 0, vaddr - minus1.astype(np.int64), -1)
        return row, mod, vaddr, lookup

    # -- the lockstep loop -------------------------------------------------------------
    def run(self) -> None:
        active = np.arange(self.n, dtype=np.int64)
        method = np.full(self.n, M_REGS, dtype=np.int8)
        minus1 = np.zeros(self.n, dtype=bool)
        depth = 0
        while len(active):
            if depth >= self.max_depth:
                self.stop[active] = S_MAX_DEPTH
                break
            pcs = self.regs[active, RIP]
            row, mod, _vaddr, lookup = self._resolve(active, pcs, minus1[active])
            if depth:
                # A return address outside every executable mapping is not a frame
                # (the skeleton reads it as 0 unless it points into a kept region).
                code = row >= 0
                code[code] = self.spaces.executable[row[code]]
                self.stop[active[~code]] = S_UNKNOWN
                active, pcs, row, mod, lookup = (
                    active[code], pcs[code], row[code], mod[code], lookup[code])
            self._emit(active, depth, pcs, method[active], row, lookup)
            known = row >= 0
            known[known] = self.spaces.file_backed[row[known]] | self.spaces.is_vdso[
                row[known]]
            self.stop[active[~known]] = S_UNKNOWN
            stepped = np.flatnonzero(known)
            active, mod, lookup, row, pcs = (
                active[known], mod[known], lookup[known], row[known], pcs[known])
            nxt_method, nxt_minus1 = self._step(active, mod, lookup, row, pcs, depth,
                                                minus1[active])
            # A signal trampoline is not called: the handler returns to its first
            # instruction. Its CFI is found at pc - 1 (glibc starts the FDE a byte early),
            # but it is named at pc.
            tramp = ~nxt_minus1 & minus1[active] & (lookup >= 0)
            self.f_lookup[-1][stepped[tramp]] += 1
            method[active] = nxt_method
            minus1[active] = nxt_minus1
            active = active[self.stop[active] == S_NONE]
            depth += 1
        self._kernel_chains()

    def _emit(self, idx: np.ndarray, depth: int, addr: np.ndarray, method: np.ndarray,
              row: np.ndarray, lookup: np.ndarray) -> None:
        self.f_stack.append(idx)
        self.f_depth.append(np.full(len(idx), depth, dtype=np.int64))
        self.f_addr.append(addr.copy())
        self.f_method.append(method.astype(np.int8))
        self.f_row.append(row)
        self.f_lookup.append(lookup)
        self.nframes[idx] = depth + 1
        self.last_addr[idx] = addr

    def _step(self, idx: np.ndarray, mod: np.ndarray, lookup: np.ndarray, row: np.ndarray,
              pcs: np.ndarray, depth: int, was_minus1: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        """Advance each stack by one frame; return (method, pc-1 lookup) of the next."""
        n = len(idx)
        edge = np.zeros(n, dtype=bool)
        crow = np.full(n, -1, dtype=np.int64)
        cfa_reg = np.full(n, RBP, dtype=np.int64)
        cfa_off = np.full(n, 16, dtype=np.int64)
        rule = np.tile(_FP_RULE, (n, 1))
        off = np.tile(_FP_OFF, (n, 1))
        flags = np.zeros(n, dtype=np.uint8)
        tables: list[CFITable | None] = [None] * n
        for m in np.unique(mod[mod >= 0]).tolist():
            t = self.mods[m].cfi
            if t is None or len(t) == 0:
                continue
            sel = np.flatnonzero((mod == m) & (lookup >= 0))
            r = t.lookup(lookup[sel].astype(np.uint64))
            hit = r >= 0
            s, r = sel[hit], r[hit]
            crow[s] = r
            cfa_reg[s] = t.cfa_reg[r]
            cfa_off[s] = t.cfa_off[r]
            rule[s] = t.rule[r]
            off[s] = t.off[r]
            flags[s] = t.flags[r]
            for j in s[(t.flags[r] & COMPLEX) != 0].tolist():
                tables[j] = t
            # pc - 1 in the last row of an FDE that ends at pc: the pc may be a signal
            # trampoline without CFI right after that function (musl's __restore_rt).
            nxt = np.minimum(r + 1, len(t) - 1)
            edge[s] = was_minus1[s] & (r + 1 < len(t)) & (t.pc[nxt] == lookup[s] + 1)
        method = np.where(crow >= 0, M_CFI, M_FP).astype(np.int8)
        minus1 = np.ones(n, dtype=bool)
        rare: dict[int, dict[str, Any]] = {}
        for j in np.flatnonzero((crow < 0) | edge).tolist():
            code = self._code(int(mod[j]), int(row[j]), int(pcs[j]), 16)
            if code.startswith(SIGRETURN_CODE):
                rare[j] = SIGRETURN_RULES
                flags[j] = SIGNAL
                method[j] = M_CFI
                self.counters["unwind_sigreturn_by_code"] += 1
            elif depth == 0 and crow[j] < 0:
                self._frame0_prologue(j, code, int(mod[j]), int(row[j]), int(pcs[j]),
                                      int(lookup[j]), cfa_reg, cfa_off, rule, off)
        for j in np.flatnonzero(flags & COMPLEX).tolist():
            t = tables[j]
            assert t is not None
            rare[j] = t.row(int(crow[j]))
            self.counters["unwind_expr_rows"] += 1
        simple = np.ones(n, dtype=bool)
        simple[list(rare)] = False
        s = np.flatnonzero(simple)
        self._simple(idx[s], cfa_reg[s], cfa_off[s], rule[s], off[s], fp=crow[s] < 0)
        for j, rules in rare.items():
            self._complex(int(idx[j]), rules)
        minus1[(flags & SIGNAL) != 0] = False
        return method, minus1

    def _code(self, m: int, row: int, addr: int, size: int) -> bytes:
        """Bytes of module code at a runtime address (b'' when unreadable)."""
        if m < 0 or self.mods[m].module is None:
            return b""
        module = self.mods[m].module
        assert module is not None
        foff = int(self.spaces.file_offset(np.array([row]), np.array([addr], np.uint64))[0])
        return _read_file(module.elf_path, foff, size)

    def _frame0_prologue(self, j: int, code: bytes, m: int, row: int, pc: int, vaddr: int,
                         cfa_reg: np.ndarray, cfa_off: np.ndarray, rule: np.ndarray,
                         off: np.ndarray) -> None:
        """Frame 0 without CFI: unless rbp is already the frame (the default fp row), the
        CFA is rsp plus what the prologue pushed so far, or what the epilogue left."""
        prologue = None
        module = self.mods[m].module if m >= 0 else None
        if module is not None:
            starts = _func_starts(module.elf_path, module.debug_path)
            k = int(np.searchsorted(starts, vaddr, side="right")) - 1
            if k >= 0 and vaddr - int(starts[k]) <= _PROLOGUE_MAX:
                n = vaddr - int(starts[k])
                prologue = self._code(m, row, pc - n, n) if n else b""
        frame = _frame0_rule(code, prologue)
        if frame is None:
            return
        cfa_reg[j] = RSP
        cfa_off[j] = frame[0]
        rule[j] = Rule.SAME
        off[j] = 0
        rule[j, 0] = Rule.OFFSET
        off[j, 0] = -8
        for reg, at in frame[1].items():
            rule[j, TRACKED.index(reg)] = Rule.OFFSET
            off[j, TRACKED.index(reg)] = at

    def _simple(self, idx: np.ndarray, cfa_reg: np.ndarray, cfa_off: np.ndarray,
                rule: np.ndarray, off: np.ndarray, fp: np.ndarray) -> None:
        if not len(idx):
            return
        base = self.regs[idx, cfa_reg]  # simple rows: cfa_reg is rsp or rbp
        bvalid = self.valid[idx, cfa_reg]
        cfa = base + cfa_off.astype(np.uint64)
        old_sp = self.regs[idx, RSP]
        new = self.regs[idx].copy()
        nvalid = self.valid[idx].copy()
        stop = np.zeros(len(idx), dtype=np.int8)
        stop[rule[:, 0] == _UNDEFINED] = S_COMPLETE
        stop[(stop == 0) & ~bvalid] = S_BAD_REG
        # The frame-pointer step needs rbp inside the frame above sp.
        stop[(stop == 0) & fp & (base < old_sp)] = S_BAD_REG
        stop[(stop == 0) & (cfa <= old_sp)] = S_NO_ADVANCE
        for k, reg in enumerate(TRACKED):
            kind = rule[:, k]
            addr = cfa + off[:, k].astype(np.uint64)
            is_off = kind == _OFFSET
            is_val = kind == _VAL_OFFSET
            val = np.zeros(len(idx), dtype=np.uint64)
            ok = np.zeros(len(idx), dtype=bool)
            beyond = np.zeros(len(idx), dtype=bool)
            if is_off.any():
                val[is_off], ok[is_off], beyond[is_off] = self.mem.read(idx[is_off],
                                                                        addr[is_off])
            if k == 0:
                stop[(stop == 0) & ~is_off & ~is_val] = S_NO_RULE
                stop[(stop == 0) & is_off & beyond] = S_TRUNCATED
                stop[(stop == 0) & is_off & ~ok] = S_BAD_ADDR
            new[:, reg] = np.where(is_off, val, np.where(is_val, addr, new[:, reg]))
            nvalid[:, reg] = np.where(is_off, ok, is_val | ((kind == _SAME) & nvalid[:, reg]))
        stop[(stop == 0) & (new[:, RIP] == 0)] = S_NULL
        new[:, RSP] = cfa
        nvalid[:, RSP] = True
        nvalid[:, list(CALLER_SAVED)] = False
        go = stop == 0
        self.regs[idx[go]] = new[go]
        self.valid[idx[go]] = nvalid[go]
        self.stop[idx[~go]] = stop[~go]

    def _complex(self, i: int, rules: dict[str, Any]) -> None:
        """One step of one stack through the full rule set and the expression evaluator."""
        regs, valid = self.regs[i], self.valid[i]

        def reg(r: int) -> int:
            if not 0 <= r < NUM_REGS or not valid[r]:
                raise DwarfExprError(f"register {r} is unknown in this frame")
            return int(regs[r])

        def read(addr: int, size: int) -> int:
            return self.mem.read_one(i, addr, size)

        rip_rule = rules["regs"].get(RIP, [Rule.SAME, 0])
        if rip_rule[0] == Rule.UNDEFINED:
            self.stop[i] = S_COMPLETE
            return
        try:
            c = rules["cfa"]
            cfa = evaluate(c[1], reg, read) if c[0] == "expr" else (reg(c[1]) + c[2]) & (
                (1 << 64) - 1)
            if cfa <= int(regs[RSP]):
                self.stop[i] = S_NO_ADVANCE
                return
            new = regs.copy()
            nvalid = valid.copy()
            nvalid[list(CALLER_SAVED)] = False
            new[RSP], nvalid[RSP] = cfa, True
            for r, (kind, arg) in rules["regs"].items():
                if not 0 <= r < NUM_REGS:
                    continue
                if kind == Rule.OFFSET:
                    new[r], nvalid[r] = read((cfa + arg) & ((1 << 64) - 1), 8), True
                elif kind == Rule.VAL_OFFSET:
                    new[r], nvalid[r] = (cfa + arg) & ((1 << 64) - 1), True
                elif kind == Rule.REGISTER:
                    new[r], nvalid[r] = reg(arg), True
                elif kind == Rule.EXPRESSION:
                    new[r], nvalid[r] = read(evaluate(arg, reg, read, (cfa,)), 8), True
                elif kind == Rule.VAL_EXPRESSION:
                    new[r], nvalid[r] = evaluate(arg, reg, read, (cfa,)), True
                elif kind == Rule.UNDEFINED:
                    nvalid[r] = False
                elif kind == Rule.SAME:
                    new[r], nvalid[r] = regs[r], valid[r]
        except _Beyond:
            self.stop[i] = S_TRUNCATED
            return
        except DwarfExprError:
            self.stop[i] = S_BAD_EXPR
            return
        if rip_rule[0] == Rule.SAME or not nvalid[RIP]:
            self.stop[i] = S_NO_RULE
        elif int(new[RIP]) == 0:
            self.stop[i] = S_NULL
        else:
            self.regs[i], self.valid[i] = new, nvalid

    def _kernel_chains(self) -> None:
        """Continue stacks the copy could not finish with the kernel's fp chain."""
        idx_l: list[int] = []
        addr_l: list[np.ndarray] = []
        start_l: list[int] = []
        for i in np.flatnonzero((self.stop != S_COMPLETE) & (self.stop != S_MAX_DEPTH)
                                ).tolist():
            chain = self.fp_values[self.fp_offsets[i]:self.fp_offsets[i + 1]]
            if len(chain) < 2:
                continue
            d = int(self.nframes[i]) - 1
            hits = np.flatnonzero(chain == self.last_addr[i])
            hits = hits[hits > 0] if d > 0 else hits
            if not len(hits):
                continue
            j = int(hits[np.argmin(np.abs(hits - (d - 1)) * 2 - (hits >= d - 1))])
            rest = chain[j + 1:self.max_depth - d - 1 + j + 1]
            rest = rest[: int(np.argmax(rest == 0)) if (rest == 0).any() else len(rest)]
            if len(rest):
                idx_l.append(i)
                addr_l.append(rest.astype(np.uint64))
                start_l.append(d + 1)
        if not idx_l:
            return
        lens = np.array([len(a) for a in addr_l])
        idx = np.repeat(np.array(idx_l, dtype=np.int64), lens)
        addr = np.concatenate(addr_l)
        depth = np.concatenate([np.arange(s, s + k) for s, k in zip(start_l, lens,
                                                                       strict=True)])
        row, _mod, _vaddr, lookup = self._resolve(idx, addr, np.ones(len(idx), dtype=bool))
        self.f_stack.append(idx)
        self.f_depth.append(depth)
        self.f_addr.append(addr)
        self.f_method.append(np.full(len(idx), M_KERNEL, dtype=np.int8))
        self.f_row.append(row)
        self.f_lookup.append(lookup)
        np.maximum.at(self.nframes, idx, depth + 1)
        self.counters["unwind_kernel_frames"] = len(idx)
        self.counters["unwind_stacks_fp_kernel"] = len(idx_l)

    # -- output --------------------------------------------------------------------------
    def result(self) -> UnwoundStacks:
        if self.f_stack:
            st = np.concatenate(self.f_stack)
            dp = np.concatenate(self.f_depth)
            order = np.lexsort((dp, st))
            st, dp = st[order], dp[order]
            addr = np.concatenate(self.f_addr)[order]
            meth = np.concatenate(self.f_method)[order]
            row = np.concatenate(self.f_row)[order]
            look = np.concatenate(self.f_lookup)[order]
        else:
            st = dp = row = look = np.zeros(0, np.int64)
            addr = np.zeros(0, np.uint64)
            meth = np.zeros(0, np.int8)
        frames = pa.table({
            "stack_hash": pa.array(self.hash[st], pa.uint64()),
            "pid": pa.array(self.pid[st], pa.uint32()),
            "depth": pa.array(dp.astype(np.uint16), pa.uint16()),
            "address": pa.array(addr, pa.uint64()),
            "method": pa.DictionaryArray.from_arrays(
                pa.array(meth.astype(np.int32)), pa.array(METHODS)).cast(pa.string()),
            "build_id": self.spaces.build_ids(row),
            "path": self.spaces.paths(row),
            "lookup_vaddr": pa.array(np.maximum(look, 0).astype(np.uint64), pa.uint64(),
                                     mask=look < 0),
        }, schema=FRAMES)
        stop = self.stop.astype(np.int32)
        stacks = pa.table({
            "stack_hash": pa.array(self.hash, pa.uint64()),
            "pid": pa.array(self.pid, pa.uint32()),
            "depth": pa.array(self.nframes.astype(np.uint16), pa.uint16()),
            "truncated": pa.array(stop == S_TRUNCATED),
            "complete": pa.array(stop == S_COMPLETE),
            "stop": pa.DictionaryArray.from_arrays(pa.array(stop), pa.array(STOPS)).cast(
                pa.string()),
        }, schema=STACKS)
        for k in range(len(METHODS)):
            self.counters[f"unwind_frames_{METHODS[k].replace('-', '_')}"] = int(
                (meth == k).sum())
        for k in range(1, len(STOPS)):
            self.counters[f"unwind_stop_{STOPS[k].replace('-', '_')}"] = int(
                (self.stop == k).sum())
        problems = [m.problem for m in self.mods if m.problem]
        problems += [p for m in self.mods if m.cfi is not None for p in m.cfi.problems]
        return UnwoundStacks(frames, stacks, self.counters, problems)


@functools.lru_cache(maxsize=256)
def _read_file(path: Path, offset: int, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except OSError:
        return b""


@functools.lru_cache(maxsize=64)
def _func_starts(elf_path: Path, debug_path: Path | None) -> np.ndarray:
    """Sorted start addresses of a module's functions (its debug file's too): the symbol
    tables the symbolizer names frames from."""
    starts = [np.zeros(0, np.uint64)]
    for path in (elf_path, debug_path):
        if path is None:
            continue
        try:
            image = ElfImage(path)
        except ElfReadError:
            continue
        try:
            starts.append(image.symbol_table()[0].start)
        except ElfReadError:
            pass
        finally:
            image.close()
    return np.unique(np.concatenate(starts)).astype(np.int64)


_PROLOGUE_MAX = 256  # bytes from a function's start simulated for frame 0 without CFI
_REGNUM = {"rbx": 3, "rbp": RBP, "r12": 12, "r13": 13, "r14": 14, "r15": 15}


def _frame0_rule(code: bytes, prologue: bytes | None) -> tuple[int, dict[int, int]] | None:
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


def unwind(stacks: pa.Table, mappings: pa.Table, store: ModuleStore,
           max_depth: int = 512) -> UnwoundStacks:
    """Unwind every distinct (stack hash, pid) of a decoded stack table.

    `stacks` has the decode columns (hash, pid, ts, sp, regs in DWARF order, stack
    bytes from sp upward, fp_chain); `mappings` the artifact's mapping snapshots.
    """
    u = _Unwinder(stacks, mappings, store, max_depth)
    u.run()
    return u.result()



def parse_hash(text: str) -> int:
    """A stack hash as users type it: 0x-prefixed or bare hex, or decimal digits."""
    t = text.strip().lower()
    try:
        value = int(t, 16) if t.startswith("0x") or any(c in "abcdef" for c in t) else int(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a stack hash (hex or decimal)") from None
    if not 0 < value < 1 << 64:
        raise ValueError(f"{text!r} is not a stack hash (1 .. 2^64-1)")
    return value


def show_record(artifact_path: Path, record: str, out: TextIO, *,
                host_modules: bool = False) -> int:
    """`memtrack unwind ARTIFACT --record HASH`: print one stack record's frames with
    how each was found and its symbol (inline frames indented). Returns the exit status."""
    from memtrack.process.decode import decode
    from memtrack.schema.artifact import Artifact
    from memtrack.symbolize import symbolize

    want = parse_hash(record)
    art = Artifact.open(artifact_path)
    decoded = decode(art).table
    rows = decoded.filter(pc.equal(decoded.column("hash"), pa.scalar(want, pa.uint64())))
    if rows.num_rows == 0:
        raise ValueError(f"no stack record with hash {want:#x} in {artifact_path}")
    store = ModuleStore(artifact_path, host_modules=host_modules)
    res = unwind(rows, art.read("mappings").table, store)
    frames = res.frames
    sym = symbolize(store, frames.column("build_id").combine_chunks(),
                    frames.column("lookup_vaddr").fill_null(0).to_numpy().astype(np.uint64),
                    paths=frames.column("path").combine_chunks())
    levels: dict[int, list[dict[str, Any]]] = {}
    for r in sym.to_pylist():
        levels.setdefault(r["row"], []).append(r)
    for s in res.stacks.to_pylist():
        state = "complete" if s["complete"] else f"incomplete: {s['stop']}"
        out.write(f"stack {s['stack_hash']:#018x} pid {s['pid']}: {s['depth']} frames "
                  f"({state})\n")
        for i, f in enumerate(frames.to_pylist()):
            if f["stack_hash"] != s["stack_hash"] or f["pid"] != s["pid"]:
                continue
            module = Path(f["path"]).name if f["path"] else "?"
            syms = levels.get(i, []) if f["lookup_vaddr"] is not None else []
            if not syms:
                out.write(f"  #{f['depth']:<3} {f['address']:#018x} {f['method']:<9} ?  "
                          f"[{module}]\n")
                continue
            for k, r in enumerate(syms):  # innermost first, like gdb
                name = r["function"] or f"[unknown: {r['reason']}]"
                off = f"+{r['offset']:#x}" if r["offset"] and k == len(syms) - 1 else ""
                where = f"  {r['file']}:{r['line']}" if r["file"] else ""
                inl = "  (inlined)" if k < len(syms) - 1 else ""
                head = (f"#{f['depth']:<3} {f['address']:#018x} {f['method']:<9}" if k == 0
                        else " " * 33)
                out.write(f"  {head} {name}{off}{where}{inl}  [{module}]\n")
    for p in res.problems:
        out.write(f"note: {p}\n")
    return 0
