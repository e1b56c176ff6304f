"""BPF smoke test: bcc loads a program, a uprobe on libc's malloc counts exactly."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import build

from memtrack.capture.bcc_compat import attach_uprobe

PROGRAM = rb"""
#include <uapi/linux/ptrace.h>
BPF_ARRAY(counts, u64, 1);
int on_malloc(struct pt_regs *ctx) {
    if ((bpf_get_current_pid_tgid() >> 32) != TARGET_PID) return 0;
    if (PT_REGS_PARM1(ctx) != 4242) return 0;
    int k = 0;
    u64 *v = counts.lookup(&k);
    if (v) __sync_fetch_and_add(v, 1);
    return 0;
}
"""


def _libc_mapping(pid: int) -> tuple[int, str]:
    """Start address and path of the mapping of libc's first page in process `pid`."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and "/libc.so" in parts[5] and int(parts[2], 16) == 0:
            return int(parts[0].split("-")[0], 16), parts[5]
    raise AssertionError("libc not mapped")


@pytest.mark.bpf
def test_uprobe_counts_exact_mallocs_and_leaves_libc_intact() -> None:
    from bcc import BPF

    exe = build(["smoke/count_mallocs.c"], flags=("-O0",))
    n = 1234
    proc = subprocess.Popen([str(exe), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    b = None
    try:
        b = BPF(text=PROGRAM, cflags=[f"-DTARGET_PID={proc.pid}"])
        path, off = BPF._check_path_symbol(b"c", b"malloc", None, -1, 0)
        attach_uprobe(b, "on_malloc", path.decode(), off)
        assert proc.stdin and proc.stdout
        proc.stdin.write(b"g")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"done\n"
        assert b["counts"][0].value == n
        # bcc #5236: a garbage ref_ctr_offset makes the kernel bump a byte of the probed
        # file's pages in every process that maps it. libc's pages must match the file.
        start, libc = _libc_mapping(proc.pid)
        with open(f"/proc/{proc.pid}/mem", "rb") as mem:
            mem.seek(start)
            in_memory = mem.read(4096)
        assert in_memory == Path(libc).read_bytes()[:4096]
        proc.stdin.write(b"x")
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 0
    finally:
        if b is not None:
            b.cleanup()
        proc.kill()
        proc.wait()


@pytest.mark.bpf
def test_doctor_reports_ready_with_a_real_load() -> None:
    import os
    import sys

    r = subprocess.run([sys.executable, "-m", "memtrack.cli", "doctor"], capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "capture: ready" in r.stdout
    assert "kernel.yama.ptrace_scope does not matter" in " ".join(r.stdout.split())
    assert "fired into a ring buffer" in r.stdout
    for check in ("privileges", "bcc (python3-bpfcc)", "kernel headers", "tracefs", "uprobes",
                  "lockdown"):
        assert check in r.stdout
