"""A small, fast DWARF 2-5 reader for symbolization: line tables and inline chains.

Why not pyelftools here: it builds a Python object per DIE and per line row (~70 k
DIEs/s, ~40-90 k rows/s measured on libc6-dbg), and it has no way to skip the type and
variable subtrees that make up most of a unit. For 2000 random libc addresses (607
units: 339 k DIEs, 479 k line rows) it needs ~20 s; this reader needs ~1.7 s in all
(bench/bench_symbolize.py). It parses abbreviations once per unit, skips uninteresting
DIEs by their DW_AT_sibling (or by a size walk), reads only the attributes
symbolization needs, and runs the line program straight into flat arrays. pyelftools
is still used to open the ELF and get (decompressed) section bytes.

The result of one compilation unit is a pair of flat tables (`CuTables`): line rows
(address, file, line, column) sorted by address, and frame ranges (subprograms and
inlined subroutines with their parent, call site and resolved name). They are what the
cache stores per build id.
"""

from __future__ import annotations

import array
import bisect
import struct
from dataclasses import dataclass, field

import numpy as np

from memtrack.dwarf.leb128 import cstr, sleb, uleb

# Tags
TAG_COMPILE_UNIT = 0x11
TAG_PARTIAL_UNIT = 0x3C
TAG_SKELETON_UNIT = 0x4A
TAG_SUBPROGRAM = 0x2E
TAG_INLINED = 0x1D
TAG_LEXICAL_BLOCK = 0x0B
TAG_NAMESPACE = 0x39
# Attributes
AT_SIBLING = 0x01
AT_NAME = 0x03
AT_STMT_LIST = 0x10
AT_LOW_PC = 0x11
AT_HIGH_PC = 0x12
AT_COMP_DIR = 0x1B
AT_ABSTRACT_ORIGIN = 0x31
AT_SPECIFICATION = 0x47
AT_RANGES = 0x55
AT_CALL_COLUMN = 0x57
AT_CALL_FILE = 0x58
AT_CALL_LINE = 0x59
AT_LINKAGE_NAME = 0x6E
AT_MIPS_LINKAGE_NAME = 0x2007
AT_STR_OFFSETS_BASE = 0x72
AT_ADDR_BASE = 0x73
AT_RNGLISTS_BASE = 0x74
AT_GNU_ADDR_BASE = 0x2133
AT_GNU_RANGES_BASE = 0x2132

_FRAME_TAGS = (TAG_SUBPROGRAM, TAG_INLINED)
# DIEs whose children may hold code-bearing subprograms / inlined subroutines.
_DESCEND_TAGS = frozenset((TAG_SUBPROGRAM, TAG_INLINED, TAG_LEXICAL_BLOCK, TAG_NAMESPACE))
_REF_ATTRS = (AT_ABSTRACT_ORIGIN, AT_SPECIFICATION)
# Local classes (a lambda's closure type) hold member functions with code; they are
# descended into only inside a function, where they are few.
_LOCAL_TYPE_TAGS = frozenset((0x02, 0x13, 0x17))  # class, structure, union

# Form codes -> how to read them. Kinds: fixed sizes are ints; the rest are tags below.
_ULEB, _SLEB, _CSTR, _BLOCK1, _BLOCK2, _BLOCK4, _BLOCK, _OFFSET, _ADDR, _INDIRECT = (
    -1, -2, -3, -4, -5, -6, -7, -8, -9, -10)  # fmt: skip
FORM_ADDR, FORM_DATA2, FORM_DATA4, FORM_DATA8 = 0x01, 0x05, 0x06, 0x07
FORM_STRING, FORM_DATA1, FORM_SDATA, FORM_STRP, FORM_UDATA = 0x08, 0x0B, 0x0D, 0x0E, 0x0F
FORM_REF_ADDR, FORM_REF1, FORM_REF2, FORM_REF4, FORM_REF8, FORM_REF_UDATA = (
    0x10, 0x11, 0x12, 0x13, 0x14, 0x15)  # fmt: skip
FORM_SEC_OFFSET, FORM_FLAG_PRESENT, FORM_STRX, FORM_ADDRX = 0x17, 0x19, 0x1A, 0x1B
FORM_LINE_STRP, FORM_IMPLICIT_CONST, FORM_RNGLISTX = 0x1F, 0x21, 0x23
FORM_STRX1, FORM_STRX2, FORM_STRX3, FORM_STRX4 = 0x25, 0x26, 0x27, 0x28
FORM_ADDRX1, FORM_ADDRX2, FORM_ADDRX3, FORM_ADDRX4 = 0x29, 0x2A, 0x2B, 0x2C
FORM_GNU_ADDR_INDEX, FORM_GNU_STR_INDEX = 0x1F01, 0x1F02
FORM_GNU_REF_ALT, FORM_GNU_STRP_ALT = 0x1F20, 0x1F21

