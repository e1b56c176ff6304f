"""The unwinder on stacks the fixtures snapshot themselves (what a malloc uprobe sees):
call chains known by construction, built four ways, and the hard cases."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import capstone
import numpy as np
import pyarrow as pa
import pytest
from elftools.elf.elffile import ELFFile
from support.snaps import (
    VARIANTS,
    Snaps,
    build_fixture,
    read_snaps,
    run_snaps,
    snap_lib,
    unwind_named,
)

from memtrack.addrspace.modules import ModuleStore
from memtrack.process.unwind import unwind

LIBC_START = ["__libc_start_call_main", "__libc_start_main", "_start"]
GDB_ALIASES = {"__libc_start_main_impl": "__libc_start_main"}
SIGRETURN = bytes.fromhex("48c7c00f0000000f05")


def cases(variant: str) -> Path:
    return build_fixture(["unwind/cases.c"], VARIANTS[variant], f"cases-{variant}",
                         libs=("-lpthread",))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chain_four_builds(variant: str, tmp_path: Path) -> None:
    exe = build_fixture(["unwind/chain.c"], VARIANTS[variant], f"chain-{variant}")
    snaps = run_snaps([str(exe)], tmp_path)
    assert snaps.sizes == [102, 112, 122]
    named, res = unwind_named(snaps)
    assert len(named) == 3
    for n in named:
        assert n.names == ["mt_snap", "c", "b", "a", "main", *LIBC_START]
        assert n.methods == ["regs"] + ["cfi"] * 7
        assert n.complete and not n.truncated and n.stop == "complete"
    assert res.counters["unwind_stop_complete"] == 3
    assert res.counters["unwind_frames_cfi"] == 21
    assert res.problems == []
    # Symbols and CFI are looked up at the pc for frame 0, at the return address - 1 after.
    for f in res.stack_frames.to_pylist()[:8]:
        assert f["lookup_vaddr"] == _vaddr_of(snaps, f) - (f["depth"] > 0)


def test_frame_pointer_fallback_without_cfi(tmp_path: Path) -> None:
    """No .eh_frame for the program, nor for the snapshot entry (frame 0): the first
    step knows from the symbol table that the pc is a function's first instruction (rbp
    not pushed yet), the next ones follow rbp, libc's frames use its CFI again."""
    exe = build_fixture(["unwind/chain.c"], (
        "-O2", "-fno-omit-frame-pointer", "-fno-asynchronous-unwind-tables",
        "-fno-unwind-tables", "-DSNAP=mt_snap_nocfi"), "chain-nocfi", debug=False)
    sections = subprocess.run(["readelf", "-SW", str(exe)], capture_output=True, text=True,
                              check=True).stdout
    assert ".debug_frame" not in sections
    named, _ = unwind_named(run_snaps([str(exe)], tmp_path))
    for n in named:
        assert n.names == ["mt_snap_nocfi", "c", "b", "a", "main", *LIBC_START]
        assert n.methods == ["regs", "fp", "fp", "fp", "fp", "fp", "cfi", "cfi"]
        assert n.complete


def _nm(exe: Path, symbol: str) -> int:
    out = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[0], 16) for line in out.splitlines()
                if line.split()[-1] == symbol)


def _with_frame0(snaps: Snaps, rip: list[int], rsp: list[int], rbp: list[int]) -> Snaps:
    """The same stacks with frame 0 moved to another (rip, rsp, rbp): the copy is cut to
    start at the new rsp (which must lie above the old one)."""
    t = snaps.stacks
    regs = np.array(t.column("regs").to_pylist(), dtype=np.uint64)
    old = t.column("sp").to_pylist()
    stack = [bytes(s)[n - o:] for s, n, o in zip(t.column("stack").to_pylist(), rsp, old,
                                                  strict=True)]
    regs[:, 16], regs[:, 7], regs[:, 6] = rip, rsp, rbp
    for name, arr in (("regs", pa.array(regs.tolist(), t.schema.field("regs").type)),
                      ("stack", pa.array(stack, pa.binary())),
                      ("sp", pa.array(rsp, pa.uint64()))):
        t = t.set_column(t.schema.get_field_index(name), name, arr)
    return Snaps(t, snaps.mappings, snaps.sizes)


@pytest.mark.parametrize("at, state", [(0, "entry"), (1, "pushed"), (4, "body"),
                                       (9, "pushed"), (10, "entry")])
