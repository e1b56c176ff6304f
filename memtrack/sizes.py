"""Sizes as people write them: `24 MB`, `512KiB`, `1.5 GB`, `0 B`, `4096`.

The units are powers of 1024 whether written KB or KiB (K, M, G, T, P), as
pytest-memray's `limit_memory("24 MB")` reads them, so that a limit moved from one
marker to the other means the same bytes; the case of the unit does not matter. Used by
the pytest plugin's `memtrack_limit` marker (memtrack.pytest); standard library only.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGTP])(?:I?B)?|B)?\s*", re.IGNORECASE)
_POWER = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
MAX_SIZE = (1 << 63) - 1  # a size is a BIGINT in the run database


def parse_size(text: str | int) -> int:
    """The bytes of `text` (a whole number of bytes, or a number and a unit; a
    fraction of a unit rounds down to whole bytes), or ValueError saying what is
    expected."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"expected a size such as '24 MB' or a number of bytes, got {text!r}")
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE.fullmatch(text)
        if not m:
            raise ValueError(f"expected a size such as '24 MB', '512 KiB' or '0 B', "
                             f"got {text!r}")
        number, unit = m.groups()
        scale = 1024 ** _POWER[unit.upper()] if unit else 1
        if "." in number:
            whole, _, frac = number.partition(".")
            n = int(whole or 0) * scale + int(frac or 0) * scale // 10 ** len(frac or "")
        else:
            n = int(number) * scale
    if not 0 <= n <= MAX_SIZE:
        raise ValueError(f"expected a size from 0 to {MAX_SIZE} bytes, got {text!r}")
    return n