_FORM_KIND: dict[int, int] = {
    0x01: _ADDR, 0x03: _BLOCK2, 0x04: _BLOCK4, 0x05: 2, 0x06: 4, 0x07: 8, 0x08: _CSTR,
    0x09: _BLOCK, 0x0A: _BLOCK1, 0x0B: 1, 0x0C: 1, 0x0D: _SLEB, 0x0E: _OFFSET, 0x0F: _ULEB,
    0x10: _OFFSET, 0x11: 1, 0x12: 2, 0x13: 4, 0x14: 8, 0x15: _ULEB, 0x16: _INDIRECT,
    0x17: _OFFSET, 0x18: _BLOCK, 0x19: 0, 0x1A: _ULEB, 0x1B: _ULEB, 0x1C: 4, 0x1D: _OFFSET,
    0x1E: 16, 0x1F: _OFFSET, 0x20: 8, 0x21: 0, 0x22: _ULEB, 0x23: _ULEB, 0x24: 8, 0x25: 1,
    0x26: 2, 0x27: 3, 0x28: 4, 0x29: 1, 0x2A: 2, 0x2B: 3, 0x2C: 4, 0x1F01: _ULEB,
    0x1F02: _ULEB, 0x1F20: _OFFSET, 0x1F21: _OFFSET,
}  # fmt: skip
_CONST_FORMS = frozenset((FORM_DATA1, FORM_DATA2, FORM_DATA4, FORM_DATA8, FORM_SDATA,
                          FORM_UDATA, FORM_IMPLICIT_CONST))
_UNIT_REF_FORMS = frozenset((FORM_REF1, FORM_REF2, FORM_REF4, FORM_REF8, FORM_REF_UDATA))
_STRX_FORMS = frozenset((FORM_STRX, FORM_STRX1, FORM_STRX2, FORM_STRX3, FORM_STRX4,
                         FORM_GNU_STR_INDEX))
_ADDRX_FORMS = frozenset((FORM_ADDRX, FORM_ADDRX1, FORM_ADDRX2, FORM_ADDRX3, FORM_ADDRX4,
                          FORM_GNU_ADDR_INDEX))


# The forms a DWARF 5 line table's directory and file entries may use.
_LINE_ENTRY_FORMS = frozenset((FORM_STRING, FORM_LINE_STRP, FORM_STRP, FORM_UDATA, FORM_DATA1,
                               FORM_DATA2, FORM_DATA4, FORM_DATA8, 0x1E, 0x09)) | _STRX_FORMS


def read_form(data: bytes, off: int, form: int, kind: int, implicit: int) -> tuple[int, int]:
    """(value, offset after it) of one attribute value of `kind` (a fixed size in bytes
    or one of the _ULEB.. tags, address and offset sizes resolved): strings and blocks
    give the offset of their bytes in `data`."""
    if kind > 0:
        return int.from_bytes(data[off:off + kind], "little"), off + kind
    if kind == 0:
        return (implicit if form == FORM_IMPLICIT_CONST else 1), off
    if kind == _ULEB:
        return uleb(data, off)
    if kind == _SLEB:
        return sleb(data, off)
    if kind == _CSTR:
        return off, data.index(b"\0", off) + 1
    if kind == _BLOCK1:
        n, off = data[off], off + 1
    elif kind == _BLOCK2:
        n, off = int.from_bytes(data[off:off + 2], "little"), off + 2
    elif kind == _BLOCK4:
        n, off = int.from_bytes(data[off:off + 4], "little"), off + 4
    else:
        n, off = uleb(data, off)
    return off, off + n


class DwarfError(Exception):
    """Malformed or unsupported DWARF (worded for one line)."""


@dataclass
class Abbrev:
    tag: int
    has_children: bool
    # (attribute, form, implicit const, kind): kind is the byte size of a fixed-size form
    # in this unit (address and offset sizes resolved), else one of the _ULEB.. tags
    specs: list[tuple[int, int, int, int]]
    fixed_size: int | None = None  # byte size of the attributes when all are fixed-size
    sib_pos: int | None = None  # where a unit-relative DW_AT_sibling is, when at a fixed spot
    sib_size: int = 0


@dataclass
class Unit:
    offset: int  # of the unit header in .debug_info
    end: int  # offset just past the unit
    version: int
    unit_type: int
    addr_size: int
    offset_size: int
    abbrev_offset: int
    die_offset: int  # of the root DIE
    abbrevs: dict[int, Abbrev] = field(default_factory=dict)
    # filled from the root DIE
    root_tag: int = 0
    name: str = ""
    comp_dir: str = ""
    low_pc: int = 0
    stmt_list: int | None = None
    str_offsets_base: int = 8
    addr_base: int = 8
    rnglists_base: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class CuTables:
    """Flat symbolization tables of one compilation unit."""

    # line rows sorted by address; file == -1 marks an end of sequence (no line there)
    line_addr: np.ndarray  # uint64
    line_file: np.ndarray  # int32, index into files
    line_line: np.ndarray  # uint32
    line_col: np.ndarray  # uint32
    files: list[str]
    # frame ranges sorted by (lo, -hi): each is one address range of one frame node
    rng_lo: np.ndarray  # uint64
    rng_hi: np.ndarray  # uint64
    rng_node: np.ndarray  # int32
    rng_enclosing: np.ndarray  # int32, index of the nearest range containing this one
    # frame nodes (subprograms with code and inlined subroutines)
    node_parent: np.ndarray  # int32, nearest frame ancestor, -1 for a top subprogram
    node_inlined: np.ndarray  # bool
    node_call_file: np.ndarray  # int32 (-1 none)
    node_call_line: np.ndarray  # uint32
    node_call_col: np.ndarray  # uint32
    node_name: list[str | None]  # the linkage name if any, else the name (raw)


