"""Normalization: address spaces from mapping snapshots (which snapshot holds a record,
vectorized address lookups, the next-snapshot fallback, file offsets) and the reason
of every address that does not reach a module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.addrspace.modules import Module, ModuleStore
from memtrack.addrspace.normalize import RESOLVED, AddressSpaces, Normalizer
from memtrack.elf import read_build_id
from memtrack.schema import MAPPINGS
from memtrack.schema.enums import Unresolved


def _maps(rows: list[tuple[int, int, int, int, int, str, str | None]]) -> pa.Table:
    return pa.Table.from_pylist([
        {"ts": ts, "pid": pid, "start": s, "end": e, "offset": off, "perms": "r-xp",
         "dev": "fd:01", "inode": 1, "path": path, "build_id": bid}
        for ts, pid, s, e, off, path, bid in rows], schema=MAPPINGS)


MAPS = _maps([
    # pid 10: snapshot at t=100, then at t=200 after a dlopen and an exec-like change
    (100, 10, 0x1000, 0x3000, 0x0, "/bin/prog", "aa"),
    (100, 10, 0x7000, 0x8000, 0x2000, "/lib/libc.so", "cc"),
    (100, 10, 0x9000, 0xA000, 0, "[stack]", None),
    (100, 10, 0xB000, 0xC000, 0, "[vdso]", "dd"),
    (200, 10, 0x1000, 0x3000, 0x0, "/bin/prog", "aa"),
    (200, 10, 0x5000, 0x6000, 0x1000, "/lib/plugin.so", "pp"),
    (200, 10, 0x7000, 0x8000, 0x2000, "/lib/libc.so", "cc"),
    # pid 11: its own space at the same addresses
    (150, 11, 0x1000, 0x2000, 0x4000, "/bin/other", "bb"),
])


def test_snapshot_of_record() -> None:
    sp = AddressSpaces(MAPS)
    assert len(sp) == 3
    snap = sp.snapshot_of(np.array([10, 10, 10, 10, 11, 12]),
                          np.array([50, 100, 199, 500, 10, 100]))
    assert snap.tolist() == [0, 0, 0, 1, 2, -1]  # before the first: the first


def test_find_and_file_offset() -> None:
    sp = AddressSpaces(MAPS)
    snap = np.array([0, 0, 0, 1, 2, 0, -1, 0])
    addr = np.array([0x1234, 0x7010, 0x2FFF, 0x5008, 0x1800, 0x3000, 0x1234, 0xFFFF],
                    dtype=np.uint64)
    row = sp.find(snap, addr)
    paths = sp.paths(row).to_pylist()
    assert paths == ["/bin/prog", "/lib/libc.so", "/bin/prog", "/lib/plugin.so",
                     "/bin/other", None, None, None]
    assert sp.build_ids(row).to_pylist() == ["aa", "cc", "aa", "pp", "bb", None, None, None]
    ok = row >= 0
    assert sp.file_offset(row[ok], addr[ok]).tolist() == [0x234, 0x2010, 0x1FFF, 0x1008,
                                                          0x4800]


def test_address_mapped_after_the_snapshot_found_in_the_next() -> None:
    sp = AddressSpaces(MAPS)
    row = sp.find(np.array([0]), np.array([0x5010], dtype=np.uint64))
    assert sp.paths(row).to_pylist() == ["/lib/plugin.so"]


def test_kinds_of_mappings() -> None:
    sp = AddressSpaces(MAPS)
    row = sp.find(np.zeros(3, dtype=np.int64), np.array([0x1000, 0x9000, 0xB000], np.uint64))
    assert sp.file_backed[row].tolist() == [True, False, False]
    assert sp.is_vdso[row].tolist() == [False, False, True]


def test_empty() -> None:
    sp = AddressSpaces(MAPPINGS.empty_table())
    assert sp.snapshot_of(np.array([1]), np.array([1])).tolist() == [-1]
    assert sp.find(np.array([-1]), np.array([5], np.uint64)).tolist() == [-1]


def test_normalizer_says_why_an_address_has_no_module(tmp_path: Path) -> None:
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    bid = read_build_id(libc)
    seg = ModuleStore(None).add_file(libc).segments
    text = int(np.flatnonzero(seg.executable)[0])
    t_off, t_va = int(seg.offset[text]), int(seg.vaddr[text])
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + b"\xff" * 60)
    maps = _maps([
        (1, 10, 0x10000, 0x20000, t_off, str(libc), bid),  # libc's text
        (1, 10, 0x30000, 0x31000, 0x7FFF0000, str(libc), bid),  # beyond libc's segments
        (1, 10, 0x40000, 0x41000, 0, "/data/file", None),  # a file without a build id
        (1, 10, 0x50000, 0x51000, 0, "", None),  # anonymous
        (1, 10, 0x60000, 0x61000, 0, "/gone/lib.so", "ee" * 20),  # not on this host
        (1, 10, 0x70000, 0x71000, 0, str(junk), "dd" * 20),  # in the artifact, not an ELF
    ])
    store = ModuleStore(None, host_modules=True)
    store._modules["dd" * 20] = Module("dd" * 20, str(junk), junk)
    norm = Normalizer(maps, store)
    addr = np.array([0x10010, 0x30010, 0x40010, 0x50010, 0x60010, 0x70010, 0x90000],
                    np.uint64)
    got = norm.normalize(norm.snapshot_of(np.full(7, 10), np.full(7, 1)), addr)
    assert got.reason.tolist() == [RESOLVED, Unresolved.NO_SEGMENT, Unresolved.NO_BUILD_ID,
                                   Unresolved.NO_MAPPING, Unresolved.NO_MODULE,
                                   Unresolved.CORRUPT_ELF, Unresolved.NO_MAPPING]
    assert got.vaddr.tolist() == [t_va + 0x10] + [-1] * 6
    assert got.mapped.tolist() == [True, True, True, False, True, True, False]
    assert norm.modules[got.module[0]].elf_path == libc
    assert any("ee" * 20 in p and "not available" in p for p in norm.problems)
    assert any(str(junk) in p for p in norm.problems)
