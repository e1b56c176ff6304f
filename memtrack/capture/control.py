"""The control FIFO: the traced program or a runner switches recording on and off.

CMD sees MEMTRACK_CONTROL (write one command a line: enable/on/1/start,
disable/off/0/stop) and MEMTRACK_CONTROL_ACK (read "ok" or "error ..." a line back).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

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

    def serve(self, enable: Callable[[bool], None]) -> None:
        """Run the commands that arrived; answer each on the ack FIFO."""
        try:
            data = os.read(self._fd, 4096)
        except BlockingIOError:
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            cmd = line.strip().decode(errors="replace").lower()
            if not cmd:
                continue
            if cmd in ON or cmd in OFF:
                enable(cmd in ON)
                reply = "ok"
            else:
                reply = f"error unknown command {cmd!r}"
            self._ack(reply)

    def _ack(self, reply: str) -> None:
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
