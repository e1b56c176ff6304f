"""The system calls capture makes itself, with no library between it and the kernel:
bpf(2) and perf_event_open(2), numbered by architecture in one table, and one libc
handle (errno kept per thread: ct.get_errno() after a call that returned < 0).

On an architecture the table does not know, both are syscall(-1): ENOSYS, which every
caller reports as it reports any refusal."""

from __future__ import annotations

import ctypes as ct
import platform
from typing import Any

# uname -m -> (bpf, perf_event_open): asm-generic/unistd.h for aarch64, riscv64, and
# arch/x86/entry/syscalls/syscall_64.tbl for x86_64
NUMBERS = {"x86_64": (321, 298), "aarch64": (280, 241), "riscv64": (280, 241)}
SYS_BPF, SYS_PERF_EVENT_OPEN = NUMBERS.get(platform.machine(), (-1, -1))

libc = ct.CDLL(None, use_errno=True)
libc.syscall.restype = ct.c_long
libc.ioctl.argtypes = [ct.c_int, ct.c_ulong, ct.c_ulong]


def bpf(cmd: int, attr: Any) -> int:
    """bpf(cmd, attr, sizeof(attr)) for a ctypes object `attr`: its result."""
    return int(libc.syscall(ct.c_long(SYS_BPF), ct.c_long(cmd), ct.byref(attr),
                            ct.c_long(ct.sizeof(attr))))


def perf_event_open(attr: Any, pid: int, cpu: int, group_fd: int, flags: int) -> int:
    """perf_event_open(attr, pid, cpu, group_fd, flags) for a ctypes object `attr`."""
    return int(libc.syscall(ct.c_long(SYS_PERF_EVENT_OPEN), ct.byref(attr), ct.c_long(pid),
                            ct.c_long(cpu), ct.c_long(group_fd), ct.c_ulong(flags)))
