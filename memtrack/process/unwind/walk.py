"""The lockstep walk: all stacks of a batch advance together, one frame depth at a time,
with numpy. The registers of every live stack are one (n, 17) array; each step looks
the row of every frame up in its module's unwind table (memtrack.process.unwind.tables:
CFI, frame-pointer, signal-return and entry-code rows, at pc or pc - 1 as its docstring
says) with one searchsorted per module and reads the saved registers out of the stack
copies with one gather. Rows that need more than "CFA = rsp|rbp + k, registers at CFA +
k" (DWARF expressions: PLT entries, signal trampolines; a CFA on another register) take a
per-stack path through the DWARF expression evaluator. An `FP` row follows the frame
pointer, except for frame 0 where the prologue/epilogue row says rbp is not the frame
yet or any more; where the copied bytes end, the kernel's frame-pointer chain continues
the stack.

A step is a lookup and a gather: the tables it reads are built when a depth first lands
in a module, the frame-0 rows (memtrack.process.unwind.frame0) before the walk starts.

Stop rules (memtrack.schema.enums.Stop): RA undefined (`_start`, thread start: the
stack is complete), a frame in a module's entry code that no CFI covers (ld.so's
`_dl_start_user`, which runs the constructors; a `_start` without CFI: complete), the
CFA does not advance, a read above the end of a copy the budget cut (truncated; above
a copy that reached the stack's end it is a bad address), a return address outside
every executable mapping (no-mapping, and no frame: a stack record keeps only the words
pointing into code or stacks, so any other value must end the stack the same way), a
pc outside any file-backed mapping (no-mapping, after its frame), ...
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.addrspace.normalize import Normalized, Normalizer
from memtrack.dwarf.cfi import RARE, RBP, RIP, RSP, TRACKED, CFITable, Kind, Rule
from memtrack.dwarf.expr import DwarfExprError, evaluate
from memtrack.process.unwind.frame0 import frame0_rows
from memtrack.schema import NUM_REGS
from memtrack.schema.enums import Method, Stop, Unresolved, names
from memtrack.schema.stages import UNWOUND_STACK_FRAMES, UNWOUND_STACKS

METHODS = names(Method)
STOPS = names(Stop)
UNRESOLVED = names(Unresolved)
M_REGS, M_CFI, M_FP, M_KERNEL = Method.REGS, Method.CFI, Method.FP, Method.FP_KERNEL
S_NONE, S_COMPLETE, S_TRUNCATED, S_NO_MAPPING, S_NO_ADVANCE, S_NO_RULE, S_BAD_REG, \
    S_BAD_ADDR, S_BAD_EXPR, S_MAX_DEPTH, S_NULL, S_PYTHON = Stop

CALLER_SAVED = (0, 1, 2, 4, 5, 8, 9, 10, 11)

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


class Memory:
    """The stack copies of a batch of stacks, one byte array, read by (stack, address)."""

    def __init__(self, records: pa.Table) -> None:
        col = records.column("stack").cast(pa.large_binary()).combine_chunks()
        bufs = col.buffers()
        offs = np.frombuffer(bufs[1], dtype=np.int64)[col.offset:col.offset + len(col) + 1] \
            if len(col) else np.zeros(1, np.int64)
        self.buf = np.frombuffer(bufs[2], dtype=np.uint8) if len(col) and bufs[2] is not None \
            else np.zeros(0, np.uint8)
        self.base = offs[:-1].astype(np.int64)
        self.ln = (offs[1:] - offs[:-1]).astype(np.uint64)
        self.sp = records.column("sp").to_numpy().astype(np.uint64)
        self.python_cut = records.column("python_cut").to_numpy(zero_copy_only=False)
        # a Python cut reads like a copy the budget cut: its stack goes on beyond it
        self.cut = records.column("copy_truncated").to_numpy(zero_copy_only=False) | \
            self.python_cut

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


class Walk:
    """One batch of distinct stacks (decoded records, one per stack hash), walked by
    `run` and turned into the unwind stage's tables by `result`."""

    def __init__(self, records: pa.Table, normalizer: Normalizer,
                 tables: dict[int, CFITable | None], extract: Any, max_depth: int) -> None:
        self.n = n = records.num_rows
        self.hash = records.column("stack_hash").to_numpy().astype(np.uint64)
        self.pid = records.column("pid").to_numpy().astype(np.uint32)
        ts = records.column("ts").to_numpy().astype(np.uint64)
        regs_col = records.column("regs").combine_chunks()
        flat = regs_col.flatten().to_numpy(zero_copy_only=False).astype(np.uint64)
        self.regs = flat.reshape(-1, NUM_REGS).copy() if n else np.zeros(
            (0, NUM_REGS), np.uint64)
        # At an allocator's entry the caller-saved registers are dead (its CFA is rsp + 8):
        # stack records do not keep them, so no rule may read them.
        self.valid = np.ones((n, NUM_REGS), dtype=bool)
        self.valid[:, list(CALLER_SAVED)] = False
        fpc = pc.fill_null(records.column("fp_chain"), pa.scalar([], pa.list_(pa.uint64())))
        fpc = fpc.combine_chunks()
        self.fp_offsets = fpc.offsets.to_numpy().astype(np.int64)
        self.fp_values = fpc.values.to_numpy(zero_copy_only=False).astype(np.uint64)
        self.mem = Memory(records)
        self.norm = normalizer
        self.snap = normalizer.snapshot_of(self.pid, ts)
        self.tables = tables  # module index -> its unwind table (None: no file to read)
        self.extract = extract  # ensures tables[m] for the module indices given
        self.max_depth = max_depth
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
        self.f_reason: list[np.ndarray] = []
        self.nframes = np.zeros(n, dtype=np.int64)
        self.last_addr = np.zeros(n, dtype=np.uint64)
        self.stop = np.zeros(n, dtype=np.int8)
        self.frame0: dict[int, tuple[int, dict[int, int]]] = {}

    def _lookup(self, norm: Normalized, minus1: np.ndarray) -> np.ndarray:
        """The vaddr each frame is looked up at (pc - 1 but for frame 0 and the frame
        after a signal frame); -1 where normalization failed."""
        return np.where(norm.vaddr >= 0, norm.vaddr - minus1.astype(np.int64), -1)

    def _rows(self, mod: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, kind) of each lookup address in its module's table: row -1 and kind FP
        where no row but an FP one holds it (a module without a table, a failed
        normalization: key -1)."""
        row = np.full(len(mod), -1, dtype=np.int64)
        kind = np.full(len(mod), Kind.FP, dtype=np.uint8)
        for m in np.unique(mod[mod >= 0]).tolist():
            t = self.tables.get(m)
            if t is None:
                continue
            sel = np.flatnonzero((mod == m) & (key >= 0))
            row[sel] = r = t.lookup(key[sel].astype(np.uint64))
            kind[sel] = np.where(r >= 0, t.kind[np.maximum(r, 0)], Kind.FP)
        return row, kind

    def _prepare_frame0(self, norm: Normalized) -> None:
        """Frame-0 rows for the stacks whose first pc has an FP row."""
        self.extract(norm.module)
        sel = np.flatnonzero((self._rows(norm.module, norm.vaddr)[1] == Kind.FP)
                             & (norm.module >= 0) & (norm.vaddr >= 0))
        got = frame0_rows(self.norm.modules, norm.module[sel], norm.vaddr[sel])
        self.frame0 = {int(sel[j]): rule for j, rule in got.items()}

    # -- the lockstep loop -------------------------------------------------------------
    def run(self) -> None:
        active = np.arange(self.n, dtype=np.int64)
        method = np.full(self.n, M_REGS, dtype=np.int8)
        minus1 = np.zeros(self.n, dtype=bool)
        depth = 0
        norm = self.norm.normalize(self.snap, self.regs[:, RIP])
        self._prepare_frame0(norm)
        while len(active):
            if depth >= self.max_depth:
                self.stop[active] = S_MAX_DEPTH
                break
            pcs = self.regs[active, RIP]
            if depth:
                norm = self.norm.normalize(self.snap[active], pcs)
                # A return address outside every executable mapping is not a frame
                # (the skeleton reads it as 0 unless it points into a kept region).
                code = norm.row >= 0
                code[code] = self.norm.spaces.executable[norm.row[code]]
                self.stop[active[~code]] = S_NO_MAPPING
                active, pcs = active[code], pcs[code]
                norm = Normalized(norm.row[code], norm.module[code], norm.vaddr[code],
                                  norm.reason[code])
                self.extract(norm.module)
            lookup = self._lookup(norm, minus1[active])
            self._emit(active, depth, pcs, method[active], norm, lookup)
            known = norm.mapped
            self.stop[active[~known]] = S_NO_MAPPING
            stepped = np.flatnonzero(known)
            active, mod, lookup = active[known], norm.module[known], lookup[known]
            nxt_method, nxt_minus1 = self._step(active, mod, lookup, depth)
            # A signal trampoline is not called: the handler returns to its first
            # instruction. Its row is found at pc - 1 (glibc starts the FDE a byte early,
            # a SIGRETURN row likewise), but it is named at pc.
            tramp = ~nxt_minus1 & minus1[active] & (lookup >= 0)
            self.f_lookup[-1][stepped[tramp]] += 1
            method[active] = nxt_method
            minus1[active] = nxt_minus1
            active = active[self.stop[active] == S_NONE]
            depth += 1
        # a Python cut holds the allocator and its caller: from there no rule can go on
        # (the copy ends, its registers are not kept), by design
        self.stop[self.mem.python_cut & (self.nframes >= 2)] = S_PYTHON
        self._kernel_chains()

    def _emit(self, idx: np.ndarray, depth: int, addr: np.ndarray, method: np.ndarray,
              norm: Normalized, lookup: np.ndarray) -> None:
        self.f_stack.append(idx)
        self.f_depth.append(np.full(len(idx), depth, dtype=np.int64))
        self.f_addr.append(addr.copy())
        self.f_method.append(method.astype(np.int8))
        self.f_row.append(norm.row)
        self.f_lookup.append(lookup)
        self.f_reason.append(norm.reason)
        self.nframes[idx] = depth + 1
        self.last_addr[idx] = addr

    def _step(self, idx: np.ndarray, mod: np.ndarray, lookup: np.ndarray, depth: int
              ) -> tuple[np.ndarray, np.ndarray]:
        """Advance each stack by one frame, by the row of its lookup address; return
        (method, pc-1 lookup) of the next."""
        n = len(idx)
        crow, kind = self._rows(mod, lookup)
        cfa_reg = np.full(n, RBP, dtype=np.int64)
        cfa_off = np.full(n, 16, dtype=np.int64)
        rule = np.tile(_FP_RULE, (n, 1))
        off = np.tile(_FP_OFF, (n, 1))
        rare: dict[int, dict[str, Any]] = {}
        for m in np.unique(mod[crow >= 0]).tolist():
            t = self.tables[m]
            assert t is not None
            s = np.flatnonzero((mod == m) & (crow >= 0))
            r = crow[s]
            cfa_reg[s] = t.cfa_reg[r]
            cfa_off[s] = t.cfa_off[r]
            rule[s] = t.rule[r]
            off[s] = t.off[r]
            for j in s[np.isin(t.kind[r], RARE)].tolist():
                rare[j] = t.row(int(crow[j]))
        self.counters["unwind_sigreturn_by_code"] += int((kind == Kind.SIGRETURN).sum())
        self.counters["unwind_expr_rows"] += int(np.isin(kind, (Kind.EXPR, Kind.SIGNAL)).sum())
        fp = kind == Kind.FP
        if depth == 0:
            for j in np.flatnonzero(fp).tolist():
                frame = self.frame0.get(int(idx[j]))
                if frame is not None:
                    cfa_reg[j], cfa_off[j] = RSP, frame[0]
                    rule[j], off[j] = Rule.SAME, 0
                    rule[j, 0], off[j, 0] = Rule.OFFSET, -8
                    for reg, at in frame[1].items():
                        rule[j, TRACKED.index(reg)] = Rule.OFFSET
                        off[j, TRACKED.index(reg)] = at
        # the entry code of a module: the first thread's outermost frame
        outer = kind == Kind.ENTRY
        self.stop[idx[outer]] = S_COMPLETE
        simple = fp | (kind == Kind.CFI)
        s = np.flatnonzero(simple)
        self._simple(idx[s], cfa_reg[s], cfa_off[s], rule[s], off[s], fp=fp[s])
        for j, rules in rare.items():
            self._complex(int(idx[j]), rules)
        method = np.where(fp | outer, M_FP, M_CFI).astype(np.int8)
        return method, ~np.isin(kind, (Kind.SIGNAL, Kind.SIGRETURN))

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
        norm = self.norm.normalize(self.snap[idx], addr)
        lookup = self._lookup(norm, np.ones(len(idx), dtype=bool))
        self.f_stack.append(idx)
        self.f_depth.append(depth)
        self.f_addr.append(addr)
        self.f_method.append(np.full(len(idx), M_KERNEL, dtype=np.int8))
        self.f_row.append(norm.row)
        self.f_lookup.append(lookup)
        self.f_reason.append(norm.reason)
        np.maximum.at(self.nframes, idx, depth + 1)
        self.counters["unwind_kernel_frames"] = len(idx)
        self.counters["unwind_stacks_fp_kernel"] = len(idx_l)

    # -- output --------------------------------------------------------------------------
    def result(self) -> tuple[pa.Table, pa.Table]:
        """(stacks, stack frames) of the walk (UNWOUND_STACKS, UNWOUND_STACK_FRAMES)."""
        if self.f_stack:
            st = np.concatenate(self.f_stack)
            dp = np.concatenate(self.f_depth)
            order = np.lexsort((dp, st))
            st, dp = st[order], dp[order]
            addr = np.concatenate(self.f_addr)[order]
            meth = np.concatenate(self.f_method)[order]
            row = np.concatenate(self.f_row)[order]
            look = np.concatenate(self.f_lookup)[order]
            why = np.concatenate(self.f_reason)[order]
        else:
            st = dp = row = look = np.zeros(0, np.int64)
            addr = np.zeros(0, np.uint64)
            meth = why = np.zeros(0, np.int8)
        spaces = self.norm.spaces
        frames = pa.table({
            "stack_hash": pa.array(self.hash[st], pa.uint64()),
            "pid": pa.array(self.pid[st], pa.uint32()),
            "depth": pa.array(dp.astype(np.uint16), pa.uint16()),
            "address": pa.array(addr, pa.uint64()),
            "method": _labels(meth, METHODS),
            "build_id": spaces.build_ids(row),
            "path": spaces.paths(row),
            "lookup_vaddr": pa.array(np.maximum(look, 0).astype(np.uint64), pa.uint64(),
                                     mask=look < 0),
            "reason": _labels(why, UNRESOLVED),
        }, schema=UNWOUND_STACK_FRAMES)
        stacks = pa.table({
            "stack_hash": pa.array(self.hash, pa.uint64()),
            "pid": pa.array(self.pid, pa.uint32()),
            "depth": pa.array(self.nframes.astype(np.uint16), pa.uint16()),
            "truncated": pa.array(self.stop == S_TRUNCATED),
            "complete": pa.array(self.stop == S_COMPLETE),
            "stop": _labels(self.stop, STOPS),
        }, schema=UNWOUND_STACKS)
        for k, name in enumerate(METHODS):
            self.counters[f"unwind_frames_{name.replace('-', '_')}"] = int((meth == k).sum())
        for k, name in enumerate(STOPS[1:], start=1):
            self.counters[f"unwind_stop_{name.replace('-', '_')}"] = int((self.stop == k).sum())
        return stacks, frames


def _labels(codes: np.ndarray, labels: list[str]) -> pa.Array:
    """Codes as their labels (a dictionary of strings); negative codes as nulls."""
    c = np.asarray(codes).astype(np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(c, mask=c < 0), pa.array(labels))
