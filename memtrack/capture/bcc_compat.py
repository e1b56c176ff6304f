"""The few places where memtrack talks to bcc below its Python API.

bcc 0.26's `BPF.attach_uprobe` calls the C `bpf_attach_uprobe` with six arguments,
leaving its seventh, `ref_ctr_offset`, to stack garbage (bcc issue #5236). The kernel
then treats the garbage as a USDT semaphore offset and increments a byte of the probed
file's mapping in every process that maps it, corrupting e.g. libc's ELF header in
memory. memtrack always attaches through `attach_uprobe` below, which passes 0.
"""

from __future__ import annotations

import ctypes as ct
import functools
import os
from typing import Any

BPF_PROBE_ENTRY = 0
BPF_PROBE_RETURN = 1


@functools.cache
def _attach_fn() -> Any:
    # A CDLL instance of our own, so that setting argtypes does not change the
    # function object bcc's own module uses.
    fn = ct.CDLL("libbcc.so.0", use_errno=True).bpf_attach_uprobe
    fn.restype = ct.c_int
    fn.argtypes = [ct.c_int, ct.c_int, ct.c_char_p, ct.c_char_p, ct.c_ulonglong, ct.c_int,
                   ct.c_uint32]
    return fn


def attach_uprobe(bpf: Any, fn_name: str, path: str, offset: int, *, retprobe: bool = False,
                  pid: int = -1) -> None:
    """Attach bcc program `fn_name` at file `offset` of `path` (ref_ctr_offset = 0).

    `offset` is what bcc calls addr: an offset relative to the file's load address for
    shared objects and PIE, the virtual address for non-PIE executables.
    """
    from bcc import BPF

    fn = bpf.load_func(fn_name.encode(), BPF.KPROBE)
    kind = b"r" if retprobe else b"p"
    bpath = path.encode()
    ev_name = bpf._get_uprobe_evname(kind, bpath, offset, pid)
    fd = _attach_fn()(fn.fd, BPF_PROBE_RETURN if retprobe else BPF_PROBE_ENTRY, ev_name, bpath,
                      offset, pid, 0)
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, f"cannot attach {'uretprobe' if retprobe else 'uprobe'} "
                         f"{fn_name} at {path}+{offset:#x}: {os.strerror(e)}")
    bpf._add_uprobe_fd(ev_name, fd)


_TEST_PROGRAM = r"""
BPF_RINGBUF_OUTPUT(out, 1);
int on_getpid(struct pt_regs *ctx) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (pid != MT_PID) return 0;
    u64 *v = out.ringbuf_reserve(sizeof(u64));
    if (!v) return 0;
    *v = 42;
    out.ringbuf_submit(v, 0);
    return 0;
}
"""


def load_probe_test() -> str:
    """Load a uprobe on libc's getpid that writes to a ring buffer; call getpid; read it."""
    from bcc import BPF

    path, off = BPF._check_path_symbol(b"c", b"getpid", None, -1, 0)
    libc = path.decode()
    b = BPF(text=_TEST_PROGRAM, cflags=[f"-DMT_PID={os.getpid()}"])
    try:
        attach_uprobe(b, "on_getpid", libc, off)
        got: list[int] = []
        b["out"].open_ring_buffer(lambda ctx, data, size: got.append(size))
        ct.CDLL(None).getpid()
        b.ring_buffer_poll(100)
        if not got:
            raise RuntimeError("uprobe attached but no ring buffer record arrived")
        return f"uprobe on {os.path.basename(libc)}:getpid fired into a ring buffer"
    finally:
        b.cleanup()



def uprobe_attach_mode() -> str:
    """How this kernel takes the allocator probes (memtrack.capture.links): load a
    program that reads its attach cookie, then ask for uprobe_multi links."""
    from bcc import BPF

    from memtrack.capture.links import BPF_TRACE_UPROBE_MULTI, uprobe_multi_supported

    b = BPF(text="int on_hit(struct pt_regs *ctx) { return bpf_get_attach_cookie(ctx) != 0; }")
    try:
        fn = b.load_func(b"on_hit", BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
        if uprobe_multi_supported(fn.fd):
            return "uprobe_multi links: one per module and program"
        return ("perf-event uprobes with attach cookies (no uprobe_multi before Linux 6.6): "
                "one per function, released in the background")
    finally:
        b.cleanup()
