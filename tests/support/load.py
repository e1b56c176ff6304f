"""A busy machine, as a CI runner often is: CPU-bound processes beside a capture."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cpu_hogs(n: int = 2) -> Iterator[None]:
    """n CPU-bound processes while the block runs (they never allocate, so they take no
    uprobe trap)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()
