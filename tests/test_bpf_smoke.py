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
                  "lockdown", "pid namespace", "mapped files"):
        assert check in r.stdout
    rows = {line.split("│")[0].strip(): [c.strip() for c in line.split("│")[1:]]
            for line in r.stdout.splitlines() if "│" in line}
    assert rows["pid namespace"][:2] == ["ok", "the host's"]
    assert rows["BPF loops"][:2] == [
        "ok", "on the kernel's number iterator (bpf_iter_num): the stack capture verifies "
        "in ~0.1 s"]
    status, detail, _ = rows["attach (capture --pid)"]
    assert status == "ok" and detail.startswith(
        "allowed (pidfd_open); probes only in the attached processes; no ptrace, so "
        "kernel.yama.ptrace_scope does not matter"), detail


def test_pid_namespace_of_a_container() -> None:
    """memtrack in a pid namespace of its own (a container without --pid=host) sees
    other pids than its BPF programs: doctor says so and how to fix it."""
    from memtrack.capture.doctor import check_pid_namespace

    c = check_pid_namespace("pid:[4026532811]")
    assert not c.ok and c.required and "--pid=host" in c.fix
    assert check_pid_namespace("pid:[4026531836]").ok


# as root, but without the capability that follows /proc/PID/map_files links
NO_SYS_ADMIN = ["setpriv", "--inh-caps=-sys_admin,-checkpoint_restore",
                "--bounding-set=-sys_admin,-checkpoint_restore", "--"]


@pytest.mark.bpf
def test_without_cap_sys_admin_files_are_read_by_path(tmp_path: Path) -> None:
    """/proc/PID/map_files cannot be followed: doctor says capture reads files by path,
    and capture does (it probed nothing: every file was opened through map_files)."""
    import os
    import sys

    import duckdb

    env = {**os.environ, "COLUMNS": "250"}
    r = subprocess.run([*NO_SYS_ADMIN, sys.executable, "-m", "memtrack.cli", "doctor"],
                       capture_output=True, text=True, env=env)
    rows = {line.split("│")[0].strip(): [c.strip() for c in line.split("│")[1:]]
            for line in r.stdout.splitlines() if "│" in line}
    assert rows["mapped files"] == [
        "degraded", "/proc/PID/map_files: Operation not permitted; files are read by path: "
        "one deleted or replaced since it was mapped gets no probes",
        "CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE"], r.stdout
    assert r.returncode == 0 and "capture: ready" in r.stdout
    lib = build(["capture/nslib.c"], name="libns_container", shared=True,
                flags=("-DSIDE=container_side",))
    prog = build(["capture/nsprog.c"], libs=("-ldl",))
    art = tmp_path / "run.memtrack"
    r = subprocess.run([*NO_SYS_ADMIN, sys.executable, "-m", "memtrack.cli", "capture", "-o",
                        str(art), "--", str(prog), str(lib), "10"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr
    db = tmp_path / "run.duckdb"
    subprocess.run([sys.executable, "-m", "memtrack.cli", "process", str(art), "-o", str(db),
                    "-q"], check=True)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("""SELECT allocator, count(*) FROM allocations WHERE size = 4243
                              GROUP BY ALL""").fetchall() == [("mimalloc", 10)]
