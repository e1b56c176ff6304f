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
from Python's allocator) unless Python runs with PYTHONMALLOC=malloc.

A runner outside the traced tree switches recording with `send(path, "enable")` on the
FIFO it asked for with --control-fifo.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import threading
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


def _answer(afd: int, tag: str, timeout: float) -> str | None:
    """The first answer line for us: the one tagged `tag` (its second word, when that
    is a number); answers to others (a runner's plain write, a caller that gave up)
    are skipped."""
    buf = b""
    want = tag.encode()
    poll = select.poll()
    poll.register(afd, select.POLLIN)
    while True:
        if not poll.poll(int(timeout * 1000)):
            return None
        buf += os.read(afd, 256)  # small: Python's own allocator, not a malloc
        *lines, buf = buf.split(b"\n")
        for line in lines:
            words = line.split(b" ", 2)
            if (words[1] if len(words) > 1 and words[1].isdigit() else b"") == want:
                return line.decode(errors="replace")


def _request(verb: str, arg: str = "") -> bool:
    global last_error
    ctl, ack = os.environ.get(CONTROL_ENV), os.environ.get(ACK_ENV)
    if not ctl or not ack:
        last_error = ""
        return False
    tag = str(threading.get_native_id())
    try:
        reply = send(ctl, f"{verb} {tag}" + (f" {arg}" if arg else ""), ack, tag)
    except OSError as e:
        last_error = f"{ctl}: {e.strerror or e}"
        return False
    if reply is None:
        last_error = f"no answer from memtrack within {TIMEOUT_S:.0f} s"
        return False
    ok = reply.startswith("ok")
    last_error = "" if ok else reply.split(" ", 2)[-1]
    return ok


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
    value is whether memtrack marked its begin."""
    began = begin(name)
    try:
        yield began
    finally:
        if began:
            end(name)


def active() -> bool:
    """Whether this program runs under `memtrack capture` (the FIFOs are in its
    environment)."""
    return bool(os.environ.get(CONTROL_ENV) and os.environ.get(ACK_ENV))