def test_frame0_prologue_and_epilogue_without_cfi(at: int, state: str, tmp_path: Path
                                                  ) -> None:
    """Frame 0 at each instruction of `push rbp; mov rbp,rsp; call; pop rbp; ret` in a
    function without CFI: capstone tells where rbp is not (yet / any more) the frame."""
    exe = build_fixture(["unwind/chain.c"], (
        "-O2", "-fno-omit-frame-pointer", "-fno-asynchronous-unwind-tables",
        "-fno-unwind-tables", "-DSNAP=mt_snap_nocfi"), "chain-nocfi", debug=False)
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(exe)],
                          capture_output=True, text=True, check=True).stdout
    c = _nm(exe, "c")
    body = code[code.index(f"{c:x} <c>:"):].split("\n\n")[0]
    assert [ln.split("\t")[1].split()[0] for ln in body.splitlines()[1:6]] == [
        "push", "mov", "call", "pop", "ret"]
    snaps = run_snaps([str(exe)], tmp_path)
    regs = np.array(snaps.stacks.column("regs").to_pylist(), dtype=np.uint64)
    sp = snaps.stacks.column("sp").to_pylist()
    rbp_c = regs[:, 6].tolist()  # c's frame pointer at the snapshot entry
    rbp_b = [int.from_bytes(bytes(s)[r - o:r - o + 8], "little") for s, r, o in zip(
        snaps.stacks.column("stack").to_pylist(), rbp_c, sp, strict=True)]
    rip = [_runtime(snaps, exe, c + at)] * len(sp)
    if state == "entry":
        moved = _with_frame0(snaps, rip, [r + 8 for r in rbp_c], rbp_b)
    elif state == "pushed":
        moved = _with_frame0(snaps, rip, rbp_c, rbp_b if at == 1 else rbp_c)
    else:
        moved = _with_frame0(snaps, rip, rbp_c, rbp_c)
    named, _ = unwind_named(moved)
    for n in named:
        assert n.names == ["c", "b", "a", "main", *LIBC_START]
        assert n.methods == ["regs", "fp", "fp", "fp", "fp", "cfi", "cfi"]


def test_debug_frame_only(tmp_path: Path) -> None:
    """-fno-asynchronous-unwind-tables -g puts the program's CFI in .debug_frame only;
    without frame pointers nothing else could unwind it."""
    exe = build_fixture(["unwind/chain.c"], (
        "-O2", "-fomit-frame-pointer", "-fno-asynchronous-unwind-tables"), "chain-debugframe")
    sections = subprocess.run(["readelf", "-SW", str(exe)], capture_output=True, text=True,
                              check=True).stdout
    assert ".debug_frame" in sections
    named, res = unwind_named(run_snaps([str(exe)], tmp_path))
    for n in named:
        assert n.names == ["mt_snap", "c", "b", "a", "main", *LIBC_START]
        assert n.methods == ["regs"] + ["cfi"] * 7
    assert res.problems == []


def _plt_entry(exe: Path, symbol: str) -> int:
    out = subprocess.run(["objdump", "-d", "-j", ".plt", str(exe)], capture_output=True,
                         text=True, check=True).stdout
    m = re.search(rf"^([0-9a-f]+) <{symbol}@plt>:", out, re.M)
    assert m, f"no {symbol}@plt in {exe}"
    return int(m.group(1), 16)


def _runtime(snaps: Snaps, exe: Path, vaddr: int) -> int:
    store = ModuleStore(None)
    seg = store.add_file(exe).segments
    i = int(np.flatnonzero((seg.vaddr <= vaddr) & (vaddr < seg.vaddr + seg.filesz))[0])
    foff = vaddr - int(seg.vaddr[i]) + int(seg.offset[i])
    for m in snaps.mappings.to_pylist():
        if m["path"] == str(exe) and m["offset"] <= foff < m["offset"] + m["end"] - m["start"]:
            return m["start"] + foff - m["offset"]
    raise AssertionError("not mapped")