class Dwarf:
    """DWARF sections of one ELF (already decompressed), indexed by unit."""

    def __init__(self, sections: dict[str, bytes], exec_ranges: list[tuple[int, int]]) -> None:
        self.info = sections.get(".debug_info", b"")
        self.abbrev = sections.get(".debug_abbrev", b"")
        self.str = sections.get(".debug_str", b"")
        self.line_str = sections.get(".debug_line_str", b"")
        self.line = sections.get(".debug_line", b"")
        self.ranges_sec = sections.get(".debug_ranges", b"")
        self.rnglists = sections.get(".debug_rnglists", b"")
        self.addr = sections.get(".debug_addr", b"")
        self.str_offsets = sections.get(".debug_str_offsets", b"")
        self.aranges = sections.get(".debug_aranges", b"")
        self.exec_ranges = exec_ranges
        self.units: list[Unit] = []
        self._unit_starts: list[int] = []
        self._abbrev_cache: dict[tuple[int, int, int], dict[int, Abbrev]] = {}
        self._name_cache: dict[int, str | None] = {}
        self.problems: list[str] = []
        if self.info:
            self._scan_units()

    # ---- units and abbreviations -------------------------------------------------
    def _scan_units(self) -> None:
        data = self.info
        off = 0
        n = len(data)
        while off + 11 <= n:
            start = off
            (length,) = struct.unpack_from("<I", data, off)
            off += 4
            offset_size = 4
            if length == 0xFFFFFFFF:
                (length,) = struct.unpack_from("<Q", data, off)
                off += 8
                offset_size = 8
            elif length >= 0xFFFFFFF0:
                self.problems.append(f".debug_info+{start:#x}: reserved unit length")
                break
            end = off + length
            if end > n:
                self.problems.append(f".debug_info+{start:#x}: unit runs past the section")
                break
            (version,) = struct.unpack_from("<H", data, off)
            off += 2
            unit_type = 1
            if version >= 5:
                unit_type, addr_size = data[off], data[off + 1]
                off += 2
                abbrev_offset = int.from_bytes(data[off:off + offset_size], "little")
                off += offset_size
                if unit_type in (4, 5):  # skeleton, split compile: dwo id
                    off += 8
                elif unit_type in (2, 6):  # type units
                    off += 8 + offset_size
            elif version >= 2:
                abbrev_offset = int.from_bytes(data[off:off + offset_size], "little")
                off += offset_size
                addr_size = data[off]
                off += 1
            else:
                self.problems.append(f".debug_info+{start:#x}: DWARF version {version}")
                off = end
                continue
            if version > 5:
                self.problems.append(f".debug_info+{start:#x}: DWARF version {version}")
                off = end
                continue
            u = Unit(start, end, version, unit_type, addr_size, offset_size, abbrev_offset, off)
            self.units.append(u)
            self._unit_starts.append(start)
            off = end

    def _abbrevs(self, u: Unit) -> dict[int, Abbrev]:
        key = (u.abbrev_offset, u.addr_size, u.offset_size)
        cached = self._abbrev_cache.get(key)
        if cached is not None:
            return cached
        data = self.abbrev
        off = u.abbrev_offset
        table: dict[int, Abbrev] = {}
        sizes = {_ADDR: u.addr_size, _OFFSET: u.offset_size}
        while True:
            code, off = uleb(data, off)
            if code == 0:
                break
            tag, off = uleb(data, off)
            has_children = bool(data[off])
            off += 1
            specs = []
            size: int | None = 0
            sib_pos = None
            sib_kind = 0
            while True:
                attr, form = data[off], data[off + 1]
                if attr < 0x80 and form < 0x80:  # the usual one-byte pair
                    off += 2
                else:
                    attr, off = uleb(data, off)
                    form, off = uleb(data, off)
                if attr == 0 and form == 0:
                    break
                implicit = 0
                if form == FORM_IMPLICIT_CONST:
                    implicit, off = sleb(data, off)
                kind = _FORM_KIND.get(form)
                if kind is None:
                    raise DwarfError(f".debug_abbrev+{u.abbrev_offset:#x}: unknown form {form:#x}")
                kind = sizes.get(kind, kind)
                if attr == AT_SIBLING and size is not None and form in _UNIT_REF_FORMS and kind > 0:
                    sib_pos, sib_kind = size, kind
                if size is not None:
                    size = size + kind if kind >= 0 else None
                specs.append((attr, form, implicit, kind))
            table[code] = Abbrev(tag, has_children, specs, size, sib_pos, sib_kind)
        self._abbrev_cache[key] = table
        return table

    def unit_at(self, offset: int) -> Unit | None:
        i = bisect.bisect_right(self._unit_starts, offset) - 1
        if i < 0 or offset >= self.units[i].end:
            return None
        u = self.units[i]
        if not u.abbrevs:
            u.abbrevs = self._abbrevs(u)
            self._read_root(u)
        return u

    def _read_root(self, u: Unit) -> None:
        code, off = uleb(self.info, u.die_offset)
        ab = u.abbrevs.get(code)
        if ab is None:
            raise DwarfError(f".debug_info+{u.die_offset:#x}: unknown abbreviation {code}")
        u.root_tag = ab.tag
        raw, _ = self._read_raw(u, off, ab)
        # bases first: other attributes of the root may be indexed through them
        for attr, base in ((AT_STR_OFFSETS_BASE, "str_offsets_base"), (AT_ADDR_BASE, "addr_base"),
                           (AT_GNU_ADDR_BASE, "addr_base"), (AT_RNGLISTS_BASE, "rnglists_base"),
                           (AT_GNU_RANGES_BASE, "rnglists_base")):
            if attr in raw:
                setattr(u, base, raw[attr][1])
        if AT_LOW_PC in raw:
            u.low_pc = self._addr_value(u, *raw[AT_LOW_PC])
        if AT_NAME in raw:
            u.name = self._str_value(u, *raw[AT_NAME]) or ""
        if AT_COMP_DIR in raw:
            u.comp_dir = self._str_value(u, *raw[AT_COMP_DIR]) or ""
        if AT_STMT_LIST in raw:
            u.stmt_list = raw[AT_STMT_LIST][1]
        u.ranges = self._die_ranges(u, raw)

    # ---- DIE attribute reading ---------------------------------------------------
    def _read_raw(self, u: Unit, off: int, ab: Abbrev) -> tuple[dict[int, tuple[int, int]], int]:
        """All attributes of a DIE as attr -> (form, value); strings (DW_FORM_string) and
        blocks are returned as their offset in .debug_info."""
        data = self.info
        out: dict[int, tuple[int, int]] = {}
        for attr, form, implicit, kind in ab.specs:
            if kind > 0:
                out[attr] = (form, int.from_bytes(data[off:off + kind], "little"))
                off += kind
                continue
            if kind == _INDIRECT:
                form, off = uleb(data, off)
                kind = _FORM_KIND[form]
                kind = {_ADDR: u.addr_size, _OFFSET: u.offset_size}.get(kind, kind)
                if kind > 0:
                    out[attr] = (form, int.from_bytes(data[off:off + kind], "little"))
                    off += kind
                    continue
            val, off = read_form(data, off, form, kind, implicit)
            out[attr] = (form, val)
        return out, off

    def _skip_children_by_sibling(self, u: Unit, die_off: int, off: int, ab: Abbrev) -> int:
        """Offset of the next sibling of a DIE with children whose attributes start at
        `off`: its DW_AT_sibling, else a walk over its subtree."""
        if ab.sib_pos is not None:
            p = off + ab.sib_pos
            target = u.offset + int.from_bytes(self.info[p:p + ab.sib_size], "little")
            if not die_off < target <= u.end:
                raise DwarfError(f".debug_info+{die_off:#x}: DW_AT_sibling {target:#x} outside "
                                 "the unit")
            return target
        raw, off = self._read_raw(u, off, ab)
        sib = raw.get(AT_SIBLING)
        return self._sibling(u, die_off, sib) if sib else self._skip_subtree(u, off)

    def _skip_attrs(self, u: Unit, off: int, ab: Abbrev) -> int:
        if ab.fixed_size is not None:
            return off + ab.fixed_size
        return self._read_raw(u, off, ab)[1]

    def _str_value(self, u: Unit, form: int, val: int) -> str | None:
        if form == FORM_STRING:
            return cstr(self.info, val)
        if form == FORM_STRP:
            return cstr(self.str, val)
        if form == FORM_LINE_STRP:
            return cstr(self.line_str, val)
        if form in _STRX_FORMS:
            pos = u.str_offsets_base + val * u.offset_size
            off = int.from_bytes(self.str_offsets[pos:pos + u.offset_size], "little")
            return cstr(self.str, off)
        return None  # alternate (dwz) strings are not available

    def _addr_value(self, u: Unit, form: int, val: int) -> int:
        if form in _ADDRX_FORMS:
            pos = u.addr_base + val * u.addr_size
            return int.from_bytes(self.addr[pos:pos + u.addr_size], "little")
        return val

    def _die_ranges(self, u: Unit, raw: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
        if AT_LOW_PC in raw and AT_HIGH_PC in raw:
            lo = self._addr_value(u, *raw[AT_LOW_PC])
            hform, hval = raw[AT_HIGH_PC]
            hi = lo + hval if hform in _CONST_FORMS else self._addr_value(u, hform, hval)
            return [(lo, hi)] if hi > lo else []
        if AT_RANGES in raw:
            form, val = raw[AT_RANGES]
            return self._ranges(u, form, val)
        if AT_LOW_PC in raw:
            lo = self._addr_value(u, *raw[AT_LOW_PC])
            return [(lo, lo + 1)]
        return []

    def _ranges(self, u: Unit, form: int, val: int) -> list[tuple[int, int]]:
        if u.version < 5:
            return self._ranges_v4(u, val)
        if form == FORM_RNGLISTX:
            pos = u.rnglists_base + val * u.offset_size
            val = u.rnglists_base + int.from_bytes(
                self.rnglists[pos:pos + u.offset_size], "little")
        return self._rnglist(u, val)

    def _ranges_v4(self, u: Unit, off: int) -> list[tuple[int, int]]:
        data = self.ranges_sec
        a = u.addr_size
        maxa = (1 << (8 * a)) - 1
        base = u.low_pc
        out = []
        while off + 2 * a <= len(data):
            lo = int.from_bytes(data[off:off + a], "little")
            hi = int.from_bytes(data[off + a:off + 2 * a], "little")
            off += 2 * a
            if lo == 0 and hi == 0:
                break
            if lo == maxa:
                base = hi
                continue
            if hi > lo:
                out.append((base + lo, base + hi))
        return out

    def _rnglist(self, u: Unit, off: int) -> list[tuple[int, int]]:
        data = self.rnglists
        a = u.addr_size
        base = u.low_pc
        out = []

        def addrx(i: int) -> int:
            pos = u.addr_base + i * a
            return int.from_bytes(self.addr[pos:pos + a], "little")

        while off < len(data):
            kind = data[off]
            off += 1
            if kind == 0:
                break
            if kind == 1:
                i, off = uleb(data, off)
                base = addrx(i)
                continue
            if kind == 5:
                base = int.from_bytes(data[off:off + a], "little")
                off += a
                continue
            if kind == 2:
                i, off = uleb(data, off)
                j, off = uleb(data, off)
                lo, hi = addrx(i), addrx(j)
            elif kind == 3:
                i, off = uleb(data, off)
                n, off = uleb(data, off)
                lo = addrx(i)
                hi = lo + n
            elif kind == 4:
                x, off = uleb(data, off)
                y, off = uleb(data, off)
                lo, hi = base + x, base + y
            elif kind == 6:
                lo = int.from_bytes(data[off:off + a], "little")
                hi = int.from_bytes(data[off + a:off + 2 * a], "little")
                off += 2 * a
            elif kind == 7:
                lo = int.from_bytes(data[off:off + a], "little")
                off += a
                n, off = uleb(data, off)
                hi = lo + n
            else:
                raise DwarfError(f".debug_rnglists+{off - 1:#x}: unknown entry kind {kind}")
            if hi > lo:
                out.append((lo, hi))
        return out

    # ---- names -------------------------------------------------------------------
    def die_name(self, offset: int) -> str | None:
        """The linkage name of the DIE at `offset` (following DW_AT_abstract_origin and
        DW_AT_specification), else its DW_AT_name the same way; like LLVM's
        getSubroutineName(LinkageName)."""
        if offset in self._name_cache:
            return self._name_cache[offset]
        linkage = None
        plain = None
        todo = [offset]
        seen = set()
        while todo and linkage is None:
            off = todo.pop()
            if off in seen:
                continue
            seen.add(off)
            u = self.unit_at(off)
            if u is None:
                break
            code, p = uleb(self.info, off)
            ab = u.abbrevs.get(code)
            if ab is None:
                break
            raw, _ = self._read_raw(u, p, ab)
            for attr in (AT_LINKAGE_NAME, AT_MIPS_LINKAGE_NAME):
                if attr in raw:
                    linkage = self._str_value(u, *raw[attr])
                    break
            if plain is None and AT_NAME in raw:
                plain = self._str_value(u, *raw[AT_NAME])
            for attr in _REF_ATTRS:
                if attr in raw:
                    todo.append(self._ref(u, *raw[attr]))
        name = linkage or plain
        self._name_cache[offset] = name
        return name

    @staticmethod
    def _ref(u: Unit, form: int, val: int) -> int:
        return val + u.offset if form in _UNIT_REF_FORMS else val

    # ---- compilation-unit index --------------------------------------------------
    def cu_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lo, hi, unit offset) of every address range of every unit, sorted by lo:
        .debug_aranges, plus the root DIE ranges of units that aranges leaves out."""
        rows: list[tuple[int, int, int]] = []
        covered: set[int] = set()
        data = self.aranges
        off = 0
        while off + 12 <= len(data):
            (length,) = struct.unpack_from("<I", data, off)
            hdr = off + 4
            osz = 4
            if length == 0xFFFFFFFF:
                (length,) = struct.unpack_from("<Q", data, off + 4)
                hdr = off + 12
                osz = 8
            end = hdr + length
            cu_off = int.from_bytes(data[hdr + 2:hdr + 2 + osz], "little")
            a = data[hdr + 2 + osz]
            seg = data[hdr + 3 + osz]
            p = hdr + 4 + osz
            tup = 2 * a + seg
            p = off + ((p - off + tup - 1) // tup) * tup if tup else p
            covered.add(cu_off)
            while p + 2 * a <= end:
                lo = int.from_bytes(data[p + seg:p + seg + a], "little")
                n = int.from_bytes(data[p + seg + a:p + seg + 2 * a], "little")
                p += tup
                if lo == 0 and n == 0:
                    break
                if n:
                    rows.append((lo, lo + n, cu_off))
            off = end
        for u in self.units:
            if u.offset in covered or u.unit_type not in (1, 3):
                continue
            try:
                uu = self.unit_at(u.offset)
            except (DwarfError, IndexError, KeyError, ValueError, struct.error) as e:
                self.problems.append(f".debug_info+{u.offset:#x}: bad unit ({e})")
                continue
            if uu is not None:
                rows.extend((lo, hi, u.offset) for lo, hi in uu.ranges)
        rows = [r for r in rows if self._in_exec(r[0])]
        rows.sort(key=lambda r: (r[0], -r[1]))
        if not rows:
            e = np.zeros(0, dtype=np.uint64)
            return e, e, np.zeros(0, dtype=np.int64)
        arr = np.array(rows, dtype=np.uint64)
        return arr[:, 0], arr[:, 1], arr[:, 2].astype(np.int64)

    def _in_exec(self, addr: int) -> bool:
        if not self.exec_ranges:
            return True
        return any(lo <= addr < hi for lo, hi in self.exec_ranges)

    # ---- one compilation unit ----------------------------------------------------
    def cu_tables(self, cu_offset: int) -> CuTables:
        u = self.unit_at(cu_offset)
        if u is None:
            raise DwarfError(f".debug_info+{cu_offset:#x}: no unit there")
        files, lines = self._line_table(u)
        nodes = self._frame_nodes(u)
        return _flatten(u, files, lines, nodes, self)

    def _frame_nodes(self, u: Unit) -> list[tuple[int, int, int, int, int, int, list]]:
        """(die offset, parent node, tag, call_file, call_line, call_col, ranges) of
        every subprogram with code and inlined subroutine in the unit."""
        data = self.info
        abbrevs = u.abbrevs
        code, off = uleb(data, u.die_offset)
        root = abbrevs[code]
        if not root.has_children:
            return []
        off = self._skip_attrs(u, off, root)
        nodes: list[tuple[int, int, int, int, int, int, list]] = []
        # stack of the frame node index each open scope belongs to
        scope: list[int] = [-1]
        end = u.end
        while off < end and scope:
            die_off = off
            code, off = uleb(data, off)
            if code == 0:
                scope.pop()
                continue
            ab = abbrevs.get(code)
            if ab is None:
                raise DwarfError(f".debug_info+{die_off:#x}: unknown abbreviation {code}")
            tag = ab.tag
            if tag not in _DESCEND_TAGS and not (tag in _LOCAL_TYPE_TAGS and scope[-1] >= 0):
                if not ab.has_children:
                    off = self._skip_attrs(u, off, ab)
                else:
                    off = self._skip_children_by_sibling(u, die_off, off, ab)
                continue
            raw, off = self._read_raw(u, off, ab)
            parent = scope[-1]
            if tag in _FRAME_TAGS:
                rngs = self._die_ranges(u, raw)
                if not rngs:
                    # an abstract instance or a declaration: no code, nothing below it
                    # that has code either
                    if ab.has_children:
                        sib = raw.get(AT_SIBLING)
                        off = self._sibling(u, die_off, sib) if sib else self._skip_subtree(u, off)
                    continue
                cf = raw.get(AT_CALL_FILE, (0, -1))[1] if tag == TAG_INLINED else -1
                cl = raw.get(AT_CALL_LINE, (0, 0))[1] if tag == TAG_INLINED else 0
                cc = raw.get(AT_CALL_COLUMN, (0, 0))[1] if tag == TAG_INLINED else 0
                nodes.append((die_off, parent, tag, cf, cl, cc, rngs))
                parent = len(nodes) - 1
            if ab.has_children:
                scope.append(parent)
        if off > end:
            raise DwarfError(f".debug_info+{u.offset:#x}: DIE tree runs past the unit's end")
        return nodes

    @staticmethod
    def _sibling(u: Unit, die_off: int, sib: tuple[int, int]) -> int:
        target = Dwarf._ref(u, *sib)
        if not die_off < target <= u.end:
            raise DwarfError(f".debug_info+{die_off:#x}: DW_AT_sibling {target:#x} outside "
                             "the unit")
        return target


    def _skip_subtree(self, u: Unit, off: int) -> int:
        """Offset just past the children of a DIE whose attributes end at `off`."""
        data = self.info
        depth = 1
        abbrevs = u.abbrevs
        while depth:
            if off >= u.end:
                raise DwarfError(f".debug_info+{u.offset:#x}: DIE tree runs past the unit's end")
            die_off = off
            code, off = uleb(data, off)
            if code == 0:
                depth -= 1
                continue
            ab = abbrevs.get(code)
            if ab is None:
                raise DwarfError(f".debug_info+{die_off:#x}: unknown abbreviation {code}")
            if ab.has_children:
                if ab.sib_pos is not None:
                    off = self._skip_children_by_sibling(u, die_off, off, ab)
                    continue
                raw, off = self._read_raw(u, off, ab)
                sib = raw.get(AT_SIBLING)
                if sib is not None:
                    off = self._sibling(u, die_off, sib)
                else:
                    depth += 1
            else:
                off = self._skip_attrs(u, off, ab)
        return off

    # ---- line programs -------------------------------------------------------------
    def _line_table(self, u: Unit) -> tuple[list[str], array.array]:
        if u.stmt_list is None or not self.line:
            return [], array.array("Q")
        return parse_line_program(self, u, u.stmt_list)


def _join(*parts: str) -> str:
    """Join path components like LLVM's sys::path::append (no normalization)."""
    out = ""
    for c in parts:
        if not c:
            continue
        if out and out.endswith("/"):
            out += c.lstrip("/")
        elif out and not c.startswith("/"):
            out += "/" + c
        else:
            out += c
    return out


