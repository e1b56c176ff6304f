"""Allocator uprobes as BPF links the tracker creates and releases itself.

bcc attaches one perf event per probe, and every detach waits for its own RCU grace
period (0.1-0.2 s each here). Since Linux 6.6 a uprobe_multi link (BPF_LINK_CREATE,
BPF_TRACE_UPROBE_MULTI) attaches every offset of a file to one program in one call,
with one attach cookie per offset, and its close waits once for all of them. The
allocator programs of bpf/alloc.c read the cookie to learn what the probed function
is, so a module needs three links: entries, returns and frees.

Older kernels (5.15-6.5) get the same programs and cookies through one perf-event
uprobe per offset, each bound to its program by a BPF_PERF_EVENT link with the
cookie. Both paths pass no reference-counter (USDT semaphore) offset: bcc 0.26's own
`attach_uprobe` passes garbage there (bcc #5236, see bcc_compat).

x86-64 only (syscall numbers), like the rest of capture.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import subprocess
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

SYS_PERF_EVENT_OPEN = 298
SYS_BPF = 321
BPF_LINK_CREATE = 28
BPF_PERF_EVENT = 41
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
PERF_FLAG_FD_CLOEXEC = 8
PROG_KPROBE = 2  # BPF_PROG_TYPE_KPROBE: uprobe programs too
PERF_ATTR_SIZE_VER5 = 112
UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


class _Attr:
    """A zeroed syscall attribute block with little-endian fields put at offsets."""

    def __init__(self, size: int) -> None:
        self.buf = (ct.c_uint8 * size)()
        self.keep: list[Any] = []  # buffers the kernel reads through pointers

    def put(self, offset: int, value: int, ctype: Any = ct.c_uint64) -> None:
        v = ctype(value)
        ct.memmove(ct.addressof(self.buf) + offset, ct.byref(v), ct.sizeof(v))

    def ptr(self, offset: int, data: Any) -> None:
        self.keep.append(data)
        self.put(offset, ct.addressof(data))


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ct.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def uprobe_multi_link(prog_fd: int, path: str, offsets: list[int], cookies: list[int], *,
                      retprobe: bool = False) -> int:
    """One uprobe_multi link of `prog_fd` on every offset of `path`; returns its fd."""
    n = len(offsets)
    a = _Attr(64)  # union bpf_attr, link_create
    a.put(0, prog_fd, ct.c_uint32)
    a.put(8, BPF_TRACE_UPROBE_MULTI, ct.c_uint32)
    a.ptr(16, ct.create_string_buffer(path.encode()))
    a.ptr(24, (ct.c_uint64 * n)(*offsets))
    # 32: ref_ctr_offsets = NULL: no semaphore is incremented anywhere
    a.ptr(40, (ct.c_uint64 * n)(*cookies))
    a.put(48, n, ct.c_uint32)
    a.put(52, BPF_F_UPROBE_MULTI_RETURN if retprobe else 0, ct.c_uint32)
    return _check(_libc.syscall(SYS_BPF, BPF_LINK_CREATE, a.buf, ct.sizeof(a.buf)),
                  f"cannot attach {'uretprobes' if retprobe else 'uprobes'} to {path}")


def _pmu_value(name: str) -> int:
    return int((UPROBE_PMU / name).read_text())


def _retprobe_bit() -> int:
    text = (UPROBE_PMU / "format" / "retprobe").read_text().strip()  # "config:0"
    return 1 << int(text.split(":")[1])


def perf_uprobe_link(prog_fd: int, path: str, offset: int, cookie: int, *,
                     retprobe: bool = False) -> int:
    """One perf-event uprobe at `path`+`offset` linked to `prog_fd` with `cookie`."""
    a = _Attr(128)  # struct perf_event_attr
    a.put(0, _pmu_value("type"), ct.c_uint32)
    a.put(4, PERF_ATTR_SIZE_VER5, ct.c_uint32)
    a.put(8, _retprobe_bit() if retprobe else 0)  # ref_ctr_offset (bits 32-63) = 0
    a.put(16, 1)  # sample_period
    a.put(48, 1, ct.c_uint32)  # wakeup_events
    a.ptr(56, ct.create_string_buffer(path.encode()))  # uprobe_path
    a.put(64, offset)  # probe_offset
    what = f"cannot attach {'uretprobe' if retprobe else 'uprobe'} at {path}+{offset:#x}"
    pfd = _check(_libc.syscall(SYS_PERF_EVENT_OPEN, a.buf, -1, 0, -1, PERF_FLAG_FD_CLOEXEC),
                 what)
    try:
        link = _Attr(32)
        link.put(0, prog_fd, ct.c_uint32)
        link.put(4, pfd, ct.c_uint32)
        link.put(8, BPF_PERF_EVENT, ct.c_uint32)
        link.put(16, cookie)
        return _check(_libc.syscall(SYS_BPF, BPF_LINK_CREATE, link.buf, ct.sizeof(link.buf)),
                      what)
    finally:
        os.close(pfd)  # the link holds the event


def uprobe_multi_supported(prog_fd: int) -> bool:
    """Whether the kernel has uprobe_multi links, asked as libbpf does: a link on "/"
    (not a regular file) fails with EBADF where they exist, EINVAL where not."""
    try:
        os.close(uprobe_multi_link(prog_fd, "/", [0], [0]))
    except OSError as e:
        return e.errno == errno.EBADF
    return True


def close_all(fds: Iterable[int]) -> None:
    """Close fds side by side: each uprobe release waits for a grace period of its
    own, and those of concurrent closes overlap."""
    threads = [threading.Thread(target=os.close, args=(fd,)) for fd in fds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


_releasers: list[subprocess.Popen[bytes]] = []


def release_in_background(fds: list[int], close_own: Callable[[], None]) -> None:
    """Run `close_own` (which closes our copies of `fds`, among others) while a child
    process holds the last references, and let the child drop them after we are gone.

    Closing a tracepoint's perf event waits for RCU grace periods under a kernel-wide
    mutex (40-80 ms each here, one after the other however many threads close them).
    The child (`cat`, reading a pipe nobody writes to) inherits the fds; once ours are
    closed, closing the pipe lets it exit, and the kernel releases the events in its
    exit. Their programs emit nothing by then: nothing is tracked any more."""
    global _releasers
    _releasers = [p for p in _releasers if p.poll() is None]
    child = None
    if fds:
        try:
            child = subprocess.Popen(["cat"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     pass_fds=fds, start_new_session=True)
        except OSError:
            child = None  # our own closes then wait, as they would without it
    try:
        close_own()
    finally:
        if child is not None:
            assert child.stdin is not None
            child.stdin.close()
            _releasers.append(child)


class UprobeLinks:
    """The allocator programs (loaded for the kernel's attach path) and their links."""

    PROGRAMS = ("mt_alloc", "mt_ret", "mt_free")

    def __init__(self, bpf: Any, *, multi: bool | None = None) -> None:
        if multi is None:
            probe = bpf.load_func(b"mt_free", PROG_KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
            multi = uprobe_multi_supported(probe.fd)
            if not multi:  # load_func keeps programs by name: load it again for perf events
                os.close(probe.fd)
                del bpf.funcs[b"mt_free"]
        self.multi = multi
        attach_type = BPF_TRACE_UPROBE_MULTI if multi else -1
        self.fds = {name: bpf.load_func(name.encode(), PROG_KPROBE, attach_type=attach_type).fd
                    for name in self.PROGRAMS}
        self.links: list[int] = []

    @property
    def mode(self) -> str:
        return "uprobe_multi" if self.multi else "perf_event"

    def attach(self, path: str, entries: list[tuple[int, int]],
               frees: list[tuple[int, int]]) -> dict[int, str]:
        """Probe `path`: each (offset, cookie) of `entries` with mt_alloc and, at the
        same offset, mt_ret on the return; each of `frees` with mt_free. Returns the
        offsets the kernel refused to probe (e.g. an instruction uprobes cannot handle,
        ENOTSUPP) with the reason; everything else is attached."""
        refused: dict[int, str] = {}
        for program, probes, ret in (("mt_alloc", entries, False), ("mt_ret", entries, True),
                                     ("mt_free", frees, False)):
            probes = [(off, cookie) for off, cookie in probes if off not in refused]
            if not probes:
                continue
            fd = self.fds[program]
            if self.multi:
                try:
                    self.links.append(self._multi(fd, path, probes, ret))
                    continue
                except OSError:
                    pass
                # one offset refused fails the whole link: find which, link the others
                good = []
                for off, cookie in probes:
                    try:
                        os.close(self._multi(fd, path, [(off, cookie)], ret))
                        good.append((off, cookie))
                    except OSError as e:
                        refused[off] = e.strerror or str(e)
                if good:
                    self.links.append(self._multi(fd, path, good, ret))
            else:
                for off, cookie in probes:
                    try:
                        self.links.append(perf_uprobe_link(fd, path, off, cookie,
                                                           retprobe=ret))
                    except OSError as e:
                        refused[off] = e.strerror or str(e)
        return refused

    @staticmethod
    def _multi(fd: int, path: str, probes: list[tuple[int, int]], ret: bool) -> int:
        offs, cookies = zip(*probes, strict=True)
        return uprobe_multi_link(fd, path, list(offs), list(cookies), retprobe=ret)

    def slow_links(self) -> list[int]:
        """Links whose release waits for grace periods one after the other (the perf
        event of each, under a kernel-wide mutex): for release_in_background."""
        return [] if self.multi else list(self.links)

    def close(self) -> None:
        """Close our links: side by side (uprobe_multi), or one by one where
        release_in_background holds the last references (perf events)."""
        links, self.links = self.links, []
        if self.multi:
            close_all(links)
        else:
            for fd in links:
                os.close(fd)
