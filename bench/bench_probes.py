"""Per-hit cost of each allocator probe at offset 0 and at the chosen offset.

    sudo .venv/bin/python bench/bench_probes.py [--iters 20000] [--repeat 3]

Every figure comes from this run, next to its baseline:

1. A bare uprobe (a small BPF program: read rdi and the return address at [rsp]) on
   each kind of first instruction (fixtures/placement/kinds.S): emulated kinds cost
   about the same, single-stepped ones about 10x more. Printed as a ratio to
   `push %rbx`.
2. The same program on glibc malloc, free, calloc, realloc and libstdc++ operator
   new/delete, attached at offset 0 and at `choose_probe_offset`'s offset, each on a
   tight loop (fixtures/placement/allocloop.cc) run with and without the probe. Two
   measures side by side: wall time per hit ((probed - bare) / hits) and the BPF
   program's own run time per hit (bpf_stats, enabled through BPF_ENABLE_STATS for
   this process only); the difference is the trap and its emulation or single-step.
3. Return paths for malloc and operator new: entry probe alone; entry and uretprobe
   sharing the chosen offset; uretprobe at offset 0 apart from the entry probe; and
   uprobes on every `ret` instruction of the function instead of a uretprobe.

Probes are attached to the measured pid only, so nothing else on the machine pays;
each measurement first waits until no other tracer has allocator uprobes attached
(bench_overhead.Quiet), since those would slow the loops measured here.
"""

from __future__ import annotations

import argparse
import ctypes as ct
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import capstone as cs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench_overhead import Quiet  # noqa: E402
from bpfstats import prog_stats  # noqa: E402
from conftest import build  # noqa: E402

from memtrack.capture.bcc_compat import attach_uprobe  # noqa: E402
from memtrack.capture.placement import (  # noqa: E402
    choose_probe_offset,
    function_code,
    kernel_emulates,
)
from memtrack.capture.syscalls import bpf  # noqa: E402

PROGRAM = r"""
#include <uapi/linux/ptrace.h>
BPF_PERCPU_ARRAY(acc, u64, 1);
int on_hit(struct pt_regs *ctx) {
    int k = 0;
    u64 *v = acc.lookup(&k);
    if (!v)
        return 0;
    u64 ra = 0;
    bpf_probe_read_user(&ra, sizeof(ra), (void *)ctx->sp);
    *v += ctx->di ^ ra;
    return 0;
}
"""

KINDS = ["k_push_rbx", "k_push_r12", "k_jmp8", "k_jmp32", "k_call", "k_jcc8", "k_jcc32",
         "k_nop1", "k_nop2", "k_nop4", "k_nop5", "k_nop8", "k_endbr64", "k_test_rdi",
         "k_mov_rdi_rax", "k_mov_rdi_rdi", "k_sub_rsp", "k_ret"]
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
# (row label, library, function, allocloop OP)
FUNCS = [("malloc", LIBC, "malloc", "malloc"), ("free", LIBC, "free", "malloc"),
         ("free(NULL)", LIBC, "free", "free_null"), ("calloc", LIBC, "calloc", "calloc"),
         ("realloc", LIBC, "realloc", "realloc"), ("operator new", LIBSTDCXX, "_Znwm", "new"),
         ("operator delete", LIBSTDCXX, "_ZdlPv", "new")]
BPF_ENABLE_STATS, BPF_STATS_RUN_TIME = 32, 0


def enable_bpf_stats() -> int:
    """BPF run-time stats on while the returned fd is open (no global sysctl change)."""
    attr = (ct.c_uint32 * 2)(BPF_STATS_RUN_TIME, 0)
    fd = bpf(BPF_ENABLE_STATS, attr)
    if fd < 0:
        raise OSError(ct.get_errno(), "BPF_ENABLE_STATS failed")
    return int(fd)


@dataclass
class Hit:
    wall_ns: float  # per iteration
    hits: int
    bpf_ns: int


class Bench:
    def __init__(self) -> None:
        from bcc import BPF

        self.bpf = BPF(text=PROGRAM)
        self.fd = self.bpf.load_func(b"on_hit", BPF.KPROBE).fd
        self.kinds = build(["placement/kinds.S"], shared=True, name="libkinds")
        self.loop = build(["placement/loop.c"], flags=("-O2",),
                          libs=("-Wl,--no-as-needed", str(self.kinds),
                                f"-Wl,-rpath,{self.kinds.parent}"))
        self.allocloop = build(["placement/allocloop.cc"], flags=("-O2", "-fno-builtin"))
        self.quiet = Quiet([str(self.allocloop), "malloc", "200000"])

    def run(self, cmd: list[str], probes: list[tuple[str, int, bool]]) -> Hit:
        """Run `cmd` with uprobes (path, file offset, is_return) on its pid only."""
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for path, off, ret in probes:
            attach_uprobe(self.bpf, "on_hit", path, off, retprobe=ret, pid=proc.pid)
        t0, n0 = prog_stats(self.fd)
        out, _ = proc.communicate("g")
        t1, n1 = prog_stats(self.fd)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd} exited with {proc.returncode}")
        return Hit(float(out.split()[0]), n1 - n0, t1 - t0)

    def per_hit(self, cmd: list[str], iters: int, probes: list[tuple[str, int, bool]],
                repeat: int) -> tuple[float, float, float]:
        """Medians over `repeat` runs of (wall ns per hit, BPF ns per hit, hits per
        iteration); the wall figure is (probed - bare) / hits, bare measured alongside."""
        walls, bpfs, hits = [], [], 0
        for _ in range(repeat):
            self.quiet.wait()
            bare = self.run(cmd, [])
            probed = self.run(cmd, probes)
            hits = probed.hits
            per = max(hits, 1)
            walls.append((probed.wall_ns - bare.wall_ns) * iters / per)
            bpfs.append(probed.bpf_ns / per)
        return statistics.median(walls), statistics.median(bpfs), hits / iters


