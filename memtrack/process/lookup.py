"""Lookups in sorted keys, the idioms the stages share: the exact lookup
(`find_sorted`: `searchsorted`, the index clamped into the keys, the key compared), each
group's rows (`group_bounds`: rows put in the order of a small group number, each
group's [start, end); `key_bounds`: each key's [start, end) in sorted keys), the
distinct pairs of two key columns (`unique_pairs`), and a value per key carried from
batch to batch (`Carry`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


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


def group_bounds(groups: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows by group (`groups`: each row's, 0 <= group < count): the order that puts
    them in group order (stable: a group's rows keep their order) and the bounds in it,
    group k's rows being order[bounds[k]:bounds[k + 1]]."""
    order = np.argsort(groups, kind="stable")
    return order, np.searchsorted(groups[order], np.arange(count + 1))


def key_bounds(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `values` runs in `keys` (ascending): [start, end), empty where it
    is not there."""
    return np.searchsorted(keys, values, side="left"), np.searchsorted(keys, values,
                                                                       side="right")


def unique_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (a, b) pairs in (a, b) order, as two columns, and each row's pair.
    What np.unique(np.stack([a, b]), axis=1, return_inverse=True) answers: that sorts
    every row as an opaque record; here the rows are hashed (Arrow's dictionary_encode
    over each row's bytes) and only the distinct pairs sorted, ~10x faster on millions
    of rows that repeat (a Python stack's frames)."""
    rows = np.empty(len(a), [("a", a.dtype), ("b", b.dtype)])
    rows["a"], rows["b"] = a, b
    encoded = pc.dictionary_encode(pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(rows.dtype.itemsize), len(rows), [None, pa.py_buffer(rows)]))
    distinct = np.frombuffer(encoded.dictionary.buffers()[1], rows.dtype,
                             len(encoded.dictionary))
    order = np.lexsort((distinct["b"], distinct["a"]))
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return (distinct["a"][order], distinct["b"][order],
            rank[encoded.indices.to_numpy(zero_copy_only=False)])


class Carry:
    """A value per key carried from batch to batch, the newest kept (keys sorted)."""

    def __init__(self) -> None:
        self.keys: np.ndarray | None = None
        self.values = np.zeros(0, np.int64)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's value, and whether it has one (the value is 0 where not)."""
        if self.keys is None or not len(self.keys) or not len(keys):
            return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
        j, found = find_sorted(self.keys, keys)
        return np.where(found, self.values[j], 0), found

    def update(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Keep the last value of each key of `keys` (sorted; a key's values in order)."""
        if not len(keys):
            return
        last = np.flatnonzero(np.append(keys[1:] != keys[:-1], True))
        if self.keys is None:
            self.keys, self.values = keys[last], values[last].astype(np.int64)
            return
        both = np.concatenate([keys[last], self.keys])
        self.keys, at = np.unique(both, return_index=True)  # the batch's first: the newest
        self.values = np.concatenate([values[last], self.values])[at]
