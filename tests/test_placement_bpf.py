"""Probe placement checked against the kernel with bare bcc uprobes.

1. What the kernel emulates: a uprobe on each kind of first instruction
   (fixtures/placement/kinds.S). A single-stepped probe needs the out-of-line slot
   page, which the kernel maps into the process as `[uprobes]` on first use; an
   emulated one never does (uretprobes also live there, so none are attached here).
2. The allocator library of fixtures/placement/prologues.S driven by scenario.c: each
   function has a probe at offset 0 and one at the chosen offset (plus a uretprobe
   there), and both record rdi, rsi, rsp and the return address at [rsp]. The chosen
   probe must see exactly the calls that do something, with the same registers and
   stack as the offset-0 probe, and the uretprobe the returned addresses.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import build

from memtrack.capture.placement import choose_probe_offset, function_code, kernel_emulates

pytestmark = pytest.mark.bpf

KINDS = ["k_push_rbx", "k_push_r12", "k_jmp8", "k_jmp32", "k_call", "k_jcc8", "k_jcc32",
         "k_nop1", "k_nop2", "k_nop4", "k_nop5", "k_nop8", "k_endbr64", "k_test_rdi",
         "k_mov_rdi_rax", "k_mov_rdi_rdi", "k_sub_rsp", "k_ret"]

FUNCS = ["malloc", "free", "calloc", "realloc", "aligned_alloc"]
MARK_BEGIN, MARK_END = 0x5EED01, 0x5EED02
ENTRY0, CHOSEN, NAIVE, RETURN = 0, 1, 2, 3

PROGRAM = r"""
#include <uapi/linux/ptrace.h>
struct rec { u32 fn; u32 kind; u64 rdi; u64 rsi; u64 sp; u64 ra; u64 rax; };
BPF_ARRAY(recs, struct rec, 1024);
BPF_ARRAY(count, u32, 1);

