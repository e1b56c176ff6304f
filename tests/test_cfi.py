"""CFI tables against readelf, the DWARF expression evaluator, the on-disk cache."""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile

from memtrack.addrspace.modules import Module, ModuleStore
from memtrack.dwarf.cfi import (
    CFA_EXPR,
    CFA_NONE,
    T_RA,
    T_RBP,
    TRACKED,
    CFITable,
    Kind,
    Rule,
    _fdes,
    build_table,
)
from memtrack.dwarf.expr import DwarfExprError, evaluate

LIBS = {
    "libc": Path("/lib/x86_64-linux-gnu/libc.so.6"),
    "libstdc++": Path("/lib/x86_64-linux-gnu/libstdc++.so.6"),
    "python3": Path("/usr/bin/python3").resolve(),
}
REGNAMES = {"rax": 0, "rdx": 1, "rcx": 2, "rbx": 3, "rsi": 4, "rdi": 5, "rbp": 6, "rsp": 7,
            **{f"r{i}": i for i in range(8, 16)}, "rip": 16}

_REGCOL = re.compile(r"(\w+) \(\w+\)")
_FDE = re.compile(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE .*pc=([0-9a-f]+)\.\.([0-9a-f]+)")


def readelf_rows(path: Path) -> tuple[list[tuple[int, str, str, str]], list[tuple[int, int]]]:
    """(loc, cfa, ra, rbp) of every row readelf prints, and every FDE's range."""
    out = subprocess.run(["readelf", "--debug-dump=frames-interp", str(path)],
                         capture_output=True, text=True).stdout  # exits 1 without .debug_info
    rows: list[tuple[int, str, str, str]] = []
    fdes: list[tuple[int, int]] = []
    cols: list[str] | None = None
    in_fde = False
    for line in out.splitlines():
        m = _FDE.match(line)
        if m:
            fdes.append((int(m.group(1), 16), int(m.group(2), 16)))
            in_fde, cols = True, None
            continue
        if " CIE " in line or not line.strip():
            in_fde = in_fde and bool(line.strip())
            continue
        parts = _REGCOL.sub(r"\1", line).split()  # "r9 (r9)": a register rule
        if parts[0] == "LOC":
            cols = parts
            continue
        if in_fde and cols is not None and len(parts) == len(cols):
            d = dict(zip(cols, parts, strict=True))
            rows.append((int(parts[0], 16), d["CFA"], d.get("ra", "u"), d.get("rbp", "u")))
    return rows, fdes


def _rule_text_ok(text: str, kind: int, off: int) -> bool:
    if text == "u":
        return kind in (Rule.SAME, Rule.UNDEFINED)
    if text == "s":
        return kind == Rule.SAME
    if text == "exp":
        return kind == Rule.EXPRESSION
    if text == "vexp":
        return kind == Rule.VAL_EXPRESSION
    if text[0] in "cv" and text[1] in "+-":
        return kind == (Rule.OFFSET if text[0] == "c" else Rule.VAL_OFFSET) and off == int(
            text[1:])
    return kind == Rule.REGISTER


def _cfa_text(reg: int, off: int) -> str:
    if reg == CFA_EXPR:
        return "exp"
    name = {v: k for k, v in REGNAMES.items()}[reg]
    return f"{name}{off:+d}"


@pytest.mark.parametrize("name", sorted(LIBS))
def test_table_agrees_with_readelf_at_every_change_point(name: str) -> None:
    path = LIBS[name]
    table = build_table(path)
    assert table.problems == []
    rows, fdes = readelf_rows(path)
    assert len(rows) > 5000
    locs = np.array([r[0] for r in rows], dtype=np.uint64)
    idx = table.lookup(locs)
    assert (idx >= 0).all(), f"{int((idx < 0).sum())} readelf rows without a table row"
    bad = []
    for (loc, cfa, ra, rbp), i in zip(rows, idx.tolist(), strict=True):
        if table.extra[i] >= 0:
            full = table.row(i)
            c = full["cfa"]
            mine_cfa = "exp" if c[0] == "expr" else _cfa_text(c[1], c[2])
            ra_k, ra_o = full["regs"].get(16, [Rule.SAME, 0])
            bp_k, bp_o = full["regs"].get(6, [Rule.SAME, 0])
            ra_o = ra_o if isinstance(ra_o, int) else 0
            bp_o = bp_o if isinstance(bp_o, int) else 0
        else:
            mine_cfa = _cfa_text(int(table.cfa_reg[i]), int(table.cfa_off[i]))
            ra_k, ra_o = int(table.rule[i, T_RA]), int(table.off[i, T_RA])
            bp_k, bp_o = int(table.rule[i, T_RBP]), int(table.off[i, T_RBP])
        if (mine_cfa != cfa or not _rule_text_ok(ra, ra_k, ra_o)
                or not _rule_text_ok(rbp, bp_k, bp_o)):
            bad.append((hex(loc), cfa, ra, rbp, mine_cfa, ra_k, ra_o, bp_k, bp_o))
    assert bad == [], f"{len(bad)} rows differ, first: {bad[:5]}"
    # Conversely every change point of the table is a readelf row or an FDE start (an
    # FDE without instructions prints no rows), and every gap is an FDE end.
    starts = {s for s, _ in fdes}
    ends = {e for _, e in fdes}
    locset = set(locs.tolist())
    for pc, reg in zip(table.pc.tolist(), table.cfa_reg.tolist(), strict=True):
        if reg == CFA_NONE:
            assert pc in ends, hex(pc)
        else:
            assert pc in locset or pc in starts, hex(pc)
    # Each FDE's range is covered, and nothing outside the FDEs is.
    fs = np.array(sorted(fdes), dtype=np.uint64)
    assert (table.lookup(fs[:, 0]) >= 0).all()
    assert (table.lookup(fs[:, 1] - 1) >= 0).all()


def test_signal_trampoline_is_a_complex_signal_row() -> None:
    libc = LIBS["libc"]
    table = build_table(libc)
    # __restore_rt: mov $15, %rax; syscall (rt_sigreturn).
    off = libc.read_bytes().index(bytes.fromhex("48c7c00f0000000f05"))
    mod = ModuleStore(None).add_file(libc)
    addr = int(mod.file_offset_to_vaddr(np.array([off], dtype=np.uint64))[0])
    i = int(table.lookup(np.array([addr], dtype=np.uint64))[0])
    assert i >= 0
    assert table.kind[i] == Kind.SIGNAL and table.extra[i] >= 0
    # glibc starts the FDE one byte early so that a pc-1 lookup finds it too.
    assert int(table.lookup(np.array([addr - 1], dtype=np.uint64))[0]) == i
    full = table.row(i)
    assert full["cfa"][0] == "expr"
    assert full["regs"][16][0] == Rule.EXPRESSION  # rip from uc_mcontext
    # The CFA is the interrupted rsp: breg7 (rsp) + 160 (uc_mcontext.rsp), deref.
    stack = {0x1000 + 160: 0xDEAD0}
    cfa = evaluate(full["cfa"][1], lambda r: {7: 0x1000}[r], lambda a, n: stack[a])
    assert cfa == 0xDEAD0
    rip_at = evaluate(full["regs"][16][1], lambda r: {7: 0x1000}[r], lambda a, n: 0,
                      initial=(cfa,))
    assert rip_at == 0x1000 + 168  # uc_mcontext.rip


def test_plt_expression() -> None:
    # DW_CFA_def_cfa_expression of a lazy PLT: rsp + 8 + ((rip & 15) >= 11) << 3.
    expr = bytes([0x77, 8, 0x80, 0, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    for rip, extra in ((0x1000, 0), (0x100A, 0), (0x100B, 8), (0x100F, 8)):
        v = evaluate(expr, lambda r, rip=rip: {7: 0x7000, 16: rip}[r], lambda a, n: 0)
        assert v == 0x7000 + 8 + extra


def test_expression_operations() -> None:
    def reg(r: int) -> int:
        raise DwarfExprError(f"no register {r}")

    def mem(a: int, n: int) -> int:
        return int.from_bytes(struct.pack("<Q", 0x1122334455667788)[:n], "little")

    assert evaluate(bytes([0x10, 0xE5, 0x8E, 0x26]), reg, mem) == 624485  # constu leb
    assert evaluate(bytes([0x11, 0x7F, 0x23, 3]), reg, mem) == 2  # consts -1 + 3
    assert evaluate(bytes([0x35, 0x33, 0x1E]), reg, mem) == 15  # mul
    assert evaluate(bytes([0x35, 0x33, 0x1C]), reg, mem) == 2  # minus
    assert evaluate(bytes([0x30, 0x94, 2]), reg, mem) == 0x7788  # deref_size
    assert evaluate(bytes([0x30, 0x06]), reg, mem) == 0x1122334455667788
    assert evaluate(bytes([0x31, 0x28, 1, 0, 0x35, 0x36]), reg, mem) == 6  # bra taken
    assert evaluate(bytes([]), reg, mem, initial=(9,)) == 9
    with pytest.raises(DwarfExprError):
        evaluate(bytes([0x71, 0]), reg, mem)
    with pytest.raises(DwarfExprError):
        evaluate(bytes([0x50]), reg, mem)  # DW_OP_reg0 names a location, not a value
    with pytest.raises(DwarfExprError):
        evaluate(bytes([0x22]), reg, mem)


def test_cache_round_trip(tmp_path: Path) -> None:
    from memtrack.process.unwind import tables

    libc = LIBS["libc"]
    mod = Module("cafe" * 5, str(libc), libc)
    first = tables.extract(mod, cache=tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    tables._memo.clear()
    again = tables.extract(mod, cache=tmp_path)
    for col in ("pc", "cfa_reg", "cfa_off", "rule", "off", "kind", "extra"):
        assert np.array_equal(getattr(first, col), getattr(again, col)), col
    assert again.complex_rules == first.complex_rules
    assert again.rule.shape == (len(again), len(TRACKED))
    # libc's one rt_sigreturn sequence is __restore_rt, which its CFI covers, and CFI
    # covers its entry point: its unwind table is its CFI table
    a = build_table(libc)
    for col in ("pc", "kind", "extra"):
        assert np.array_equal(getattr(a, col), getattr(again, col)), col
    tables._memo.clear()


def test_module_table_places_rows_for_their_lookup_address() -> None:
    """SIGRETURN rows cover S - 1 (a return address S) where no CFI does or its row ends
    at S, and S (an exact pc) where no CFI does; ENTRY rows their range; FP the rest."""
    from memtrack.process.unwind.tables import SIGRETURN_RULES, module_table

    k = len(TRACKED)
    cfi = CFITable(np.array([0x100, 0x108, 0x110], np.uint64),
                   np.array([7, 7, CFA_NONE], np.int8), np.array([8, 16, 0], np.int64),
                   np.ones((3, k), np.int8), np.full((3, k), -8, np.int64),
                   np.array([Kind.CFI, Kind.CFI, Kind.FP], np.uint8),
                   np.full(3, -1, np.int32), [], [])
    t = module_table(cfi, np.array([0x104, 0x110, 0x200], np.uint64),
                     np.array([0x180, 0x1F0], np.uint64))
    keys = {0xFF: Kind.FP, 0x103: Kind.CFI, 0x104: Kind.CFI, 0x10E: Kind.CFI,
            0x10F: Kind.SIGRETURN, 0x110: Kind.SIGRETURN, 0x111: Kind.FP,
            0x17F: Kind.FP, 0x180: Kind.ENTRY, 0x1EF: Kind.ENTRY, 0x1F0: Kind.FP,
            0x1FE: Kind.FP, 0x1FF: Kind.SIGRETURN, 0x200: Kind.SIGRETURN, 0x201: Kind.FP}
    rows = t.lookup(np.array(list(keys), np.uint64))
    got = np.where(rows >= 0, t.kind[np.maximum(rows, 0)], Kind.FP)
    assert [hex(a) for a, want, kind in zip(keys, keys.values(), got.tolist(), strict=True)
            if kind != want] == []
    assert t.row(int(rows[list(keys).index(0x10F)])) == SIGRETURN_RULES
    assert int(t.cfa_off[rows[list(keys).index(0x10E)]]) == 16  # the row before resumes


def test_bad_input_is_reported_not_raised(tmp_path: Path) -> None:
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + b"\xff" * 60)
    t = build_table(junk)
    assert len(t) == 0
    assert len(t.problems) == 1 and str(junk) in t.problems[0]
    # A truncated .eh_frame entry: the FDEs before it are kept, the cut one reported.
    libc = LIBS["libc"]
    good = build_table(libc)
    with open(libc, "rb") as f:
        sec = ELFFile(f).get_section_by_name(".eh_frame")
        data, addr = sec.data(), sec["sh_addr"]
    fdes, problems = _fdes(data[:len(data) // 2], addr, True)
    assert problems and "runs past the section end" in problems[0]
    assert 0 < len(fdes) < len(np.unique(good.pc))