def parse_line_program(dw: Dwarf, u: Unit, off: int) -> tuple[list[str], array.array]:
    """Run one line program: (file paths, rows as flat (addr, file, line, col, end)
    quintuples; an array of u64 converts to numpy without a copy)."""
    data = dw.line
    (length,) = struct.unpack_from("<I", data, off)
    p = off + 4
    osz = 4
    if length == 0xFFFFFFFF:
        (length,) = struct.unpack_from("<Q", data, p)
        p += 8
        osz = 8
    end = p + length
    if end > len(data):
        raise DwarfError(f".debug_line+{off:#x}: program runs past the section")
    (version,) = struct.unpack_from("<H", data, p)
    p += 2
    addr_size = u.addr_size
    if version >= 5:
        addr_size = data[p]
        p += 2
    if version < 2 or version > 5:
        raise DwarfError(f".debug_line+{off:#x}: line table version {version}")
    header_length = int.from_bytes(data[p:p + osz], "little")
    p += osz
    prog = p + header_length
    min_inst = data[p]
    p += 1
    if version >= 4:
        p += 1  # maximum_operations_per_instruction (VLIW only)
    line_base = struct.unpack_from("<b", data, p + 1)[0]  # data[p] is default_is_stmt
    line_range = data[p + 2]
    opcode_base = data[p + 3]
    p += 4
    std_lengths = list(data[p:p + opcode_base - 1])
    p += opcode_base - 1
    comp_dir = u.comp_dir
    files: list[str] = []
    if version >= 5:
        dirs, p = _v5_entries(dw, u, data, p, osz)
        dir_names = [d.get(1, "") for d in dirs]
        fentries, p = _v5_entries(dw, u, data, p, osz)
        for fe in fentries:
            name = fe.get(1, "")
            di = fe.get(2, 0)
            if name.startswith("/"):
                files.append(name)
                continue
            inc = dir_names[di] if isinstance(di, int) and di < len(dir_names) else ""
            if di != 0 and comp_dir and not inc.startswith("/"):
                files.append(_join(comp_dir, inc, name))
            else:
                files.append(_join(inc, name))
    else:
        dir_names = []
        while data[p]:
            e = data.index(b"\0", p)
            dir_names.append(data[p:e].decode("utf-8", "replace"))
            p = e + 1
        p += 1
        files.append("")  # DWARF < 5 numbers files from 1
        while data[p]:
            e = data.index(b"\0", p)
            name = data[p:e].decode("utf-8", "replace")
            p = e + 1
            di, p = uleb(data, p)
            _, p = uleb(data, p)
            _, p = uleb(data, p)
            files.append(_v4_path(comp_dir, dir_names, di, name))
    rows = array.array("Q")
    _run_program(data, prog, end, addr_size, min_inst, line_base, line_range, opcode_base,
                 std_lengths, rows, files, comp_dir, dir_names, version)
    return files, rows