def first_insn(code: bytes) -> tuple[str, bytes]:
    md = cs.Cs(cs.CS_ARCH_X86, cs.CS_MODE_64)
    insn = next(md.disasm(code, 0, 1))
    return f"{insn.mnemonic} {insn.op_str}".strip(), bytes(insn.bytes)


def ret_sites(code: bytes) -> list[int]:
    """Offsets of the `ret` instructions found by a linear sweep of the function."""
    md = cs.Cs(cs.CS_ARCH_X86, cs.CS_MODE_64)
    return [i.address for i in md.disasm(code, 0) if i.mnemonic == "ret"]


def fmt(ns: float) -> str:
    return f"{ns / 1000:7.2f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20000, help="loop iterations per run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    args = ap.parse_args()
    stats_fd = enable_bpf_stats()
    b = Bench()
    n, rep = args.iters, args.repeat

    print("1. Bare uprobe by first instruction (same BPF program everywhere)")
    print(f"   {'function':16s} {'instruction':28s} {'model':15s} {'wall/hit':>10s} "
          f"{'bpf/hit':>9s} {'vs push':>8s}")
    base = None
    for k in KINDS:
        code, vaddr = function_code(b.kinds, k)
        text, raw = first_insn(code)
        wall, bpf_ns, _ = b.per_hit([str(b.loop), k, str(n)], n, [(str(b.kinds), vaddr, False)],
                                    rep)
        base = base or wall
        model = "emulated" if kernel_emulates(raw) else "single-stepped"
        print(f"   {k:16s} {text:28s} {model:15s} {fmt(wall)} {bpf_ns:6.0f} ns "
              f"{wall / base:7.1f}x")

    print("\n2. Allocator probes: offset 0 vs the chosen offset")
    print(f"   {'probe':16s} {'+0 instruction':20s} {'wall/hit':>10s} {'bpf/hit':>8s} | "
          f"{'chosen':24s} {'wall/hit':>10s} {'bpf/hit':>8s} | {'gain':>6s} {'vs bare':>7s}")
    for label, lib, fn, op in FUNCS:
        code, vaddr = function_code(lib, fn)
        p = choose_probe_offset(code, vaddr, name=fn)
        cmd = [str(b.allocloop), op, str(n)]
        w0, b0, _ = b.per_hit(cmd, n, [(lib, vaddr, False)], rep)
        if p.offset:
            wc, bc, hits = b.per_hit(cmd, n, [(lib, vaddr + p.offset, False)], rep)
        else:
            wc, bc, hits = w0, b0, 1.0
        chosen = f"+{p.offset} {p.instruction}"[:24]
        if hits < 0.5:  # free(NULL): the chosen probe is never hit
            print(f"   {label:16s} {first_insn(code)[0]:20s} {fmt(w0)} {b0:5.0f} ns | "
                  f"{chosen:24s} {'not hit':>10s} {'':8s} | {'inf':>6s} {0:6.1f}x")
            continue
        print(f"   {label:16s} {first_insn(code)[0]:20s} {fmt(w0)} {b0:5.0f} ns | "
              f"{chosen:24s} {fmt(wc)} {bc:5.0f} ns | {w0 / wc:5.1f}x {wc / base:6.1f}x")

    print("\n3. Return paths (wall time added per call, and probe hits per call)")
    for label, lib, fn, op in (("malloc", LIBC, "malloc", "malloc"),
                               ("operator new", LIBSTDCXX, "_Znwm", "new")):
        code, vaddr = function_code(lib, fn)
        p = choose_probe_offset(code, vaddr, name=fn)
        at = vaddr + p.offset
        rets = [vaddr + r for r in ret_sites(code)]
        cmd = [str(b.allocloop), op, str(n)]
        variants = [
            (f"entry at +{p.offset} only", [(lib, at, False)]),
            (f"entry + uretprobe at +{p.offset} (shared)", [(lib, at, False), (lib, at, True)]),
        ]
        if p.offset:
            variants.append((f"entry at +{p.offset}, uretprobe at +0",
                             [(lib, at, False), (lib, vaddr, True)]))
        variants.append((f"entry + uprobes on its {len(rets)} ret",
                         [(lib, at, False)] + [(lib, r, False) for r in rets]))
        print(f"   {label}")
        for name, probes in variants:
            wall, _, per_call = b.per_hit(cmd, n, probes, rep)
            print(f"     {name:40s} {fmt(wall * per_call)} per call, "
                  f"{per_call:.2f} hits/call")
    b.bpf.cleanup()
    os.close(stats_fd)
    q = b.quiet
    print(f"\nquiet machine check: waited {q.waited:.0f} s" +
          (f"; NOT quiet {q.gave_up} times (those figures are disturbed)" if q.gave_up else ""))


if __name__ == "__main__":
    main()
