"""DWARF call frame information → a compact per-module unwind table.

Every FDE of `.eh_frame` (and of `.debug_frame`, for code no `.eh_frame` FDE covers) is
run through the CFA instruction interpreter here (pyelftools mis-decodes
`DW_CFA_def_cfa_sf` and rejects `DW_CFA_GNU_args_size`, so it is only used to find the
sections). The result is one row per change point, sorted by ELF virtual address:

- `pc`: where the row starts; a row holds until the next row's `pc`. Gaps between FDEs
  are rows with `cfa_reg == CFA_NONE` (no CFI there).
- `cfa_reg`, `cfa_off`: CFA = register + offset (rsp = 7, rbp = 6, any DWARF register),
  or `CFA_EXPR` when a `DW_CFA_def_cfa_expression` computes it.
- `rule`, `off` (shape rows × len(TRACKED)): how rip (the return address) and the
  callee-saved registers rbx, rbp, r12..r15 of the caller are found (`Rule`).
- `kind` (`Kind`): how the unwinder steps out of a frame whose lookup address is in the
  row: `FP` for the gaps (no CFI: the frame-pointer rule), `CFI` for "CFA = rsp|rbp + k,
  registers at CFA + k", `EXPR` where a rule needs `complex_rules` (an expression,
  another register), `SIGNAL` for FDEs of an 'S' CIE (a signal trampoline, whose rules
  restore every register from the kernel's signal frame: the next frame's pc is not a
  return address). The unwinder's table of a module adds `SIGRETURN` and `ENTRY` rows
  (memtrack.process.unwind.tables).
- `complex_rules[extra[i]]`: the full rule set of an `EXPR`, `SIGNAL` or `SIGRETURN` row,
  expressions as bytes.

`CFITable.arrays` / `CFITable.from_arrays` turn a table into flat arrays and back (the
unwinder caches them per build id, memtrack.process.unwind.tables).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memtrack.dwarf.leb128 import sleb, uleb
from memtrack.elf import ElfImage, ElfReadError

# DWARF register numbers (x86_64).
RBX, RBP, RSP, R12, R13, R14, R15, RIP = 3, 6, 7, 12, 13, 14, 15, 16
# The registers a compact row tracks: the return address first, then callee-saved ones.
TRACKED = (RIP, RBX, RBP, R12, R13, R14, R15)
T_RA = 0
T_RBP = TRACKED.index(RBP)

CFA_NONE = -2  # no FDE covers this address
CFA_EXPR = -1  # CFA = value of a DWARF expression



class Kind(enum.IntEnum):
    """The kinds of rows of an unwind table (`CFITable.kind`)."""

    FP = 0  # no CFI covers the address: the frame-pointer rule
    CFI = 1  # CFA = rsp|rbp + k, registers at CFA + k (the row's columns)
    EXPR = 2  # a rule needs complex_rules: an expression, another register
    SIGNAL = 3  # an 'S' FDE's row: complex_rules over the signal frame; the next pc is exact
    SIGRETURN = 4  # the kernel's rt_sigreturn code without CFI: the same, from its layout
    ENTRY = 5  # a module's entry code without CFI: the first thread's outermost frame


# The kinds whose rules are complex_rules[extra] (the unwinder's rare path).
RARE = (Kind.EXPR, Kind.SIGNAL, Kind.SIGRETURN)


class Rule(enum.IntEnum):
    SAME = 0  # unchanged (also: no rule given, for callee-saved registers)
    OFFSET = 1  # saved at CFA + off
    UNDEFINED = 2  # not recoverable; for rip: the outermost frame
    VAL_OFFSET = 3  # the value is CFA + off
    REGISTER = 4  # the value is in register `off`
    EXPRESSION = 5  # saved at the address an expression computes (complex_rules)
    VAL_EXPRESSION = 6  # the value is an expression's result (complex_rules)


class CFIError(Exception):
    """Malformed call frame information (worded for one line)."""


@dataclass
class CFITable:
    pc: np.ndarray  # uint64, sorted
    cfa_reg: np.ndarray  # int8
    cfa_off: np.ndarray  # int64
    rule: np.ndarray  # int8, rows × len(TRACKED)
    off: np.ndarray  # int64, rows × len(TRACKED)
    kind: np.ndarray  # uint8 (Kind)
    extra: np.ndarray  # int32 index into complex_rules, -1 if none
    complex_rules: list[dict[str, Any]]
    problems: list[str]

    def __len__(self) -> int:
        return len(self.pc)

    def lookup(self, vaddrs: np.ndarray) -> np.ndarray:
        """Row index of each address (int64), -1 where no row but an `FP` one holds it."""
        v = np.asarray(vaddrs, dtype=np.uint64)
        if not len(self.pc):  # a module without CFI (or whose CFI did not read)
            return np.full(len(v), -1, np.int64)
        i = np.searchsorted(self.pc, v, side="right").astype(np.int64) - 1
        ok = i >= 0
        i[ok & (self.kind[np.maximum(i, 0)] == Kind.FP)] = -1
        i[~ok] = -1
        return i

    def arrays(self) -> dict[str, np.ndarray]:
        """The table as named flat arrays (complex rules and problems as JSON strings)."""
        return {"pc": self.pc, "cfa_reg": self.cfa_reg, "cfa_off": self.cfa_off,
                "rule": self.rule, "off": self.off, "kind": self.kind, "extra": self.extra,
                "complex": np.array(_encode_complex(self.complex_rules)),
                "problems": np.array(json.dumps(self.problems))}

    @classmethod
    def from_arrays(cls, z: Any) -> CFITable:
        """The table `arrays` gave (any mapping of those names, an npz file too)."""
        return cls(z["pc"], z["cfa_reg"], z["cfa_off"], z["rule"], z["off"], z["kind"],
                   z["extra"], _decode_complex(json.loads(str(z["complex"]))),
                   json.loads(str(z["problems"])))

    def row(self, i: int) -> dict[str, Any]:
        """The full rule set of row i: {"cfa": [...], "regs": {dwarf_reg: [kind, arg]}}."""
        if self.extra[i] >= 0:
            return self.complex_rules[int(self.extra[i])]
        cfa: list[Any] = ["reg", int(self.cfa_reg[i]), int(self.cfa_off[i])]
        regs = {TRACKED[k]: [int(self.rule[i, k]), int(self.off[i, k])]
                for k in range(len(TRACKED))}
        return {"cfa": cfa, "regs": regs}


_FIXED = {0x00: ("<Q", 8), 0x02: ("<H", 2), 0x03: ("<I", 4), 0x04: ("<Q", 8),
          0x0A: ("<h", 2), 0x0B: ("<i", 4), 0x0C: ("<q", 8)}


def _read_encoded(d: bytes, p: int, enc: int, sec_addr: int) -> tuple[int, int]:
    """A pointer in .eh_frame encoding `enc`, at section offset p."""
    fmt = enc & 0x0F
    if fmt == 0x01:
        v, q = uleb(d, p)
    elif fmt == 0x09:
        v, q = sleb(d, p)
    elif fmt in _FIXED:
        f, n = _FIXED[fmt]
        (v,) = struct.unpack_from(f, d, p)
        q = p + n
    else:
        raise CFIError(f"unsupported pointer encoding {enc:#x}")
    app = enc & 0x70
    if app == 0x10:  # pcrel
        v += sec_addr + p
    elif app not in (0x00,):
        raise CFIError(f"unsupported pointer application {enc:#x}")
    return v & 0xFFFFFFFFFFFFFFFF, q


@dataclass
class _CIE:
    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int
    has_z: bool
    signal: bool
    initial: bytes
    addr_size: int


def _parse_cie(d: bytes, p: int, end: int, eh: bool, sec_addr: int) -> _CIE:
    version = d[p]
    p += 1
    z = d.index(b"\0", p)
    aug = d[p:z].decode("ascii", "replace")
    p = z + 1
    addr_size = 8
    if "eh" in aug:
        p += 8
    if not eh and version >= 4:
        addr_size = d[p]
        p += 2
    code_align, p = uleb(d, p)
    data_align, p = sleb(d, p)
    if version == 1:
        ra_reg = d[p]
        p += 1
    else:
        ra_reg, p = uleb(d, p)
    fde_enc = 0x00
    signal = False
    if aug.startswith("z"):
        alen, p = uleb(d, p)
        q = p
        for c in aug[1:]:
            if c == "R":
                fde_enc = d[q]
                q += 1
            elif c == "L":
                q += 1
            elif c == "P":
                penc = d[q]
                _, q = _read_encoded(d, q + 1, penc & 0x7F, sec_addr)
            elif c == "S":
                signal = True
            elif c == "B":
                continue
            else:
                break
        p += alen
    else:
        signal = "S" in aug
    return _CIE(code_align, data_align, ra_reg, fde_enc, aug.startswith("z"), signal,
                d[p:end], addr_size)


_Rule = tuple  # (Rule, arg) where arg is an int or bytes


def _run(cie: _CIE, insns: bytes, start: int, end: int, init_state: Any | None,
         rows: list[tuple[int, Any, dict[int, _Rule]]]) -> Any:
    """Interpret CFA instructions from `start`; append (pc, cfa, regs) rows."""
    if init_state is None:
        cfa: Any = ("reg", RSP, 0)
        regs: dict[int, _Rule] = {}
    else:
        cfa, regs = init_state[0], dict(init_state[1])
    initial_regs = dict(regs)
    stack: list[tuple[Any, dict[int, _Rule]]] = []
    loc = start
    d = insns
    p = 0
    n = len(d)
    ca, da = cie.code_align, cie.data_align

    def restore(r: int) -> None:
        """DW_CFA_restore: the register's rule as the CIE's initial instructions left it."""
        if r in initial_regs:
            regs[r] = initial_regs[r]
        else:
            regs.pop(r, None)

    def emit() -> None:
        if rows and rows[-1][0] == loc:
            rows[-1] = (loc, cfa, dict(regs))
        elif not rows or rows[-1][1] != cfa or rows[-1][2] != regs:
            rows.append((loc, cfa, dict(regs)))

    while p < n:
        op = d[p]
        p += 1
        hi, lo = op & 0xC0, op & 0x3F
        if hi == 0x40:
            emit()
            loc += lo * ca
            continue
        if hi == 0x80:
            v, p = uleb(d, p)
            regs[lo] = (Rule.OFFSET, v * da)
            continue
        if hi == 0xC0:
            restore(lo)
            continue
        if op == 0x00:
            continue
        if op == 0x01:
            emit()
            (loc,) = struct.unpack_from("<Q", d, p)  # absolute: GCC emits it in .debug_frame only
            p += 8
        elif op in (0x02, 0x03, 0x04):
            emit()
            f, k = {0x02: ("<B", 1), 0x03: ("<H", 2), 0x04: ("<I", 4)}[op]
            loc += struct.unpack_from(f, d, p)[0] * ca
            p += k
        elif op in (0x05, 0x11):  # offset_extended, offset_extended_sf
            r, p = uleb(d, p)
            v, p = (uleb if op == 0x05 else sleb)(d, p)
            regs[r] = (Rule.OFFSET, v * da)
        elif op == 0x06:
            r, p = uleb(d, p)
            restore(r)
        elif op == 0x07:
            r, p = uleb(d, p)
            regs[r] = (Rule.UNDEFINED, 0)
        elif op == 0x08:
            r, p = uleb(d, p)
            regs[r] = (Rule.SAME, 0)
        elif op == 0x09:
            r, p = uleb(d, p)
            r2, p = uleb(d, p)
            regs[r] = (Rule.REGISTER, r2)
        elif op == 0x0A:
            stack.append((cfa, dict(regs)))
        elif op == 0x0B:
            if not stack:
                raise CFIError("DW_CFA_restore_state without remember_state")
            saved_cfa, regs = stack.pop()
            # The CFA rule is part of the remembered state (DWARF 5 6.4.2.4).
            cfa = saved_cfa
        elif op == 0x0C:
            r, p = uleb(d, p)
            v, p = uleb(d, p)
            cfa = ("reg", r, v)
        elif op == 0x0D:
            r, p = uleb(d, p)
            cfa = ("reg", r, cfa[2] if cfa[0] == "reg" else 0)
        elif op == 0x0E:
            v, p = uleb(d, p)
            cfa = ("reg", cfa[1] if cfa[0] == "reg" else RSP, v)
        elif op == 0x0F:
            k, p = uleb(d, p)
            cfa = ("expr", d[p:p + k])
            p += k
        elif op in (0x10, 0x16):
            r, p = uleb(d, p)
            k, p = uleb(d, p)
            regs[r] = (Rule.EXPRESSION if op == 0x10 else Rule.VAL_EXPRESSION, d[p:p + k])
            p += k
        elif op == 0x12:
            r, p = uleb(d, p)
            v, p = sleb(d, p)
            cfa = ("reg", r, v * da)
        elif op == 0x13:
            v, p = sleb(d, p)
            cfa = ("reg", cfa[1] if cfa[0] == "reg" else RSP, v * da)
        elif op in (0x14, 0x15):
            r, p = uleb(d, p)
            v, p = uleb(d, p) if op == 0x14 else sleb(d, p)
            regs[r] = (Rule.VAL_OFFSET, v * da)
        elif op == 0x2E:  # DW_CFA_GNU_args_size: no effect on the rules
            _, p = uleb(d, p)
        elif op == 0x2F:  # DW_CFA_GNU_negative_offset_extended
            r, p = uleb(d, p)
            v, p = uleb(d, p)
            regs[r] = (Rule.OFFSET, -v * da)
        else:
            raise CFIError(f"unknown CFA instruction {op:#x}")
        if loc >= end and end > start:
            break
    emit()
    return cfa, regs


def _fdes(data: bytes, sec_addr: int, eh: bool
          ) -> tuple[list[tuple[int, int, bool, list[Any]]], list[str]]:
    """(start, end, signal, rows) per FDE of one .eh_frame / .debug_frame section."""
    out: list[tuple[int, int, bool, list[Any]]] = []
    problems: list[str] = []
    cies: dict[int, tuple[_CIE, Any]] = {}
    p = 0
    n = len(data)
    while p + 4 <= n:
        (length,) = struct.unpack_from("<I", data, p)
        if length == 0:
            if eh:
                p += 4
                continue
            break
        hdr = 4
        if length == 0xFFFFFFFF:
            (length,) = struct.unpack_from("<Q", data, p + 4)
            hdr = 12
        entry = p
        body = p + hdr
        end = body + length
        if end > n:
            problems.append(f"entry at {entry:#x} runs past the section end")
            break
        idsize = 8 if hdr == 12 else 4
        (cid,) = struct.unpack_from("<Q" if idsize == 8 else "<I", data, body)
        is_cie = cid == 0 if eh else cid in (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF)
        q = body + idsize
        p = end
        try:
            if is_cie:
                continue
            cie_off = (body - cid) if eh else cid
            if cie_off not in cies:
                (cl,) = struct.unpack_from("<I", data, cie_off)
                ch = 12 if cl == 0xFFFFFFFF else 4
                if ch == 12:
                    (cl,) = struct.unpack_from("<Q", data, cie_off + 4)
                cbody = cie_off + ch + (8 if ch == 12 else 4)
                cie = _parse_cie(data, cbody, cie_off + ch + cl, eh, sec_addr)
                init_rows: list[Any] = []
                state = _run(cie, cie.initial, 0, 0, None, init_rows)
                cies[cie_off] = (cie, state)
            cie, state = cies[cie_off]
            if eh:
                start, q = _read_encoded(data, q, cie.fde_enc, sec_addr)
                rng, q = _read_encoded(data, q, cie.fde_enc & 0x0F, sec_addr)
            else:
                fmt = "<QQ" if cie.addr_size == 8 else "<II"
                start, rng = struct.unpack_from(fmt, data, q)
                q += 2 * cie.addr_size
            if cie.has_z:
                alen, q = uleb(data, q)
                q += alen
            if rng == 0 or start == 0:
                continue  # a discarded (zeroed) FDE of a garbage-collected function
            rows: list[Any] = []
            _run(cie, data[q:end], start, start + rng, state, rows)
            out.append((start, start + rng, cie.signal, rows))
        except (CFIError, IndexError, ValueError, struct.error, KeyError) as e:
            problems.append(f"FDE at {entry:#x}: {e}")
    return out, problems


def _encode(fdes: list[tuple[int, int, bool, list[Any]]], problems: list[str]) -> CFITable:
    fdes.sort(key=lambda f: f[0])
    pcs: list[int] = []
    cregs: list[int] = []
    coffs: list[int] = []
    rules: list[list[int]] = []
    offs: list[list[int]] = []
    kinds: list[int] = []
    extra: list[int] = []
    complex_rules: list[dict[str, Any]] = []
    none_rule = [int(Rule.SAME)] * len(TRACKED)
    zero = [0] * len(TRACKED)

    def gap(pc: int) -> None:
        pcs.append(pc)
        cregs.append(CFA_NONE)
        coffs.append(0)
        rules.append(none_rule)
        offs.append(zero)
        kinds.append(Kind.FP)
        extra.append(-1)

    covered_to = 0
    for start, end, signal, rows in fdes:
        if start < covered_to:
            continue  # overlaps an earlier FDE (a .debug_frame duplicate): keep the first
        if pcs and start > covered_to:
            gap(covered_to)
        if pcs and pcs[-1] == start and cregs[-1] == CFA_NONE:
            for col in (pcs, cregs, coffs, rules, offs, kinds, extra):
                col.pop()
        for loc, cfa, regs in rows:
            if loc >= end:
                break
            loc = max(loc, start)
            is_complex = cfa[0] != "reg" or cfa[1] not in (RSP, RBP)
            r_row = []
            o_row = []
            for reg in TRACKED:
                kind, arg = regs.get(reg, (Rule.SAME, 0))
                if kind in (Rule.EXPRESSION, Rule.VAL_EXPRESSION, Rule.REGISTER):
                    is_complex = True
                    arg = 0
                r_row.append(int(kind))
                o_row.append(int(arg))
            kind = Kind.SIGNAL if signal else Kind.EXPR if is_complex else Kind.CFI
            ex = -1
            if kind != Kind.CFI:  # a signal frame restores every register
                ex = len(complex_rules)
                complex_rules.append({
                    "cfa": ["expr", cfa[1].hex()] if cfa[0] == "expr" else list(cfa),
                    "regs": {str(r): [int(k), a.hex() if isinstance(a, bytes) else int(a)]
                             for r, (k, a) in regs.items()},
                })
            if pcs and pcs[-1] == loc:
                for col in (pcs, cregs, coffs, rules, offs, kinds, extra):
                    col.pop()
            pcs.append(loc)
            cregs.append(cfa[1] if cfa[0] == "reg" else CFA_EXPR)
            coffs.append(cfa[2] if cfa[0] == "reg" else 0)
            rules.append(r_row)
            offs.append(o_row)
            kinds.append(kind)
            extra.append(ex)
        covered_to = end
    if pcs:
        gap(covered_to)
    k = len(TRACKED)
    return CFITable(
        pc=np.array(pcs, dtype=np.uint64),
        cfa_reg=np.array(cregs, dtype=np.int8),
        cfa_off=np.array(coffs, dtype=np.int64),
        rule=np.array(rules, dtype=np.int8).reshape(-1, k),
        off=np.array(offs, dtype=np.int64).reshape(-1, k),
        kind=np.array(kinds, dtype=np.uint8),
        extra=np.array(extra, dtype=np.int32),
        complex_rules=_decode_complex(complex_rules),
        problems=problems,
    )


def _decode_complex(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON-shaped complex rules → in-memory form (int keys, bytes expressions)."""
    out = []
    for r in rules:
        cfa = r["cfa"]
        if cfa[0] == "expr":
            cfa = ["expr", bytes.fromhex(cfa[1]) if isinstance(cfa[1], str) else cfa[1]]
        regs = {}
        for reg, (kind, arg) in r["regs"].items():
            if isinstance(arg, str):
                arg = bytes.fromhex(arg)
            regs[int(reg)] = [int(kind), arg]
        out.append({"cfa": cfa, "regs": regs})
    return out


def _encode_complex(rules: list[dict[str, Any]]) -> str:
    return json.dumps([
        {"cfa": ["expr", r["cfa"][1].hex()] if r["cfa"][0] == "expr" else r["cfa"],
         "regs": {str(k): [v[0], v[1].hex() if isinstance(v[1], bytes) else v[1]]
                  for k, v in r["regs"].items()}}
        for r in rules
    ])


def build_table(elf_path: Path | str, debug_path: Path | str | None = None) -> CFITable:
    """The CFI table of one ELF file (+ the .debug_frame of its separate debug file)."""
    fdes: list[tuple[int, int, bool, list[Any]]] = []
    problems: list[str] = []
    for path, names in ((elf_path, (".eh_frame", ".debug_frame")),
                        (debug_path, (".debug_frame",))):
        if path is None:
            continue
        try:
            with ElfImage(path) as img:
                for name in names:
                    sec = img.section(name)
                    if sec is None:
                        continue
                    got, probs = _fdes(sec[0], sec[1], name == ".eh_frame")
                    fdes += got
                    problems += [f"{path} {name}: {p}" for p in probs]
        except ElfReadError as e:
            problems.append(str(e))
    return _encode(fdes, problems)
