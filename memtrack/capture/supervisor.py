"""The supervisor: continues the traced processes when memtrack dies.

memtrack stops traced processes with SIGSTOP (attach requests, ring pauses). Killed
at such a moment (kill -9 included), it would leave them stopped for ever. So a
Tracker first starts this supervisor, before its BPF program is loaded: a fresh
Python process (`python -m memtrack.capture.supervisor FD PID`, so it inherits no
program or perf fd: it must not keep the probes alive), in a session of its own
(terminal signals do not reach it), holding its end of a socket pair and a pidfd of
memtrack. Once the program is loaded the tracker sends it the fds of the tracked-pid
and paused-pid maps (SCM_RIGHTS), and each pid it stops that is in neither yet (a
spawned command before its exec).

When memtrack exits without saying "done" first (killed, crashed) the supervisor
sends SIGCONT to every pid in those maps and every pid it was told of. It acts once
memtrack has exited (its pidfd is readable): by then the kernel has closed all of
memtrack's fds, the probes are gone, and nothing can stop a traced process again.
A terminal with memtrack's status line on it (sent as an fd while the line is up) gets
its scroll region reset and the line cleared.
"""

from __future__ import annotations

import ctypes as ct
import os
import select
import signal
import socket
import subprocess
import sys

from memtrack.capture.syscalls import bpf

_BPF_MAP_GET_NEXT_KEY = 4


class _MapAttr(ct.Structure):
    _fields_ = [("map_fd", ct.c_uint32), ("pad", ct.c_uint32), ("key", ct.c_uint64),
                ("next_key", ct.c_uint64), ("flags", ct.c_uint64)]


def map_keys(fd: int, limit: int = 1 << 20) -> list[int]:
    """The u32 keys of a BPF hash map (raw bpf(2): no bcc here)."""
    cur, nxt = ct.c_uint32(), ct.c_uint32()
    attr = _MapAttr(map_fd=fd, key=0, next_key=ct.addressof(nxt))
    keys: list[int] = []
    while len(keys) < limit and bpf(_BPF_MAP_GET_NEXT_KEY, attr) == 0:
        keys.append(nxt.value)
        cur.value = nxt.value
        attr.key = ct.addressof(cur)
    return keys


class Supervisor:
    """memtrack's side: starts the supervisor process and tells it what to watch."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours

    def fileno(self) -> int:
        return self.sock.fileno()

    def watch_maps(self, *fds: int) -> None:
        """pid-keyed BPF maps whose pids it continues if memtrack dies."""
        socket.send_fds(self.sock, [b"maps"], list(fds))

    def watch_pid(self, pid: int) -> None:
        self.sock.send(b"pid %d" % pid)

    def watch_tty(self, fd: int | None) -> None:
        """The terminal the status line is on (None: it is gone)."""
        if fd is None:
            self.sock.send(b"no tty")
        else:
            socket.send_fds(self.sock, [b"tty"], [fd])

    def close(self) -> None:
        """memtrack is done: the supervisor exits without touching anything. Not waited
        for (its interpreter's exit took 10-20 ms of every capture's end): it reads
        "done" before the end of the socket and exits, reaped by subprocess (or, once
        memtrack is gone, by init)."""
        if self.sock.fileno() < 0:
            return
        try:
            self.sock.send(b"done")
        except OSError:
            pass
        self.sock.close()


def _continue_all(maps: list[int], pids: set[int]) -> None:
    targets = set(pids)
    for fd in maps:
        targets.update(map_keys(fd))
    for pid in targets:
        try:
            os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass


def _reset_tty(fd: int) -> None:
    from memtrack.capture.status import reset_sequence

    try:
        os.write(fd, reset_sequence(os.get_terminal_size(fd).lines).encode())
    except OSError:
        pass


def main(argv: list[str]) -> int:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP,
              signal.SIGPIPE):
        signal.signal(s, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    try:
        pidfd: int | None = os.pidfd_open(int(argv[2]))
    except OSError:  # memtrack is gone already
        pidfd = None
    maps: list[int] = []
    pids: set[int] = set()
    tty: int | None = None
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        # the socket first: memtrack may be gone already after its "done" (close()
        # does not wait for us)
        if sock.fileno() in ready:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 8)
            if msg == b"done":
                return 0
            if msg == b"maps":
                maps.extend(fds)
            elif msg.startswith(b"pid "):
                pids.add(int(msg[4:]))
            elif msg == b"tty":
                tty = fds[0]
            elif msg == b"no tty" and tty is not None:
                os.close(tty)
                tty = None
            elif not msg:  # the socket closed without "done", memtrack lives on
                _continue_all(maps, pids)
                if pidfd is not None:
                    select.select([pidfd], [], [], 2.0)
                break
        elif pidfd is not None and pidfd in ready:
            break  # memtrack exited: its probes are gone with it
    _continue_all(maps, pids)
    if tty is not None:
        _reset_tty(tty)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