@pytest.mark.parametrize("at, pushed", [(0, False), (6, False), (11, True)])
def test_pc_in_the_plt(at: int, pushed: bool, tmp_path: Path) -> None:
    """A probe hit inside `mt_snap@plt`: the PLT rows' CFA is a DWARF expression
    (rsp + 8, + 8 more once the lazy-binding stub pushed its index at offset 11)."""
    exe = build_fixture(["unwind/chain.c"], VARIANTS["O2"], "chain-O2")
    snaps = run_snaps([str(exe)], tmp_path)
    rip = _runtime(snaps, exe, _plt_entry(exe, "mt_snap") + at)
    t = snaps.stacks
    regs = np.array(t.column("regs").to_pylist(), dtype=np.uint64)
    regs[:, 16] = rip
    stack = t.column("stack").to_pylist()
    sp = np.array(t.column("sp").to_pylist(), dtype=np.uint64)
    if pushed:  # the stub's `push $index` ran
        stack = [b"\x07\0\0\0\0\0\0\0" + s for s in stack]
        sp -= np.uint64(8)
    regs[:, 7] = sp
    t = t.set_column(t.schema.get_field_index("regs"), "regs",
                     pa.array(regs.tolist(), t.schema.field("regs").type))
    t = t.set_column(t.schema.get_field_index("stack"), "stack", pa.array(stack, pa.binary()))
    t = t.set_column(t.schema.get_field_index("sp"), "sp", pa.array(sp, pa.uint64()))
    named, res = unwind_named(Snaps(t, snaps.mappings, snaps.sizes))
    for n in named:
        assert n.names == ["mt_snap@plt", "c", "b", "a", "main", *LIBC_START] or n.names[1:] == [
            "c", "b", "a", "main", *LIBC_START]
        assert n.methods == ["regs"] + ["cfi"] * 7
    assert res.counters["unwind_expr_rows"] == 3


def _vaddr_of(snaps: Snaps, frame: dict[str, Any]) -> int:
    mod = ModuleStore(None).add_file(frame["path"])
    m = [r for r in snaps.mappings.to_pylist() if r["path"] == frame["path"]
         and r["start"] <= frame["address"] < r["end"]][0]
    return int(mod.runtime_to_vaddr(np.array([frame["address"]], dtype=np.uint64),
                                    m["start"], m["offset"])[0])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("mode, trampoline", [("signal", "__restore_rt"),
                                              ("signal-raw", "mt_restorer")])
def test_signal_handler(variant: str, mode: str, trampoline: str, tmp_path: Path) -> None:
    """glibc's trampoline has CFI (an 'S' CIE, expressions over the rt_sigframe); the
    fixture's own restorer has none, right after a function whose FDE ends there: it is
    known by its rt_sigreturn code. Either way the interrupted function follows."""
    snaps = run_snaps([str(cases(variant)), mode], tmp_path)
    assert snaps.sizes == [314]  # SIGALRM
    named, res = unwind_named(snaps)
    (n,) = named
    assert n.names == ["mt_snap", "handler", trampoline, "victim", "main", *LIBC_START]
    assert n.complete
    frames = res.stack_frames.to_pylist()
    # The handler returns to the trampoline's first instruction, and it is named there.
    tramp = frames[2]
    code = Path(tramp["path"]).read_bytes()
    mod = ModuleStore(None).add_file(tramp["path"])
    assert tramp["lookup_vaddr"] == _vaddr_of(snaps, tramp) == int(mod.file_offset_to_vaddr(
        np.array([code.index(SIGRETURN)], dtype=np.uint64))[0])
    # victim's pc is the interrupted instruction itself: looked up without the -1.
    assert frames[3]["lookup_vaddr"] == _vaddr_of(snaps, frames[3])
    assert res.counters["unwind_expr_rows"] == (mode == "signal")
    assert res.counters["unwind_sigreturn_by_code"] == (mode == "signal-raw")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deep_recursion_truncated(variant: str, tmp_path: Path) -> None:
    exe = cases(variant)
    full, _ = unwind_named(run_snaps([str(exe), "recursion"], tmp_path, budget=32768))
    (f,) = full
    assert f.names == ["mt_snap", *["rec"] * 201, "main", *LIBC_START]
    assert f.complete and not f.truncated
    cut, res = unwind_named(run_snaps([str(exe), "recursion"], tmp_path, budget=4096))
    (c,) = cut
    assert c.truncated and not c.complete and c.stop == "truncated"
    in_copy = c.methods.count("cfi")
    assert 20 < in_copy < 60
    # Every frame found inside the copy, and every one the kernel's chain adds, is the
    # frame of the full unwind at that depth.
    assert c.lookups == f.lookups[:len(c.lookups)]
    assert c.methods[:in_copy + 1] == ["regs"] + ["cfi"] * in_copy
    if "-fomit-frame-pointer" in VARIANTS[variant] or variant == "O2":
        assert len(c.names) == in_copy + 1
    else:
        # rbp chains: the kernel's walk continues the stack. It holds 127 addresses, the
        # pc first, and misses the entry's caller (rbp is still the caller's frame), so
        # it reaches depth 127.
        assert len(c.names) == 128
        assert set(c.methods[in_copy + 1:]) == {"fp-kernel"}
        assert res.counters["unwind_kernel_frames"] == 128 - in_copy - 1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cfa_on_another_register(variant: str, tmp_path: Path) -> None:
    """A realigned frame whose CFA is r12 + 16 (r12 known at frame 0 from the
    registers) goes through the rare path and restores r12 for its caller."""
    named, res = unwind_named(run_snaps([str(cases(variant)), "realign"], tmp_path))
    (n,) = named
    assert n.names == ["mt_snap", "mt_realign", "main", *LIBC_START]
    assert n.complete
    assert res.counters["unwind_expr_rows"] == 1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_thread(variant: str, tmp_path: Path) -> None:
    named, _ = unwind_named(run_snaps([str(cases(variant)), "thread"], tmp_path))
    (n,) = named
    assert n.names == ["mt_snap", "t_b", "t_a", "worker", "start_thread", "clone3"]
    assert n.complete


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dlopen(variant: str, tmp_path: Path) -> None:
    plugin = build_fixture(["unwind/plugin.c"], VARIANTS[variant], f"plugin-{variant}",
                           shared=True)
    named, res = unwind_named(run_snaps([str(cases(variant)), "dlopen", str(plugin)],
                                        tmp_path))
    (n,) = named
    assert n.names == ["mt_snap", "p_inner", "plugin_entry", "main", *LIBC_START]
    assert res.stack_frames.column("path").to_pylist()[1:3] == [str(plugin)] * 2


