"""Talk to memtrack from inside a traced program, or from a runner beside it.

Dependency-free (the standard library only): vendor this file into a benchmark's tree,
or import it as memtrack.control.memtrack_control.

`memtrack capture` puts two FIFOs in the traced program's environment:
MEMTRACK_CONTROL (commands, one line each) and MEMTRACK_CONTROL_ACK (the answers).
Every call here sends one command and waits for its answer, which memtrack writes
once the command is in effect in the kernel:

- `enable()` / `disable()`: recording on or off for the whole traced tree;
- `begin(name)` / `end()`: the calling thread enters or leaves the region `name` (a
  benchmark, a test). Every allocation the thread makes after `begin` returns and
  before `end` is called belongs to the region; regions nest per thread (`end` leaves
  the innermost); other threads are not in it. `region(name)` is both a context
  manager and a decorator;
- `label(key, value)`: KEY=VALUE said of the calling thread's innermost region (the
  pytest plugin's limits: `limit.peak`, ...; `memtrack check` reads them).

Each returns True once memtrack answered "ok", and False outside memtrack (nothing is
sent) or when memtrack refused (`last_error` says why). The calls are thread-safe:
an flock on the answer FIFO keeps one command in flight, and each answer carries the
sender's thread id. They make no malloc call of their own (only small Python objects,
from Python's allocator) unless Python runs with PYTHONMALLOC=malloc, and no Python
object at all from the moment a command is written until its answer is read. So with
CPython's object allocator traced (`capture --python-allocators on`) a region of
`region(name)` holds no object of the helper's (it makes its end request before the
begin); `end()` makes its request inside the region: `Request("end", name)`, made
before `begin` and `.send()` at the end, does not.

A runner outside the traced tree switches recording with `send(path, "enable")` on the
FIFO it asked for with --control-fifo.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import select
import sys
import termios
import threading
import time
from collections.abc import Iterator

CONTROL_ENV = "MEMTRACK_CONTROL"
ACK_ENV = "MEMTRACK_CONTROL_ACK"
TIMEOUT_S = 60.0  # an answer that takes longer: memtrack is gone (or stuck)
MAX_NAME = 4000  # bytes of a region name: the command stays within one atomic write

last_error = ""  # why the last call that returned False failed ("" outside memtrack)


def send(control: str | os.PathLike[str], command: str,
         ack: str | os.PathLike[str] | None = None, tag: str = "",
         timeout: float = TIMEOUT_S) -> str | None:
    """Write one command line to a control FIFO. With `ack`, wait for the answer (the
    first answer line ending with `tag`, which the command must carry) and return it;
    without, return "" once written. None when no answer came within `timeout`."""
    if "\n" in command:
        raise ValueError("a control command is one line")
    afd = os.open(ack, os.O_RDWR | os.O_CLOEXEC) if ack is not None else -1
    try:
        if afd >= 0:
            fcntl.flock(afd, fcntl.LOCK_EX)
        cfd = os.open(control, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(cfd, command.encode() + b"\n")
        finally:
            os.close(cfd)
        return _answer(afd, tag, timeout) if afd >= 0 else ""
    finally:
        if afd >= 0:
            os.close(afd)  # releases the lock


def _answer(afd: int, tag: str, timeout: float, buf: bytes = b"") -> str | None:
    """The first answer line for us: the one tagged `tag` (its second word, when that
    is a number); answers to others (a runner's plain write, a caller that gave up)
    are skipped. `buf`: what was read of the answers already."""
    want = tag.encode()
    poll = select.poll()
    poll.register(afd, select.POLLIN)
    while True:
        *lines, buf = buf.split(b"\n")
        for line in lines:
            words = line.split(b" ", 2)
            if (words[1] if len(words) > 1 and words[1].isdigit() else b"") == want:
                return line.decode(errors="replace")
        if not poll.poll(int(timeout * 1000)):
            return None
        buf += os.read(afd, 256)  # small: Python's own allocator, not a malloc


# Waiting for an answer without creating a Python object (Request.send): FIONREAD says
# how many bytes wait in the answer FIFO, polled with these pauses (0: sched_yield, an
# answer's usual wait; a sleep is 50 µs at least, the kernel's timer slack; their sum
# TIMEOUT_S)
_PAUSES = (0.0,) * 2000 + (2e-4,) * 50 + (2e-3,) * 500 + (0.05,) * 1180
_NOTHING = bytes(4)  # FIONREAD's count (a C int) when nothing waits
SMALL_INT = 256  # CPython makes no object for an int up to this (os.write's result)


class Request:
    """One command of the calling thread, made in full when created (its bytes, the
    answer it expects, the answer FIFO opened), so that `send` creates no Python object
    from the moment memtrack may act on it until its answer is read: with CPython's
    object allocator traced (`capture --python-allocators on`), nothing of the helper's
    own falls inside a region it begins or ends (`region` and the pytest plugin make a
    region's end request before its begin). Sent once, by the thread that made it;
    `close` one that is never sent."""

    __slots__ = ("_ctl", "_answers", "_tag", "_head", "_tail", "_ok", "_waiting", "_read",
                 "_counted", "_pauses", "_error")

    def __init__(self, verb: str, arg: str = "") -> None:
        if "\n" in arg or len(arg.encode()) > MAX_NAME:
            raise ValueError(f"a control command is one line of at most {MAX_NAME} bytes")
        ctl, ack = os.environ.get(CONTROL_ENV), os.environ.get(ACK_ENV)
        self._ctl = os.fsencode(ctl) if ctl else b""
        self._tag = str(threading.get_native_id())
        line = f"{verb} {self._tag}".encode() + (b" " + arg.encode() if arg else b"") + b"\n"
        # os.write's result for a line longer than SMALL_INT is an object: such a line
        # goes in two writes, the command complete (and acted on) only at its newline
        self._head, self._tail = (line, b"") if len(line) <= SMALL_INT else (line[:-1], b"\n")
        self._ok = f"ok {self._tag}\n".encode()  # the answer when it worked
        self._waiting = len(self._ok).to_bytes(4, sys.byteorder)  # FIONREAD then
        self._read = bytearray(len(self._ok))
        self._counted = bytearray(4)
        self._pauses = iter(_PAUSES)
        self._answers: io.FileIO | None = None  # readinto makes no object (os.readv does)
        self._error = ""
        if ctl and ack:
            try:
                self._answers = io.FileIO(ack, "r+")
            except OSError as e:
                self._error = f"{ack}: {e.strerror or e}"

    def close(self) -> None:
        if self._answers is not None:
            self._answers.close()
            self._answers = None

    def send(self) -> bool:
        """Send the command and wait for its answer: True once memtrack answered "ok",
        False outside memtrack or when memtrack refused (`last_error` says why)."""
        global last_error
        answers = self._answers
        if answers is None:
            last_error = self._error
            return False
        try:
            afd = answers.fileno()
            fcntl.flock(afd, fcntl.LOCK_EX)
            cfd = os.open(self._ctl, _CTL_FLAGS)
            try:
                os.write(cfd, self._head)
                if self._tail:
                    os.write(cfd, self._tail)
            finally:
                os.close(cfd)
            # from here on memtrack may have acted: no new object until the answer
            for pause in self._pauses:
                fcntl.ioctl(afd, termios.FIONREAD, self._counted, True)
                if self._counted != _NOTHING:
                    break
                if pause:
                    time.sleep(pause)
                else:
                    os.sched_yield()
            else:
                last_error = f"no answer from memtrack within {TIMEOUT_S:.0f} s"
                return False
            got = answers.readinto(self._read) if self._counted == self._waiting else 0
            if got == len(self._read) and self._read == self._ok:
                last_error = ""
                return True
            # another answer, or a refusal: read it all
            reply = _answer(afd, self._tag, TIMEOUT_S, bytes(self._read[:got]))
        except OSError as e:
            last_error = f"{os.fsdecode(self._ctl)}: {e.strerror or e}"
            return False
        finally:
            self.close()  # releases the lock
        if reply is None:
            last_error = f"no answer from memtrack within {TIMEOUT_S:.0f} s"
            return False
        ok = reply.startswith("ok")
        last_error = "" if ok else reply.split(" ", 2)[-1]
        return ok


_CTL_FLAGS = os.O_WRONLY | os.O_CLOEXEC


def _request(verb: str, arg: str = "") -> bool:
    return Request(verb, arg).send()


def enable() -> bool:
    """Recording on for the whole traced tree."""
    return _request("enable")


def disable() -> bool:
    """Recording off for the whole traced tree."""
    return _request("disable")


def begin(name: str) -> bool:
    """The calling thread enters the region `name` (one line, at most MAX_NAME bytes)."""
    if "\n" in name or len(name.encode()) > MAX_NAME:
        raise ValueError(f"a region name is one line of at most {MAX_NAME} bytes")
    return _request("begin", name)


def end(name: str | None = None) -> bool:
    """The calling thread leaves its innermost region (refused unless it is `name`,
    when given)."""
    return _request("end", name or "")


def label(key: str, value: str) -> bool:
    """Say `key`=`value` of the calling thread's innermost open region (the key letters,
    digits and . _ -; the label one line of at most MAX_NAME bytes)."""
    text = f"{key}={value}"
    if "\n" in text or len(text.encode()) > MAX_NAME:
        raise ValueError(f"a label is one line of at most {MAX_NAME} bytes")
    return _request("label", text)


@contextlib.contextmanager
def region(name: str) -> Iterator[bool]:
    """`with region("parse"):` ... or `@region("parse")`: the body is the region; the
    value is whether memtrack marked its begin. Its end request is made before the
    begin (Request): nothing of the helper's own is in the region."""
    if "\n" in name or len(name.encode()) > MAX_NAME:
        raise ValueError(f"a region name is one line of at most {MAX_NAME} bytes")
    closing = Request("end", name)
    began = Request("begin", name).send()
    try:
        yield began
    finally:
        if began:
            closing.send()
        else:
            closing.close()


def active() -> bool:
    """Whether this program runs under `memtrack capture` (the FIFOs are in its
    environment)."""
    return bool(os.environ.get(CONTROL_ENV) and os.environ.get(ACK_ENV))
