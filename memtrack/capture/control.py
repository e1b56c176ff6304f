"""The control FIFO: the traced program or a runner switches recording on and off, and
marks regions (memtrack.capture.regions).

CMD sees MEMTRACK_CONTROL (write one command a line) and MEMTRACK_CONTROL_ACK (read the
answer, a line back, once the command is in effect in the kernel):

    enable [TAG]  (or on, 1, start)     ok [TAG]             recording on, whole tree
    disable [TAG] (or off, 0, stop)     ok [TAG]             recording off
    begin TID NAME                      ok TID | error TID WHY   thread TID enters NAME
    end TID [NAME]                      ok TID | error TID WHY   ... leaves its innermost
    label TID KEY=VALUE                 ok TID | error TID WHY   said of its innermost

A TAG (digits: the helpers send their thread id) comes back in the answer, so that
threads sharing the answer FIFO can tell theirs apart; the helpers (memtrack/control/)
also hold an flock on it from their command to its answer. An unknown command is
answered `error [TAG] unknown command ...`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from memtrack.capture.regions import RegionError, Regions

CONTROL_ENV = "MEMTRACK_CONTROL"
CONTROL_ACK_ENV = "MEMTRACK_CONTROL_ACK"
ON = ("enable", "on", "1", "start")
OFF = ("disable", "off", "0", "stop")


class ControlError(Exception):
    """The FIFO cannot be made; the message is one line for the user."""


class ControlFifo:
    """The FIFO pair of one session, in `directory` (or at `path`)."""

    def __init__(self, directory: Path, path: Path | None,
                 user: tuple[int, int] | None) -> None:
        self.directory = directory
        self.path = Path(path) if path else directory / "control"
        self.ack_path = self.path.with_name(self.path.name + ".ack")
        made: list[Path] = []
        try:
            for p in (self.path, self.ack_path):
                try:
                    os.mkfifo(p, 0o600)
                except FileExistsError:
                    raise ControlError(f"{p}: already exists; choose another control FIFO "
                                       "path") from None
                except OSError as e:
                    raise ControlError(f"{p}: cannot create the control FIFO "
                                       f"({e.strerror})") from None
                made.append(p)
                if user is not None:
                    os.chown(p, user[0], user[1])
        except ControlError:
            for p in made:
                p.unlink()
            raise
        if user is not None and path is None:
            os.chown(directory, user[0], user[1])
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        # our own writer keeps the FIFO open, so that a writer closing is no EOF storm
        self._keep = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self._buf = b""

    def env(self) -> dict[str, str]:
        return {CONTROL_ENV: str(self.path), CONTROL_ACK_ENV: str(self.ack_path)}

    def fileno(self) -> int:
        return self._fd

    def serve(self, enable: Callable[[bool], None], regions: Regions | None = None) -> None:
        """Run the commands that arrived; answer each on the ack FIFO."""
        try:
            data = os.read(self._fd, 4096)
        except BlockingIOError:
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace").strip()
            if text:
                self._ack(run_command(text, enable, regions))

    def _ack(self, reply: str) -> None:
        """Write one answer line, if anyone reads the ack FIFO (lines of at most 4096
        bytes go in at once, never interleaved with another writer's)."""
        try:
            fd = os.open(self.ack_path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # nobody waits for an answer (a runner's plain write)
            if e.errno == errno.ENXIO:
                return
            raise
        try:
            os.write(fd, (reply + "\n").encode())
        except BlockingIOError:
            pass
        finally:
            os.close(fd)

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._keep)
        for p in (self.path, self.ack_path):
            try:
                os.unlink(p)
            except OSError:
                pass


def run_command(text: str, enable: Callable[[bool], None], regions: Regions | None) -> str:
    """Run one command line; its answer line."""
    verb, _, rest = text.partition(" ")
    verb = verb.lower()
    tag, _, arg = rest.strip().partition(" ")
    if verb in ON or verb in OFF:
        if tag and not tag.isdigit() or arg:
            return f"error unknown command {text!r}"
        enable(verb in ON)
        return f"ok {tag}" if tag else "ok"
    usages = {"begin": "begin TID NAME", "end": "end TID [NAME]",
              "label": "label TID KEY=VALUE"}
    if verb not in usages:
        return f"error unknown command {text!r}"
    if not tag.isdigit():
        usage = usages[verb]
        return f"error {verb} needs a thread id: {usage}"
    if regions is None:
        return f"error {tag} regions are not recorded by this session"
    try:
        if verb == "begin":
            regions.begin(int(tag), arg)
        elif verb == "label":
            regions.label(int(tag), arg)
        else:
            regions.end(int(tag), arg or None)
    except RegionError as e:
        return f"error {tag} {e}"
    return f"ok {tag}"