def _v4_path(comp_dir: str, dir_names: list[str], di: int, name: str) -> str:
    if name.startswith("/"):
        return name
    inc = dir_names[di - 1] if 0 < di <= len(dir_names) else ""
    if comp_dir and not inc.startswith("/"):
        return _join(comp_dir, inc, name)
    return _join(inc, name)


def _v5_entries(dw: Dwarf, u: Unit, data: bytes, p: int,
                osz: int) -> tuple[list[dict[int, object]], int]:
    nfmt = data[p]
    p += 1
    fmts = []
    for _ in range(nfmt):
        ct, p = uleb(data, p)
        form, p = uleb(data, p)
        fmts.append((ct, form))
    count, p = uleb(data, p)
    out = []
    sizes = {_ADDR: u.addr_size, _OFFSET: osz}
    for _ in range(count):
        entry: dict[int, object] = {}
        for ct, form in fmts:
            kind = _FORM_KIND.get(form)
            if kind is None or form not in _LINE_ENTRY_FORMS:
                raise DwarfError(f".debug_line: unsupported entry form {form:#x}")
            raw, p = read_form(data, p, form, sizes.get(kind, kind), 0)
            val: object = raw
            if form == FORM_STRING:
                val = cstr(data, raw)
            elif form == FORM_LINE_STRP:
                val = cstr(dw.line_str, raw)
            elif form == FORM_STRP:
                val = cstr(dw.str, raw)
            elif form in _STRX_FORMS:
                val = dw._str_value(u, FORM_STRX, raw)
            elif form in (0x1E, 0x09):  # data16 (MD5), block: not needed
                val = None
            entry[ct] = val
        out.append(entry)
    return out, p


