"""This process's own memory, read the way capture reads a traced one."""

from __future__ import annotations

from pathlib import Path

import pytest


def vdso_bytes() -> bytes:
    """The image of this process's vDSO (skips the test where there is none)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[vdso]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            with open("/proc/self/mem", "rb") as f:
                f.seek(lo)
                return f.read(hi - lo)
    pytest.skip("no [vdso] mapping in this process")
