"""LEB128 numbers and NUL-terminated strings, as DWARF, CFI and DWARF expressions
encode them (one decoder for all three)."""

from __future__ import annotations


def uleb(data: bytes, off: int) -> tuple[int, int]:
    b = data[off]
    if b < 0x80:
        return b, off + 1
    result = b & 0x7F
    shift = 7
    off += 1
    while True:
        b = data[off]
        off += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, off
        shift += 7


def sleb(data: bytes, off: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        b = data[off]
        off += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, off


def cstr(data: bytes, off: int) -> str:
    end = data.index(b"\0", off)
    return data[off:end].decode("utf-8", "replace")