def _run_program(data: bytes, p: int, end: int, addr_size: int, min_inst: int, line_base: int,
                 line_range: int, opcode_base: int, std_lengths: list[int],
                 rows: array.array, files: list[str], comp_dir: str,
                 dir_names: list[str], version: int) -> None:
    """The line-number state machine; appends (addr, file, line, col, end) rows."""
    append = rows.extend
    # special opcodes are most of a program: their address and line steps, by opcode
    adv_addr = [0] * 256
    adv_line = [0] * 256
    for op in range(opcode_base, 256):
        adj = op - opcode_base
        adv_addr[op] = (adj // line_range) * min_inst
        adv_line[op] = line_base + adj % line_range
    addr = 0
    file = 1
    line = 1
    col = 0
    while p < end:
        op = data[p]
        p += 1
        if op >= opcode_base:
            addr += adv_addr[op]
            line += adv_line[op]
            append((addr, file, line, col, 0))
        elif op == 0:
            n, p = uleb(data, p)
            sub = data[p]
            if sub == 1:
                append((addr, file, line, col, 1))
                addr, file, line, col = 0, 1, 1, 0
            elif sub == 2:
                addr = int.from_bytes(data[p + 1:p + 1 + addr_size], "little")
            elif sub == 3 and version < 5:
                e = data.index(b"\0", p + 1)
                name = data[p + 1:e].decode("utf-8", "replace")
                di, _ = uleb(data, e + 1)
                files.append(_v4_path(comp_dir, dir_names, di, name))
            p += n
        elif op == 1:
            append((addr, file, line, col, 0))
        elif op == 2:
            v, p = uleb(data, p)
            addr += v * min_inst
        elif op == 3:
            v, p = sleb(data, p)
            line += v
        elif op == 4:
            file, p = uleb(data, p)
        elif op == 5:
            col, p = uleb(data, p)
        elif op == 8:
            addr += ((255 - opcode_base) // line_range) * min_inst
        elif op == 9:
            addr += int.from_bytes(data[p:p + 2], "little")
            p += 2
        else:
            for _ in range(std_lengths[op - 1]):
                _, p = uleb(data, p)


def _flatten(u: Unit, files: list[str], rows: array.array,
             nodes: list[tuple[int, int, int, int, int, int, list]], dw: Dwarf) -> CuTables:
    # Line rows: split into sequences, keep those that start in executable code and do
    # not overlap an earlier one (garbage-collected functions keep sequences at 0),
    # then concatenate in address order.
    if rows:
        arr = np.frombuffer(rows, dtype=np.uint64).reshape(-1, 5)
        ends = np.flatnonzero(arr[:, 4] == 1)
        starts = np.concatenate(([0], ends[:-1] + 1))
        seqs = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            lo, hi = int(arr[s, 0]), int(arr[e, 0])
            if hi > lo and dw._in_exec(lo):
                seqs.append((lo, hi, s, e))
        seqs.sort()
        keep = []
        last_hi = 0
        for lo, hi, s, e in seqs:
            if lo >= last_hi:
                keep.append(np.arange(s, e + 1))
                last_hi = hi
        idx = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
        sel = arr[idx]
        line_addr = sel[:, 0].copy()
        line_file = np.where(sel[:, 4] == 1, -1, sel[:, 1].astype(np.int64)).astype(np.int32)
        line_line = sel[:, 2].astype(np.uint32)
        line_col = sel[:, 3].astype(np.uint32)
    else:
        line_addr = np.zeros(0, dtype=np.uint64)
        line_file = np.zeros(0, dtype=np.int32)
        line_line = np.zeros(0, dtype=np.uint32)
        line_col = np.zeros(0, dtype=np.uint32)
    # Frame ranges sorted by (lo, -hi), with each range's nearest enclosing range.
    rl = [(lo, hi, i) for i, n in enumerate(nodes) for lo, hi in n[6]]
    # ties: a parent's range before its child's (nodes are numbered in tree order)
    rl.sort(key=lambda r: (r[0], -r[1], r[2]))
    enclosing = []
    stack: list[int] = []
    for j, (_lo, hi, _) in enumerate(rl):
        while stack and rl[stack[-1]][1] < hi:
            stack.pop()
        enclosing.append(stack[-1] if stack else -1)
        stack.append(j)
    return CuTables(
        line_addr=line_addr,
        line_file=line_file,
        line_line=line_line,
        line_col=line_col,
        files=files,
        rng_lo=np.array([r[0] for r in rl], dtype=np.uint64),
        rng_hi=np.array([r[1] for r in rl], dtype=np.uint64),
        rng_node=np.array([r[2] for r in rl], dtype=np.int32),
        rng_enclosing=np.array(enclosing, dtype=np.int32),
        node_parent=np.array([n[1] for n in nodes], dtype=np.int32),
        node_inlined=np.array([n[2] == TAG_INLINED for n in nodes], dtype=bool),
        node_call_file=np.array([n[3] for n in nodes], dtype=np.int32),
        node_call_line=np.array([n[4] for n in nodes], dtype=np.uint32),
        node_call_col=np.array([n[5] for n in nodes], dtype=np.uint32),
        node_name=[dw.die_name(n[0]) for n in nodes],
    )
