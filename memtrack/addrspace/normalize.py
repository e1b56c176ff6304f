"""Normalization: a runtime address of a process -> its module and ELF virtual address,
or the reason (memtrack.schema.enums.Unresolved) why there is none. Unwinding and
symbolization both go through it, so a frame says the same thing in both.

A runtime address becomes a file offset through the mapping that holds it
(`addr - start + offset`), and the file offset an ELF virtual address through the
module's PT_LOAD segment holding it (memtrack.elf.Segments).

Address spaces come from the artifact's /proc/PID/maps snapshots. A snapshot is the set
of `mappings` rows of one (pid, ts). The address space of a record (pid, ts) is the
last snapshot of that pid taken at or before ts (the first one if the record precedes
them all); an address not mapped there is looked up in the pid's next snapshot (a
module mapped between two snapshots). Lookups are vectorized: every (snapshot,
address) pair becomes one sorted uint64 key `snapshot << 47 | address`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memtrack.addrspace.modules import Module, ModuleError, ModuleStore
from memtrack.schema import VDSO_PATH
from memtrack.schema.enums import Unresolved

RESOLVED = -1  # the reason code of an address that normalized

ADDR_BITS = 47  # x86_64 user space (4-level paging)
ADDR_LIMIT = 1 << ADDR_BITS


class AddressSpaceError(Exception):
    """Mapping snapshots that cannot be used (worded for one line)."""


class AddressSpaces:
    """All mapping snapshots of an artifact, ready for vectorized lookups."""

    def __init__(self, mappings: pa.Table) -> None:
        t = mappings.sort_by([("pid", "ascending"), ("ts", "ascending"),
                              ("start", "ascending")])
        self.table = t
        self.pid = t.column("pid").to_numpy().astype(np.uint32)
        self.ts = t.column("ts").to_numpy().astype(np.uint64)
        self.start = t.column("start").to_numpy().astype(np.uint64)
        self.end = t.column("end").to_numpy().astype(np.uint64)
        self.offset = t.column("offset").to_numpy().astype(np.uint64)
        self.path = t.column("path").combine_chunks()
        self.build_id = t.column("build_id").combine_chunks()
        n = len(self.pid)
        if n and len(self.path) != n:
            raise AddressSpaceError("mappings: columns of different lengths")
        # Build ids as small integers: bid_index[row] into bid_values (-1: none), and a
        # mapped path for each (the first row's).
        enc = pc.dictionary_encode(self.build_id)
        self.bid_values: list[str] = enc.dictionary.to_pylist()
        self.bid_index = enc.indices.fill_null(-1).to_numpy().astype(np.int64)
        first_row = np.full(len(self.bid_values), -1, dtype=np.int64)
        has = self.bid_index >= 0
        first_row[self.bid_index[has][::-1]] = np.flatnonzero(has)[::-1]
        self.bid_path: list[str] = [self.path[int(r)].as_py() or "" for r in first_row]
        newsnap = np.ones(n, dtype=bool)
        if n > 1:
            newsnap[1:] = (self.pid[1:] != self.pid[:-1]) | (self.ts[1:] != self.ts[:-1])
        self.snap_of_row = np.cumsum(newsnap) - 1
        firsts = np.flatnonzero(newsnap)
        self.snap_pid = self.pid[firsts]
        self.snap_ts = self.ts[firsts]
        ns = len(firsts)
        if ns >= 1 << (64 - ADDR_BITS):
            raise AddressSpaceError(f"mappings: {ns} snapshots, more than this build handles")
        self.snap_next = np.full(ns, -1, dtype=np.int64)
        if ns > 1:
            same = self.snap_pid[1:] == self.snap_pid[:-1]
            self.snap_next[:-1][same] = np.arange(1, ns)[same]
        ok = self.end <= ADDR_LIMIT
        self._rows = np.flatnonzero(ok)
        self._keys = (self.snap_of_row[ok].astype(np.uint64) << np.uint64(ADDR_BITS)) | (
            self.start[ok])
        is_path = pc.fill_null(pc.not_equal(self.path, ""), False)
        not_bracket = pc.invert(pc.fill_null(pc.starts_with(self.path, "["), False))
        self.file_backed = (is_path.to_numpy(zero_copy_only=False)
                            & not_bracket.to_numpy(zero_copy_only=False))
        self.is_vdso = pc.fill_null(pc.equal(self.path, VDSO_PATH), False).to_numpy(
            zero_copy_only=False)
        self.executable = pc.fill_null(pc.match_substring(t.column("perms"), "x"),
                                       False).to_numpy(zero_copy_only=False)

    def __len__(self) -> int:
        return len(self.snap_pid)

    def snapshot_of(self, pid: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """Snapshot id (int64) of each (pid, ts); -1 for a pid without snapshots."""
        pid = np.asarray(pid, dtype=np.uint32)
        ts = np.asarray(ts, dtype=np.uint64)
        out = np.full(pid.shape, -1, dtype=np.int64)
        lo = np.searchsorted(self.snap_pid, pid, side="left")
        hi = np.searchsorted(self.snap_pid, pid, side="right")
        has = hi > lo
        for p in np.unique(pid[has]):
            sel = np.flatnonzero(pid == p)
            a, b = int(lo[sel[0]]), int(hi[sel[0]])
            k = np.searchsorted(self.snap_ts[a:b], ts[sel], side="right") - 1
            out[sel] = a + np.maximum(k, 0)
        return out

    def _find_in(self, snap: np.ndarray, addr: np.ndarray) -> np.ndarray:
        out = np.full(addr.shape, -1, dtype=np.int64)
        ok = (snap >= 0) & (addr < ADDR_LIMIT)
        if not ok.any() or len(self._keys) == 0:
            return out
        key = (snap[ok].astype(np.uint64) << np.uint64(ADDR_BITS)) | addr[ok]
        i = np.searchsorted(self._keys, key, side="right") - 1
        ic = np.maximum(i, 0)
        row = self._rows[ic]
        hit = (i >= 0) & (self.snap_of_row[row] == snap[ok]) & (addr[ok] < self.end[row])
        out[np.flatnonzero(ok)[hit]] = row[hit]
        return out

    def find(self, snap: np.ndarray, addr: np.ndarray) -> np.ndarray:
        """Mapping row (int64) holding each address in its snapshot (or the pid's next
        snapshot), -1 where none."""
        snap = np.asarray(snap, dtype=np.int64)
        addr = np.asarray(addr, dtype=np.uint64)
        row = self._find_in(snap, addr)
        miss = np.flatnonzero((row < 0) & (snap >= 0))
        while len(miss):
            nxt = self.snap_next[snap[miss]]
            has = nxt >= 0
            miss, nxt = miss[has], nxt[has]
            if not len(miss):
                break
            got = self._find_in(nxt, addr[miss])
            row[miss] = got
            snap = snap.copy()
            snap[miss] = nxt
            miss = miss[got < 0]
        return row

    def file_offset(self, row: np.ndarray, addr: np.ndarray) -> np.ndarray:
        """File offset (uint64) of each address in its mapping row (row >= 0)."""
        if not len(self.start):  # no mapping at all: every row is -1
            return np.zeros(len(row), dtype=np.uint64)
        r = np.maximum(row, 0)
        return np.asarray(addr, dtype=np.uint64) - self.start[r] + self.offset[r]

    def build_ids(self, row: np.ndarray) -> pa.Array:
        """Build id (string, null for row -1 or none) of each mapping row."""
        return _take(self.build_id, row)

    def paths(self, row: np.ndarray) -> pa.Array:
        return _take(self.path, row)


def _take(col: pa.Array, row: np.ndarray) -> pa.Array:
    """The values of mapping rows (null for row -1), as a dictionary of the distinct
    values: a frame costs an index, not a copy of its module's strings."""
    enc = col.dictionary_encode()
    codes = enc.indices.fill_null(-1).to_numpy().astype(np.int32)
    row = np.asarray(row, dtype=np.int64)
    at = np.where(row >= 0, codes[np.maximum(row, 0)] if len(codes) else -1, -1)
    return pa.DictionaryArray.from_arrays(pa.array(at, pa.int32(), mask=at < 0), enc.dictionary)