def test_cxx_inlined_templates(tmp_path: Path) -> None:
    exe = build_fixture(["unwind/templates.cc"], ("-O2",), "templates")
    named, _ = unwind_named(run_snaps([str(exe)], tmp_path))
    (n,) = named
    assert n.names == ["mt_snap", "build_all()", "main", *LIBC_START]
    assert n.inlines[1] == ["double* Pool<double>::make<7>()", "Wrap::get()", "build_all()"]


def test_system_python3(tmp_path: Path) -> None:
    """ctypes calls the snapshot entry from Python code: the stack crosses libffi,
    _ctypes, the interpreter loop and reaches _start. Debian's python3 `main` is a single
    `jmp Py_BytesMain` (a tail call), so no frame of main can exist: Py_BytesMain's
    caller is __libc_start_call_main, and _start passes main's address to libc."""
    py = Path("/usr/bin/python3").resolve()
    code = f"import ctypes; ctypes.CDLL({str(snap_lib())!r}).mt_snap(4321)"
    named, _ = unwind_named(run_snaps([str(py), "-c", code], tmp_path, budget=32768))
    (n,) = named
    assert n.complete
    assert n.names[0] == "mt_snap"
    assert "ffi_call" in n.names
    assert "_PyEval_EvalFrameDefault" in n.names
    assert n.names[-5:] == ["Py_RunMain", "Py_BytesMain", *LIBC_START]
    assert set(n.methods[1:]) == {"cfi"}
    with open(py, "rb") as fh:
        elf = ELFFile(fh)
        entry = elf["e_entry"]
        text = elf.get_section_by_name(".text")
        base, data = text["sh_addr"], text.data()
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    start = list(md.disasm(data[entry - base:entry - base + 64], entry))
    main = [i for i in start if i.mnemonic in ("mov", "lea") and i.op_str.startswith("rdi")]
    assert main, "no main address in _start"
    main_addr = int(main[0].op_str.split(",")[1], 0)
    (jmp,) = list(md.disasm(data[main_addr - base:main_addr - base + 8], main_addr, 1))
    assert jmp.mnemonic == "jmp"


def test_gdb_backtrace_agrees(tmp_path: Path) -> None:
    """gdb stops at the snapshot entry for the allocation of 112 bytes; its `bt` (past
    main) and the unwound stack of that allocation agree frame by frame."""
    exe = build_fixture(["unwind/chain.c"], VARIANTS["O2"], "chain-O2")
    script = tmp_path / "bt.gdb"
    script.write_text("set breakpoint pending on\nset backtrace past-main on\n"
                      "set backtrace past-entry on\nbreak *mt_snap if $rdi == 112\nrun\n"
                      "bt\ncontinue\n")
    out = tmp_path / "snaps.bin"
    proc = subprocess.run(["gdb", "-batch", "-nx", "-x", str(script), str(exe)],
                          capture_output=True, text=True, timeout=120,
                          env={"MT_SNAP_OUT": str(out), "PATH": "/usr/bin:/bin"})
    bt = re.findall(r"^#(\d+)\s+(?:(0x[0-9a-f]+) in )?(\S+) \(", proc.stdout, re.M)
    assert len(bt) >= 5, proc.stdout + proc.stderr
    snaps = read_snaps(out)
    assert snaps.sizes == [102, 112, 122]
    named, _ = unwind_named(snaps)
    n = named[1]
    assert len(bt) == len(n.names)
    for (num, addr, name), mine_addr, mine in zip(bt, n.addresses, n.names, strict=True):
        if addr:
            assert int(addr, 16) == mine_addr, num
        # gdb names glibc's __libc_start_main by its DWARF name, the symbol table by the
        # exported alias of the same address.
        assert GDB_ALIASES.get(name, name) == mine, (num, name, mine)


