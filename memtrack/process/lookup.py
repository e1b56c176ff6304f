"""Exact lookups in sorted keys, the idiom the stages share: `searchsorted`, the index
clamped into the keys, the key compared."""

from __future__ import annotations

import numpy as np


def find_sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `values` is in `keys` (ascending): (index, found). The index is a
    valid position of `keys` wherever found is False too (clamped), so that
    `np.where(found, column[index], default)` needs no guard; with no keys, every index
    is 0 and nothing is found (index nothing with it then)."""
    values = np.asarray(values)
    if not len(keys):
        return np.zeros(len(values), np.int64), np.zeros(len(values), bool)
    i = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return i, keys[i] == values