static __always_inline int put(struct pt_regs *ctx, u32 fn, u32 kind) {
    int z = 0;
    u32 *n = count.lookup(&z);
    if (!n)
        return 0;
    u32 i = *n;
    *n = i + 1;
    struct rec *r = recs.lookup(&i);
    if (!r)
        return 0;
    r->fn = fn;
    r->kind = kind;
    r->rdi = ctx->di;
    r->rsi = ctx->si;
    r->sp = ctx->sp;
    r->rax = ctx->ax;
    bpf_probe_read_user(&r->ra, sizeof(r->ra), (void *)ctx->sp);
    return 0;
}
"""


def _program() -> str:
    fns = [f"int p{f}_{k}(struct pt_regs *ctx) {{ return put(ctx, {f}, {k}); }}"
           for f in range(len(FUNCS)) for k in (ENTRY0, CHOSEN, NAIVE, RETURN)]
    return PROGRAM + "\n".join(fns)


@pytest.fixture(scope="module")
def kinds_lib() -> Path:
    return build(["placement/kinds.S"], shared=True, name="libkinds")


@pytest.fixture(scope="module")
def loop_bin(kinds_lib: Path) -> Path:
    return build(["placement/loop.c"], flags=("-O2",),
                 libs=("-Wl,--no-as-needed", str(kinds_lib), f"-Wl,-rpath,{kinds_lib.parent}"))


def _xol_mapped_after_hits(lib: Path, loop: Path, symbol: str) -> bool:
    from bcc import BPF

    from memtrack.capture.bcc_compat import attach_uprobe

    _, vaddr = function_code(lib, symbol)
    proc = subprocess.Popen([str(loop), symbol, "200"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    bpf = BPF(text="BPF_ARRAY(hits, u64, 1);\n"
                   "int on_hit(struct pt_regs *ctx) { int k = 0; u64 *v = hits.lookup(&k);"
                   " if (v) *v += 1; return 0; }")
    try:
        attach_uprobe(bpf, "on_hit", str(lib), vaddr, pid=proc.pid)
        assert proc.stdin and proc.stdout
        proc.stdin.write("g")
        proc.stdin.flush()
        assert proc.stdout.readline().strip(), "loop printed nothing"
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert str(lib) in maps
        assert bpf["hits"][0].value == 200
        return any(line.endswith("[uprobes]") for line in maps.splitlines())
    finally:
        proc.communicate("")
        bpf.cleanup()


@pytest.mark.parametrize("symbol", KINDS)
def test_kernel_emulation_matches_the_model(kinds_lib: Path, loop_bin: Path,
                                            symbol: str) -> None:
    code, _ = function_code(kinds_lib, symbol)
    first = choose_probe_offset(code, 0, name=symbol).instruction
    single_stepped = _xol_mapped_after_hits(kinds_lib, loop_bin, symbol)
    model = kernel_emulates(_first_instruction_bytes(code))
    assert model is not single_stepped, (
        f"{symbol} ({first}): model says {'emulated' if model else 'single-stepped'}, "
        f"kernel {'single-stepped' if single_stepped else 'emulated'} it")


def _first_instruction_bytes(code: bytes) -> bytes:
    import capstone as cs

    md = cs.Cs(cs.CS_ARCH_X86, cs.CS_MODE_64)
    insn = next(md.disasm(code, 0, 1))
    return bytes(insn.bytes)


def _first_emulated(code: bytes) -> int:
    import capstone as cs

    md = cs.Cs(cs.CS_ARCH_X86, cs.CS_MODE_64)
    return next(i.address for i in md.disasm(code, 0) if kernel_emulates(bytes(i.bytes)))


@dataclass
class Rec:
    fn: str
    kind: int
    rdi: int
    rsi: int
    sp: int
    ra: int
    rax: int


@pytest.fixture(scope="module")
def scenario() -> tuple[dict[str, int], list[Rec], dict[str, tuple[int, str]]]:
    """Run scenario.c with the probes; returns printed addresses, records, placements."""
    from bcc import BPF

    from memtrack.capture.bcc_compat import attach_uprobe

    lib = build(["placement/prologues.S"], shared=True, name="libprologues")
    exe = build(["placement/scenario.c"], flags=("-O0", "-fno-builtin"),
                libs=(str(lib), f"-Wl,-rpath,{lib.parent}"))
    placements: dict[str, tuple[int, str]] = {}
    proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    bpf = BPF(text=_program())
    try:
        for i, name in enumerate(FUNCS):
            code, vaddr = function_code(lib, name)
            p = choose_probe_offset(code, vaddr, name=name)
            placements[name] = (p.offset, p.reason)
            attach_uprobe(bpf, f"p{i}_{ENTRY0}", str(lib), vaddr, pid=proc.pid)
            attach_uprobe(bpf, f"p{i}_{CHOSEN}", str(lib), vaddr + p.offset, pid=proc.pid)
            if name != "free":
                attach_uprobe(bpf, f"p{i}_{RETURN}", str(lib), vaddr + p.offset,
                              retprobe=True, pid=proc.pid)
            if name == "calloc":  # where a placement ignoring the imul would have put it
                attach_uprobe(bpf, f"p{i}_{NAIVE}", str(lib), vaddr + _first_emulated(code),
                              pid=proc.pid)
        out, _ = proc.communicate("g", timeout=60)
        assert proc.returncode == 0
        n = bpf["count"][0].value
        table = bpf["recs"]
        recs = [Rec(FUNCS[r.fn], r.kind, r.rdi, r.rsi, r.sp, r.ra, r.rax)
                for r in (table[i] for i in range(n))]
    finally:
        bpf.cleanup()
    addrs = {k: int(v, 16) for k, v in (line.split() for line in out.splitlines())}
    begin = next(i for i, r in enumerate(recs) if r.fn == "malloc" and r.rdi == MARK_BEGIN)
    end = next(i for i, r in enumerate(recs) if r.fn == "malloc" and r.rdi == MARK_END)
    return addrs, recs[begin:end + 3], placements


def test_placements_of_the_fixture_library(scenario) -> None:
    _, _, placements = scenario
    offsets = {name: off for name, (off, _) in placements.items()}
    assert offsets == {"malloc": 0, "free": 5, "calloc": 0, "realloc": 3, "aligned_alloc": 4}
    assert "writes rdi (an argument register)" in placements["calloc"][1]
    assert "taken path writes rsp" in placements["realloc"][1]


def test_chosen_probes_see_exactly_the_calls_that_do_something(scenario) -> None:
    addrs, recs, _ = scenario
    a, b, c, d, e, f = (addrs[k] for k in "abcdef")
    chosen = [(r.fn, r.rdi, r.rsi) for r in recs if r.kind == CHOSEN]
    expect_calls = [
        ("malloc", MARK_BEGIN), ("malloc", 24), ("malloc", 40), ("calloc", 3, 8),
        ("realloc", 0, 64), ("realloc", b, 80), ("aligned_alloc", 64, 128),
        ("free", a), ("free", c), ("free", d), ("free", e), ("free", f), ("malloc", MARK_END),
    ]
    assert [x[:len(y)] for x, y in zip(chosen, expect_calls, strict=True)] == expect_calls
    # The offset-0 probes also see the two free(NULL) calls, which skip the chosen one.
    entry0 = [(r.fn, r.rdi) for r in recs if r.kind == ENTRY0]
    assert entry0.count(("free", 0)) == 2
    assert [x for x in entry0 if x != ("free", 0)] == [x[:2] for x in chosen]


def test_chosen_probes_see_the_same_registers_and_stack_as_offset_zero(scenario) -> None:
    _, recs, _ = scenario
    entry0 = [r for r in recs if r.kind == ENTRY0 and not (r.fn == "free" and r.rdi == 0)]
    chosen = [r for r in recs if r.kind == CHOSEN]
    assert len(entry0) == len(chosen) == 13
    for z, c in zip(entry0, chosen, strict=True):
        assert (z.fn, z.rdi, z.rsi, z.sp, z.ra) == (c.fn, c.rdi, c.rsi, c.sp, c.ra)


def test_skipping_calloc_clobber_would_have_been_wrong(scenario) -> None:
    _, recs, _ = scenario
    naive = [(r.rdi, r.rsi) for r in recs if r.kind == NAIVE]
    assert naive == [(24, 8)]  # rdi holds n*size there, not the 3 of calloc(3, 8)


def test_uretprobes_at_the_chosen_offsets_see_the_returned_addresses(scenario) -> None:
    addrs, recs, _ = scenario
    returns = [(r.fn, r.rax) for r in recs if r.kind == RETURN]
    expect = [("malloc", addrs["begin"]), ("malloc", addrs["a"]), ("malloc", addrs["b"]),
              ("calloc", addrs["c"]), ("realloc", addrs["d"]), ("realloc", addrs["e"]),
              ("aligned_alloc", addrs["f"]), ("malloc", addrs["end"])]
    assert returns == expect
