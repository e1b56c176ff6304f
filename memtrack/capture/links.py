"""Allocator uprobes as BPF links the tracker creates and releases itself.

bcc attaches one perf event per probe, and every detach waits for its own RCU grace
period (0.1-0.2 s each here). Since Linux 6.6 a uprobe_multi link (BPF_LINK_CREATE,
BPF_TRACE_UPROBE_MULTI) attaches every offset of a file to one program in one call,
with one attach cookie per offset, and its close waits once for all of them. The
allocator programs of bpf/alloc.c read the cookie to learn what the probed function
is, so a module needs three links: entries, returns and frees.

A uprobe_multi link also takes a pid: the kernel then puts the breakpoints only
into that process's address space (and into each address space it execs into, as the
file is mapped there) and runs the program only for its threads, so a link per traced
process and module costs nothing to any other process on the host. A forked child
inherits its parent's breakpoints with the copied memory, but not the parent's links:
until it has links of its own its hits run no program (the session stops each new
process of the tree before it returns to user space and links it: session.py).
Links are kept by owner (the pid they are scoped to, 0 for host-wide ones) so that a
process's links can be released when it is gone.

Older kernels (5.15-6.5) get the same programs and cookies through one perf-event
uprobe per offset, each bound to its program by a BPF_PERF_EVENT link with the
cookie, host-wide. Both paths pass no reference-counter (USDT semaphore) offset: bcc
0.26's own `attach_uprobe` passes garbage there (bcc #5236, see bcc_compat).

x86-64 only (syscall numbers), like the rest of capture.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import errno
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from memtrack.capture.syscalls import bpf, perf_event_open

BPF_LINK_CREATE = 28
BPF_PERF_EVENT = 41
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
PERF_FLAG_FD_CLOEXEC = 8
PROG_KPROBE = 2  # BPF_PROG_TYPE_KPROBE: uprobe programs too
PERF_ATTR_SIZE_VER5 = 112
UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")



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
                      retprobe: bool = False, pid: int = 0) -> int:
    """One uprobe_multi link of `prog_fd` on every offset of `path`, scoped to the process
    `pid` (0: every process); returns its fd."""
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
    a.put(56, pid, ct.c_uint32)
    return _check(bpf(BPF_LINK_CREATE, a.buf),
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
    pfd = _check(perf_event_open(a.buf, -1, 0, -1, PERF_FLAG_FD_CLOEXEC),
                 what)
    try:
        link = _Attr(32)
        link.put(0, prog_fd, ct.c_uint32)
        link.put(4, pfd, ct.c_uint32)
        link.put(8, BPF_PERF_EVENT, ct.c_uint32)
        link.put(16, cookie)
        return _check(bpf(BPF_LINK_CREATE, link.buf),
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


CLOSE_THREADS = 64  # closes under way at once: their grace periods overlap


def close_all(fds: Iterable[int]) -> None:
    """Close fds side by side: each uprobe release waits for a grace period of its
    own, and those of concurrent closes overlap."""
    pending = list(fds)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                fd = pending.pop()
            os.close(fd)

    threads = [threading.Thread(target=worker) for _ in range(min(len(pending), CLOSE_THREADS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Closer:
    """Closes links in the background (each close sleeps through a grace period: 30 ms
    here, and walks the probe's other links for every process that maps the file), so
    that releasing a finished process's links never holds up an attach."""

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._held: list[int] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def hold(self, fds: list[int]) -> None:
        """Keep `fds` open for stop() to hand over (links that trap nobody: release them
        in the background rather than wait for their grace periods)."""
        with self._cond:
            self._held += fds

    def close(self, fds: list[int]) -> None:
        if not fds:
            return
        with self._cond:
            self._fds += fds
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="memtrack-close",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                fds, self._fds = self._fds, []
                if not fds:
                    self._thread = None
                    self._cond.notify_all()
                    return
            close_all(fds)

    def stop(self) -> list[int]:
        """Close no more: wait for the closes under way; the fds not closed yet (those
        held among them)."""
        with self._cond:
            pending, self._fds = self._fds + self._held, []
            self._held = []
            while self._thread is not None:
                self._cond.wait()
        return pending


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
    """The allocator programs (loaded for the kernel's attach path) and their links,
    by owner: the pid a link is scoped to, 0 for host-wide links."""

    PROGRAMS = ("mt_alloc", "mt_ret", "mt_free")

    def __init__(self, bpf: Any, *, multi: bool | None = None) -> None:
        if multi is None:
            probe = bpf.load_func(b"mt_free", PROG_KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
            multi = uprobe_multi_supported(probe.fd)
            if not multi:  # load_func keeps programs by name: load it again for perf events
                os.close(probe.fd)
                del bpf.funcs[b"mt_free"]
        self.multi = multi
        # The verifier takes ~0.1-0.2 s over mt_alloc (the stack capture), a third of a
        # capture's start-up: the programs load on a thread of their own (the syscall
        # leaves the GIL) beside the rest of it, the spawn and the first process's
        # module reads; the first attach waits for them (wait()).
        self._fds: dict[str, int] = {}
        self._load_error: BaseException | None = None
        self._loader = threading.Thread(
            target=self._load, args=(bpf, BPF_TRACE_UPROBE_MULTI if multi else -1),
            name="memtrack-load", daemon=True)
        self._loader.start()
        self.links: dict[int, list[int]] = {}
        self.closer = Closer()
        self._hold = False

    def _load(self, bpf: Any, attach_type: int) -> None:
        # the process's signals go to the other threads: one pending here stops the
        # verifier (EAGAIN, and the load starts over)
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            for name in self.PROGRAMS:
                self._fds[name] = bpf.load_func(name.encode(), PROG_KPROBE,
                                                attach_type=attach_type).fd
        except BaseException as e:  # noqa: BLE001 - handed to wait()'s caller
            self._load_error = e

    def wait(self) -> dict[str, int]:
        """The programs' fds by name, once loaded; what their load raised (LoadError
        when the verifier refused one) if it failed."""
        self._loader.join()
        if self._load_error is not None:
            raise self._load_error
        return self._fds

    @property
    def mode(self) -> str:
        return "uprobe_multi" if self.multi else "perf_event"

    def attach(self, path: str, entries: list[tuple[int, int]],
               frees: list[tuple[int, int]], pid: int = 0) -> dict[int, str]:
        """Probe `path`: each (offset, cookie) of `entries` with mt_alloc and, at the
        same offset, mt_ret on the return; each of `frees` with mt_free; in the process
        `pid` only (uprobe_multi links), or everywhere (pid 0). Returns the offsets the
        kernel refused to probe (e.g. an instruction uprobes cannot handle, ENOTSUPP)
        with the reason; everything else is attached."""
        assert self.multi or not pid, "perf-event uprobes are attached host-wide"
        refused: dict[int, str] = {}
        links = self.links.setdefault(pid, [])
        for program, probes, ret in (("mt_alloc", entries, False), ("mt_ret", entries, True),
                                     ("mt_free", frees, False)):
            probes = [(off, cookie) for off, cookie in probes if off not in refused]
            if not probes:
                continue
            fd = self.wait()[program]
            if self.multi:
                try:
                    links.append(self._multi(fd, path, probes, ret, pid))
                    continue
                except OSError:
                    pass
                # one offset refused fails the whole link: find which, link the others
                good = []
                for off, cookie in probes:
                    try:
                        os.close(self._multi(fd, path, [(off, cookie)], ret, pid))
                        good.append((off, cookie))
                    except OSError as e:
                        refused[off] = e.strerror or str(e)
                if good:
                    links.append(self._multi(fd, path, good, ret, pid))
            else:
                for off, cookie in probes:
                    try:
                        links.append(perf_uprobe_link(fd, path, off, cookie, retprobe=ret))
                    except OSError as e:
                        refused[off] = e.strerror or str(e)
        return refused

    @staticmethod
    def _multi(fd: int, path: str, probes: list[tuple[int, int]], ret: bool, pid: int) -> int:
        offs, cookies = zip(*probes, strict=True)
        return uprobe_multi_link(fd, path, list(offs), list(cookies), retprobe=ret, pid=pid)

    def release(self, pid: int, *, wait: bool = False) -> None:
        """Close the links scoped to `pid`: in the background, or before returning
        (`wait`: where a link made next must not run beside them)."""
        fds = self.links.pop(pid, [])
        if wait:
            close_all(fds)
        elif self._hold:
            self.closer.hold(fds)
        else:
            self.closer.close(fds)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Links released meanwhile (without `wait`) are held for closer.stop(), not
        closed: for processes gone, whose links trap nobody, at the end of a session."""
        self._hold = True
        try:
            yield
        finally:
            self._hold = False

    def owners(self) -> list[int]:
        """The pids that have links of their own (not 0)."""
        return [pid for pid, fds in self.links.items() if pid and fds]

    def slow_links(self) -> list[int]:
        """Links whose release waits for grace periods one after the other (the perf
        event of each, under a kernel-wide mutex): for release_in_background."""
        return [] if self.multi else [fd for fds in self.links.values() for fd in fds]

    def close(self) -> None:
        """Close every link still owned: side by side (uprobe_multi), or one by one
        where release_in_background holds the last references (perf events). Those
        handed to the closer are its own (`closer.stop()`)."""
        self._loader.join()  # the program's cleanup closes what it loaded
        links = [fd for fds in self.links.values() for fd in fds]
        self.links = {}
        if self.multi:
            close_all(links)
        else:
            for fd in links:
                os.close(fd)
