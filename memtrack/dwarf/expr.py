"""A small DWARF expression evaluator for the CFI rules that need one.

Covers what call frame information uses in practice: the PLT's
`DW_CFA_def_cfa_expression` (breg7 +8; breg16 +0; lit15; and; lit11; ge; lit3; shl;
plus) and the signal trampolines' `DW_CFA_expression` rules (breg7 +k, deref), plus the
rest of the stack-machine operations. Register-location operations (DW_OP_reg*) and
anything needing a frame base or object are rejected: they describe variables, not
frames.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from memtrack.dwarf.leb128 import sleb, uleb

MASK = 0xFFFFFFFFFFFFFFFF


class DwarfExprError(Exception):
    """An expression that cannot be evaluated here (worded for one line)."""


def _uleb(d: bytes, p: int) -> tuple[int, int]:
    try:
        return uleb(d, p)
    except IndexError:
        raise DwarfExprError("truncated LEB128 operand") from None


def _sleb(d: bytes, p: int) -> tuple[int, int]:
    try:
        return sleb(d, p)
    except IndexError:
        raise DwarfExprError("truncated LEB128 operand") from None


def _signed(v: int) -> int:
    return v - (1 << 64) if v & (1 << 63) else v


_CONST = {0x08: ("<B", 1), 0x09: ("<b", 1), 0x0A: ("<H", 2), 0x0B: ("<h", 2),
          0x0C: ("<I", 4), 0x0D: ("<i", 4), 0x0E: ("<Q", 8), 0x0F: ("<q", 8)}

_BINARY: dict[int, Callable[[int, int], int]] = {
    0x1A: lambda a, b: a & b,
    0x1C: lambda a, b: a - b,
    0x1E: lambda a, b: a * b,
    0x21: lambda a, b: a | b,
    0x22: lambda a, b: a + b,
    0x24: lambda a, b: a << b if b < 64 else 0,
    0x25: lambda a, b: a >> b if b < 64 else 0,
    0x26: lambda a, b: _signed(a) >> min(b, 63),
    0x27: lambda a, b: a ^ b,
    0x29: lambda a, b: int(_signed(a) == _signed(b)),
    0x2A: lambda a, b: int(_signed(a) >= _signed(b)),
    0x2B: lambda a, b: int(_signed(a) > _signed(b)),
    0x2C: lambda a, b: int(_signed(a) <= _signed(b)),
    0x2D: lambda a, b: int(_signed(a) < _signed(b)),
    0x2E: lambda a, b: int(_signed(a) != _signed(b)),
}


def evaluate(expr: bytes, reg: Callable[[int], int], read: Callable[[int, int], int],
             initial: tuple[int, ...] = (), max_steps: int = 10_000) -> int:
    """The value an expression leaves on top of the stack.

    `reg(n)` gives DWARF register n of the frame (raising DwarfExprError when unknown),
    `read(addr, size)` reads `size` little-endian bytes of target memory (raising
    DwarfExprError when unreadable); `initial` is pushed first (the CFA for
    DW_CFA_expression rules).
    """
    st: list[int] = [v & MASK for v in initial]
    p = 0
    n = len(expr)
    steps = 0

    def pop() -> int:
        if not st:
            raise DwarfExprError("stack underflow")
        return st.pop()

    while p < n:
        steps += 1
        if steps > max_steps:
            raise DwarfExprError("too many steps (a loop?)")
        op = expr[p]
        p += 1
        if 0x30 <= op <= 0x4F:
            st.append(op - 0x30)
        elif 0x70 <= op <= 0x8F:
            off, p = _sleb(expr, p)
            st.append((reg(op - 0x70) + off) & MASK)
        elif op == 0x92:
            r, p = _uleb(expr, p)
            off, p = _sleb(expr, p)
            st.append((reg(r) + off) & MASK)
        elif op in _CONST:
            fmt, k = _CONST[op]
            if p + k > n:
                raise DwarfExprError("truncated constant")
            st.append(struct.unpack_from(fmt, expr, p)[0] & MASK)
            p += k
        elif op == 0x03:
            if p + 8 > n:
                raise DwarfExprError("truncated address")
            st.append(struct.unpack_from("<Q", expr, p)[0])
            p += 8
        elif op == 0x10:
            v, p = _uleb(expr, p)
            st.append(v & MASK)
        elif op == 0x11:
            v, p = _sleb(expr, p)
            st.append(v & MASK)
        elif op == 0x06:
            st.append(read(pop(), 8) & MASK)
        elif op == 0x94:
            if p >= n:
                raise DwarfExprError("truncated deref_size")
            size = expr[p]
            p += 1
            if size not in (1, 2, 4, 8):
                raise DwarfExprError(f"deref_size of {size} bytes")
            st.append(read(pop(), size) & ((1 << (8 * size)) - 1))
        elif op == 0x12:
            a = pop()
            st += [a, a]
        elif op == 0x13:
            pop()
        elif op == 0x14:
            if len(st) < 2:
                raise DwarfExprError("stack underflow")
            st.append(st[-2])
        elif op == 0x15:
            if p >= n:
                raise DwarfExprError("truncated pick")
            i = expr[p]
            p += 1
            if i >= len(st):
                raise DwarfExprError("pick past the stack")
            st.append(st[-1 - i])
        elif op == 0x16:
            b, a = pop(), pop()
            st += [b, a]
        elif op == 0x17:
            c, b, a = pop(), pop(), pop()
            st += [c, a, b]
        elif op == 0x19:
            st.append(abs(_signed(pop())) & MASK)
        elif op == 0x1F:
            st.append(-_signed(pop()) & MASK)
        elif op == 0x20:
            st.append(~pop() & MASK)
        elif op == 0x23:
            v, p = _uleb(expr, p)
            st.append((pop() + v) & MASK)
        elif op in (0x1B, 0x1D):
            b, a = _signed(pop()), _signed(pop())
            if b == 0:
                raise DwarfExprError("division by zero")
            if op == 0x1B:
                q = abs(a) // abs(b)
                st.append((q if (a < 0) == (b < 0) else -q) & MASK)
            else:
                st.append((a % b) & MASK)
        elif op in _BINARY:
            b, a = pop(), pop()
            st.append(_BINARY[op](a, b) & MASK)
        elif op in (0x28, 0x2F):
            if p + 2 > n:
                raise DwarfExprError("truncated branch")
            (off,) = struct.unpack_from("<h", expr, p)
            p += 2
            if op == 0x2F or pop() != 0:
                p += off
                if not 0 <= p <= n:
                    raise DwarfExprError("branch out of the expression")
        elif op == 0x96:
            continue
        else:
            raise DwarfExprError(f"unsupported operation {op:#x}")
    if not st:
        raise DwarfExprError("empty result")
    return st[-1]
