"""Probe placement on hand-assembled prologues and on this machine's libc/libstdc++."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrack.capture.placement import (
    choose_probe_offset,
    function_code,
    kernel_emulates,
    place_symbol,
)

BASE = 0x1000

# Instruction bytes used below (AT&T in the comments).
PUSH_RBX = "53"
PUSH_RBP = "55"
POP_RBX = "5b"
RET = "c3"
ENDBR64 = "f30f1efa"
TEST_RDI = "4885ff"            # test %rdi,%rdi
XOR_EAX = "31c0"               # xor %eax,%eax
MOV_EAX_1 = "b801000000"       # mov $1,%eax
MOV_RSI_RDI = "4889f7"         # mov %rsi,%rdi
SUB_RSP_8 = "4883ec08"         # sub $8,%rsp
STORE_RSP = "48894424f8"       # mov %rax,-8(%rsp)
CALL_0 = "e800000000"          # call .+5
CMP_RIP = "803d0000000000"     # cmpb $0,0(%rip)
UD2 = "0f0b"


def je(disp: int) -> str:
    return "74" + (disp & 0xFF).to_bytes(1, "little").hex()


def jne(disp: int) -> str:
    return "75" + (disp & 0xFF).to_bytes(1, "little").hex()


def jmp8(disp: int) -> str:
    return "eb" + (disp & 0xFF).to_bytes(1, "little").hex()


def jrcxz(disp: int) -> str:
    return "e3" + (disp & 0xFF).to_bytes(1, "little").hex()


def place(*parts: str):
    return choose_probe_offset(bytes.fromhex("".join(parts)), BASE, name="f")


@pytest.mark.parametrize("hexbytes, emulated", [
    (PUSH_RBX, True), (PUSH_RBP, True), ("4154", True),      # push %r12 (REX 41)
    ("4853", False),                                          # REX.W push: not handled
    ("eb00", True), ("e900000000", True), (CALL_0, True),
    ("7400", True), ("0f8400000000", True),                   # jcc rel8 / rel32
    ("66e90000", False),                                      # 16-bit jmp: refused
    ("90", True), ("6690", True), ("0f1f00", True), ("0f1f4000", True),
    ("0f1f440000", True), ("660f1f440000", True), ("0f1f8000000000", True),
    ("0f1f840000000000", True),
    ("f390", False),                                          # pause
    ("2e0f1f840000000000", False),                            # cs prefix: not probeable
    (ENDBR64, False), (TEST_RDI, False), (RET, False), (SUB_RSP_8, False),
    ("4889ff", False),                                        # mov %rdi,%rdi
    ("ffd0", False), ("ffe0", False),                         # call/jmp *%rax
])
def test_kernel_emulates(hexbytes: str, emulated: bool) -> None:
    assert kernel_emulates(bytes.fromhex(hexbytes)) is emulated


def test_emulated_first_instruction_is_offset_zero() -> None:
    p = place(PUSH_RBX, TEST_RDI, POP_RBX, RET)
    assert (p.offset, p.emulated, p.instruction, p.skipped) == (0, True, "push rbx", ())


def test_endbr64_is_skipped_to_the_jump() -> None:
    p = place(ENDBR64, "e900000000")
    assert (p.offset, p.emulated, p.skipped) == (4, True, ("endbr64",))
    assert p.instruction.startswith("jmp")


def test_null_check_returning_at_once_is_skipped() -> None:
    # test %rdi,%rdi; je L; push %rbx; pop %rbx; ret; L: ret   (free(NULL) returns)
    p = place(TEST_RDI, je(3), PUSH_RBX, POP_RBX, RET, RET)
    assert (p.offset, p.emulated, p.instruction) == (5, True, "push rbx")
    assert p.skipped == ("test rdi, rdi", f"je {BASE + 8:#x}")
    assert "returns without a call or a store" in p.reason


def test_taken_path_may_set_a_return_value() -> None:
    # test; je L; push; ...; L: xor %eax,%eax; ret     (e.g. malloc(0) -> NULL)
    p = place(TEST_RDI, je(3), PUSH_RBX, POP_RBX, RET, XOR_EAX, RET)
    assert p.offset == 5


def test_taken_path_through_a_further_branch_both_ways_returning() -> None:
    # test; je L; push; pop; ret; L: jne M; ret; M: xor; ret
    p = place(TEST_RDI, je(3), PUSH_RBX, POP_RBX, RET, jne(1), RET, XOR_EAX, RET)
    assert p.offset == 5


def test_taken_path_ending_in_ud2_emits_nothing() -> None:
    p = place(TEST_RDI, je(3), PUSH_RBX, POP_RBX, RET, UD2)
    assert p.offset == 5


@pytest.mark.parametrize("taken, why", [
    (CALL_0 + RET, "calls"),                      # slow path that allocates
    (PUSH_RBX + RET, "writes rsp"),
    (STORE_RSP + RET, "writes memory"),
    ("ffe0", "jumps indirectly"),                 # jmp *%rax
    (jmp8(0x40), "leaves the code"),              # tail jump outside the function
    (jmp8(-10), "comes back to +0x0"),                    # back into the prologue
])
def test_branch_whose_taken_path_may_allocate_keeps_the_probe_on_the_branch(
        taken: str, why: str) -> None:
    # test; je L; push; pop; ret; L: <taken>
    p = place(TEST_RDI, je(3), PUSH_RBX, POP_RBX, RET, taken)
    assert (p.offset, p.emulated, p.skipped) == (3, True, ("test rdi, rdi",))
    assert p.instruction == f"je {BASE + 8:#x}"
    assert why in p.reason


def test_unemulated_branch_to_an_allocating_path_means_offset_zero() -> None:
    # test; jrcxz L; push; pop; ret; L: call; ret   (jrcxz is single-stepped)
    p = place(TEST_RDI, jrcxz(3), PUSH_RBX, POP_RBX, RET, CALL_0, RET)
    assert (p.offset, p.emulated) == (0, False)
    assert "jrcxz" in p.reason and "calls" in p.reason


def test_unemulated_branch_to_a_silent_path_is_skipped() -> None:
    p = place(TEST_RDI, jrcxz(3), PUSH_RBX, POP_RBX, RET, RET)
    assert p.offset == 5 and p.skipped[1].startswith("jrcxz")


def test_loop_instruction_writes_rcx_so_it_is_not_skipped() -> None:
    # test; loop L; push; pop; ret; L: ret   (loop decrements rcx, an argument)
    p = place(TEST_RDI, "e203", PUSH_RBX, POP_RBX, RET, RET)
    assert p.offset == 0 and "writes rcx (an argument register)" in p.reason


def test_scratch_register_writes_and_loads_are_skipped() -> None:
    # endbr64; cmpb $0,(%rip); mov $1,%eax; push %rbp       (operator new's shape)
    p = place(ENDBR64, CMP_RIP, MOV_EAX_1, PUSH_RBP, RET)
    assert (p.offset, p.instruction) == (16, "push rbp")
    assert p.skipped == ("endbr64", "cmp byte ptr [rip], 0", "mov eax, 1")


@pytest.mark.parametrize("prologue, why", [
    (MOV_RSI_RDI, "writes rdi (an argument register)"),
    (SUB_RSP_8, "writes rsp (the stack pointer)"),
    (STORE_RSP, "writes memory"),
    ("4889c3", "writes rbx (a register the unwinder needs)"),   # mov %rax,%rbx
    ("0f05", "traps into the kernel"),                          # syscall
    ("ffd0", "calls"),                                          # call *%rax
    (RET, "returns"),
])
def test_clobbering_prologue_means_offset_zero(prologue: str, why: str) -> None:
    p = place(ENDBR64, prologue, PUSH_RBX, RET)
    assert (p.offset, p.emulated, p.instruction) == (0, False, "endbr64")
    assert why in p.reason


def test_argument_registers_the_probe_does_not_read_may_be_overwritten() -> None:
    # mov %rdi,%rsi; push %rbx   (mimalloc's malloc moves its size to rsi first)
    code = bytes.fromhex("4889fe" + PUSH_RBX + RET)
    assert choose_probe_offset(code, BASE, name="f").offset == 0
    p = choose_probe_offset(code, BASE, name="f", arg_regs=1)
    assert (p.offset, p.skipped) == (3, ("mov rsi, rdi",))
    assert choose_probe_offset(bytes.fromhex(MOV_RSI_RDI + PUSH_RBX), BASE, name="f",
                               arg_regs=1).offset == 0          # rdi itself: never
    with pytest.raises(ValueError, match="arg_regs 7"):
        choose_probe_offset(code, BASE, name="f", arg_regs=7)


def test_taken_path_to_before_the_function_leaves_the_code() -> None:
    p = place(TEST_RDI, je(-20), PUSH_RBX, RET)
    assert p.offset == 3 and "leaves the code given" in p.reason


def test_unemulated_indirect_jump_means_offset_zero() -> None:
    p = place(ENDBR64, "ffe0")
    assert p.offset == 0 and "unemulated jump" in p.reason


def test_undecodable_code_means_offset_zero() -> None:
    assert place("06").offset == 0                 # invalid in 64-bit mode
    assert place(ENDBR64).offset == 0              # runs off the end of the code
    assert choose_probe_offset(b"", BASE, name="f").reason.startswith("f: cannot decode")


LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
LIBSTDCXX = Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")


@pytest.mark.skipif(not LIBC.exists(), reason="no glibc at the Debian path")
def test_glibc_free_skips_the_null_test_and_malloc_stays_at_zero() -> None:
    p = place_symbol(LIBC, "free")
    code, vaddr = function_code(LIBC, "free")
    assert code[:5] == bytes.fromhex("4885ff0f84") or code[:4] == bytes.fromhex("4885ff74")
    assert p.skipped[0] == "test rdi, rdi" and p.skipped[1].startswith("je ")
    assert p.emulated and p.instruction.startswith("push")
    assert p.offset == len(code[:3]) + (6 if code[3] == 0x0F else 2)
    for name in ("malloc", "calloc", "realloc"):
        m = place_symbol(LIBC, name)
        assert (m.offset, m.emulated) == (0, True), m.reason


@pytest.mark.skipif(not LIBSTDCXX.exists(), reason="no libstdc++ at the Debian path")
def test_libstdcxx_operators_skip_endbr64() -> None:
    for name in ("_ZdlPv", "_ZdaPv", "_Znam"):
        p = place_symbol(LIBSTDCXX, name)
        assert (p.offset, p.emulated, p.skipped) == (4, True, ("endbr64",)), p.reason
        assert p.instruction.startswith("jmp")
    new = place_symbol(LIBSTDCXX, "_Znwm")
    assert new.emulated and new.skipped[0] == "endbr64" and new.instruction.startswith("push")


def test_function_code_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no function symbol 'no_such_fn'"):
        function_code(LIBC, "no_such_fn")