@dataclass
class Normalized:
    """Per address: its mapping row, module, ELF virtual address and why not."""

    row: np.ndarray  # int64 mapping row in AddressSpaces, -1 none
    module: np.ndarray  # int64 index into Normalizer.modules, -1 none
    vaddr: np.ndarray  # int64 ELF virtual address, -1 where normalization failed
    reason: np.ndarray  # int8 Unresolved code, RESOLVED (-1) where it succeeded

    @property
    def mapped(self) -> np.ndarray:
        """In a file-backed mapping or the vDSO: where an unwinder may go on."""
        return self.reason != Unresolved.NO_MAPPING


class Normalizer:
    """Normalizes addresses of the processes an artifact's mappings describe, opening
    each module (through the ModuleStore) the first time an address lands in it."""

    def __init__(self, mappings: pa.Table, store: ModuleStore) -> None:
        self.spaces = AddressSpaces(mappings)
        self.store = store
        self.modules: list[Module | None] = []  # by module index; None: unusable
        # -2: unseen; one more entry, so that an index of no build id (-1, read as 0
        # before it is masked) is in bounds when there is none
        self._index = np.full(len(self.spaces.bid_values) + 1, -2, dtype=np.int64)
        self._why: list[int] = []  # per module index: NO_MODULE / CORRUPT_ELF / RESOLVED
        self.problems: list[str] = []  # one line per module that could not be used

    def snapshot_of(self, pid: np.ndarray, ts: np.ndarray) -> np.ndarray:
        return self.spaces.snapshot_of(pid, ts)

    def _modules_of(self, row: np.ndarray) -> np.ndarray:
        """Module index of each mapping row (-1: no row or no build id)."""
        out = np.full(len(row), -1, dtype=np.int64)
        ok = row >= 0
        bi = self.spaces.bid_index[row[ok]]
        for b in np.unique(bi[(bi >= 0) & (self._index[np.maximum(bi, 0)] == -2)]).tolist():
            self._index[b] = len(self.modules)
            self.modules.append(self._open(self.spaces.bid_values[b], self.spaces.bid_path[b]))
        out[ok] = np.where(bi >= 0, self._index[np.maximum(bi, 0)], -1)
        return out

    def _open(self, build_id: str, path: str | None) -> Module | None:
        mod = self.store.get(build_id, path)
        if mod is None:
            self._why.append(Unresolved.NO_MODULE)
            self.problems.append(f"module {build_id} ({path}) is not available")
            return None
        try:
            mod.segments  # noqa: B018 - read the program headers now, once
        except ModuleError as e:
            self._why.append(Unresolved.CORRUPT_ELF)
            self.problems.append(str(e))
            return None
        self._why.append(RESOLVED)
        return mod

    def normalize(self, snap: np.ndarray, addr: np.ndarray) -> Normalized:
        """Normalize each address in its snapshot (AddressSpaces.snapshot_of)."""
        addr = np.asarray(addr, dtype=np.uint64)
        sp = self.spaces
        row = sp.find(snap, addr)
        mod = self._modules_of(row)
        vaddr = np.full(len(addr), -1, dtype=np.int64)
        reason = np.full(len(addr), Unresolved.NO_MAPPING, dtype=np.int8)
        has = row >= 0
        mapped = np.zeros(len(addr), dtype=bool)
        mapped[has] = sp.file_backed[row[has]] | sp.is_vdso[row[has]]
        reason[mapped] = Unresolved.NO_BUILD_ID
        why = np.array(self._why, dtype=np.int8)
        known = mapped & (mod >= 0)
        reason[known] = why[mod[known]] if len(why) else RESOLVED
        foff = sp.file_offset(row, addr)
        for m in np.unique(mod[known & (reason == RESOLVED)]).tolist():
            module = self.modules[m]
            assert module is not None
            sel = np.flatnonzero((mod == m) & known)
            vaddr[sel] = module.file_offset_to_vaddr(foff[sel])
        reason[known & (reason == RESOLVED) & (vaddr < 0)] = Unresolved.NO_SEGMENT
        mod[~mapped] = -1
        return Normalized(row, mod, vaddr, reason)
