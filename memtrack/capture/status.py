"""The live status line of a capture.

On a terminal it owns the bottom row: a scroll region over the rows above keeps the
traced program's output (which goes to the same terminal) scrolling there, and each
update is one write() that saves the cursor, rewrites the bottom row and restores the
cursor, so it never lands inside the program's output (the terminal driver does not
interleave two write() calls). The region is reset and the row cleared at the end.
To any other stream (a log, a test's StringIO) it writes one plain line per update.
"""

from __future__ import annotations

import os
from typing import TextIO

SAVE, RESTORE, CLEAR_LINE = "\0337", "\0338", "\033[2K"


def reset_sequence(rows: int) -> str:
    """Clear the bottom row and give the whole screen back to scrolling."""
    return f"{SAVE}\033[{rows};1H{CLEAR_LINE}\033[r{RESTORE}"


class StatusLine:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        try:
            self.fd: int | None = stream.fileno() if stream.isatty() else None
        except (AttributeError, OSError, ValueError):
            self.fd = None
        self.rows = 0

    def _size(self) -> tuple[int, int]:
        assert self.fd is not None
        try:
            size = os.get_terminal_size(self.fd)
        except OSError:
            return 0, 0
        return size.lines, size.columns

    def _region(self, rows: int) -> str:
        """Reserve the bottom row: the program scrolls in rows 1..rows-1 (setting the
        region homes the cursor: saved and restored around it)."""
        if rows == self.rows:
            return ""
        self.rows = rows
        return f"{SAVE}\033[1;{rows - 1}r{RESTORE}"

    def start(self) -> None:
        """Before the program writes anything: a newline and back up makes room when
        the cursor stands on the last row (the screen scrolls once)."""
        if self.fd is None:
            return
        rows, _ = self._size()
        if rows >= 2:
            self._write("\n\033[1A" + self._region(rows))

    def update(self, text: str) -> None:
        if self.fd is None:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        rows, cols = self._size()
        if rows < 2 or cols < 2:
            return
        out = self._region(rows) + f"{SAVE}\033[{rows};1H{CLEAR_LINE}{text[:cols - 1]}{RESTORE}"
        self._write(out)

    def close(self) -> None:
        """Give the bottom row back: clear it and reset the scroll region."""
        if self.fd is None or not self.rows:
            return
        rows, _ = self._size()
        self._write(reset_sequence(rows or self.rows))
        self.rows = 0

    def _write(self, out: str) -> None:
        assert self.fd is not None
        self.stream.flush()
        try:
            os.write(self.fd, out.encode())
        except OSError:
            self.fd = None