def test_each_distinct_stack_unwound_once(tmp_path: Path) -> None:
    exe = build_fixture(["unwind/chain.c"], VARIANTS["O2"], "chain-O2")
    snaps = run_snaps([str(exe)], tmp_path)
    doubled = pa.concat_tables([snaps.stacks, snaps.stacks])
    res = unwind(doubled, snaps.mappings, ModuleStore(None, host_modules=True))
    assert res.stacks.num_rows == 3
    assert res.stack_frames.num_rows == 24
    assert res.stack_frames.column("depth").to_pylist()[:8] == list(range(8))


def test_unknown_mapping_and_missing_modules_are_reported(tmp_path: Path) -> None:
    exe = build_fixture(["unwind/chain.c"], VARIANTS["O2"], "chain-O2")
    snaps = run_snaps([str(exe)], tmp_path)
    maps = snaps.mappings.filter(pa.compute.not_equal(snaps.mappings.column("path"),
                                                      str(exe)))
    res = unwind(snaps.stacks, maps, ModuleStore(None, host_modules=True))
    assert res.stacks.column("stop").to_pylist() == ["no-mapping"] * 3
    # a return address outside every executable mapping is not a frame (a stack record
    # reads such a word as 0): each stack is mt_snap's frame alone
    assert res.stacks.column("depth").to_pylist() == [1] * 3
    assert res.stack_frames.column("depth").to_pylist() == [0] * 3
    assert all("libmtsnap" in p
               for p in res.stack_frames.column("path").to_pylist())
    # Without the module files nothing is named nor unwound by CFI, and it says so.
    res = unwind(snaps.stacks, snaps.mappings, ModuleStore(None, host_modules=False))
    assert res.counters["unwind_frames_cfi"] == 0
    assert any(snap_lib().name in p and "not available" in p for p in res.problems)


@pytest.mark.parametrize("prologue, at_pc, expect", [
    ("", "55", (8, {})),  # at the start
    ("f30f1efa", "55", (8, {})),  # after endbr64
    ("55", "4889e5", (16, {6: -16})),  # rbp pushed, not the frame yet
    ("554889e5", "4883ec10", None),  # rbp is the frame
    ("53554883ec18", "4889fb", (48, {3: -16, 6: -24})),  # push rbx, rbp; sub rsp, 0x18
    ("4154", "53", (16, {12: -16})),  # push r12
    ("85ff7405", "c3", (8, {})),  # a branch before the pc, but at a ret
    ("85ff7405", "90", None),  # a branch before the pc: not a straight prologue
    (None, "5dc3", (16, {6: -16})),  # pop rbp; ret without a known start
    (None, "4889c7", None),
])
def test_frame0_rule(prologue: str | None, at_pc: str, expect: object) -> None:
    from memtrack.process.unwind.frame0 import frame0_rule

    pro = bytes.fromhex(prologue) if prologue is not None else None
    assert frame0_rule(bytes.fromhex(at_pc) + b"\x90" * 8, pro) == expect


def test_stop_rules_no_advance_and_max_depth(tmp_path: Path) -> None:
    snaps = run_snaps([str(cases("O2")), "realign"], tmp_path)
    # A CFA (r12 + 16) below the frame's sp: the step would not advance.
    t = snaps.stacks
    regs = np.array(t.column("regs").to_pylist(), dtype=np.uint64)
    regs[:, 12] = regs[:, 7] - np.uint64(64)
    bent = t.set_column(t.schema.get_field_index("regs"), "regs",
                        pa.array(regs.tolist(), t.schema.field("regs").type))
    store = ModuleStore(None, host_modules=True)
    res = unwind(bent, snaps.mappings, store)
    assert res.stacks.column("stop").to_pylist() == ["no-advance"]
    assert res.stacks.column("depth").to_pylist() == [2]
    res = unwind(snaps.stacks, snaps.mappings, store, max_depth=3)
    assert res.stacks.column("stop").to_pylist() == ["max-depth"]
    assert res.stack_frames.column("depth").to_pylist() == [0, 1, 2]
    assert not res.stacks.column("complete")[0].as_py()
