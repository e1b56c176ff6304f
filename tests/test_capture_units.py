"""Capture pieces on their own: module classification, the bulk ring reader (wrap-around,
exact record sequence), /proc parsing."""

from __future__ import annotations

import ctypes as ct
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import build

from memtrack.capture.allocators import classify, probes_for, pymalloc_refusal, read_elf
from memtrack.capture.procfs import parse_maps
from memtrack.elf.image import ElfReadError
from memtrack.schema import Allocator, EventKind

LIB = Path("/usr/lib/x86_64-linux-gnu")


@pytest.mark.parametrize(("path", "family"), [
    (LIB / "libc.so.6", Allocator.LIBC),
    (LIB / "libstdc++.so.6", Allocator.CXX),
    (LIB / "libjemalloc.so.2", Allocator.JEMALLOC),
    (LIB / "libmimalloc.so.2", Allocator.MIMALLOC),
    (LIB / "libtcmalloc_minimal.so.4", Allocator.TCMALLOC),
    (LIB / "libm.so.6", None),
])
def test_classify_system_libraries(path: Path, family: Allocator | None) -> None:
    assert classify(read_elf(path)) == family


def test_libc_probes_and_aliases() -> None:
    probes = {p.name: p for p in probes_for(read_elf(LIB / "libc.so.6"))}
    # aligned_alloc and memalign are one function in glibc: probed once
    assert {"malloc", "calloc", "realloc", "free", "posix_memalign", "valloc"} <= set(probes)
    assert len({p.vaddr for p in probes.values()}) == len(probes)
    assert ("aligned_alloc" in probes) != ("memalign" in probes)
    assert probes["malloc"].program == "mt_alloc"
    assert probes["free"].program == "mt_free" and probes["free"].is_free
    assert probes["posix_memalign"].shape == "posixmemalign"
    # the cookie tells alloc.c the kind, the family and where the arguments are
    # (and, for malloc, that an unprobed wrapper may have called it: bit 26)
    assert probes["malloc"].cookie == (EventKind.MALLOC | Allocator.LIBC << 8 | 1 << 16
                                       | 1 << 26)
    assert probes["calloc"].cookie == (EventKind.CALLOC | Allocator.LIBC << 8 | 1 << 16
                                       | 2 << 18)
    assert probes["realloc"].cookie == (EventKind.REALLOC | Allocator.LIBC << 8 | 2 << 16
                                        | 1 << 20)
    assert probes["posix_memalign"].cookie == 100 | Allocator.LIBC << 8 | 3 << 16 | 1 << 22
    # a free's pointer: the "old" selector (its first argument)
    assert probes["free"].cookie == EventKind.FREE | Allocator.LIBC << 8 | 1 << 20


LIBPYTHON311 = Path.home() / ".pyenv/versions/3.11.7/lib/libpython3.11.so.1.0"


def test_pymalloc_probes() -> None:
    """CPython's object allocator (--python-allocators on): the functions its tables
    point to, whose first argument is the table's ctx; none unless asked for."""
    if not LIBPYTHON311.exists():
        pytest.skip(f"no {LIBPYTHON311} here")
    info = read_elf(LIBPYTHON311)
    assert probes_for(info) == []
    assert pymalloc_refusal(LIBPYTHON311, info) is None
    probes = {p.name: p for p in probes_for(info, python_allocators=True)}
    assert set(probes) == {"_PyObject_Malloc", "_PyObject_Calloc", "_PyObject_Realloc",
                           "_PyObject_Free"}
    assert {p.family for p in probes.values()} == {Allocator.PYMALLOC}
    py = Allocator.PYMALLOC << 8
    assert probes["_PyObject_Malloc"].cookie == EventKind.MALLOC | py | 2 << 16
    assert probes["_PyObject_Calloc"].cookie == EventKind.CALLOC | py | 2 << 16 | 3 << 18
    assert probes["_PyObject_Realloc"].cookie == EventKind.REALLOC | py | 3 << 16 | 2 << 20
    assert probes["_PyObject_Free"].cookie == EventKind.FREE | py | 2 << 20
    assert probes["_PyObject_Free"].program == "mt_free"


def test_pymalloc_stripped_is_refused(tmp_path: Path) -> None:
    """A stripped libpython keeps its exported PyObject_Malloc, not the local functions
    its tables point to: refused, by name."""
    if not LIBPYTHON311.exists():
        pytest.skip(f"no {LIBPYTHON311} here")
    lib = tmp_path / LIBPYTHON311.name
    subprocess.run(["strip", "--strip-all", "-o", str(lib), str(LIBPYTHON311)], check=True)
    info = read_elf(lib)
    assert "PyObject_Malloc" in info.functions and "_PyObject_Malloc" not in info.functions
    assert pymalloc_refusal(lib, info) == ("no symbols of its object allocator "
                                           "(_PyObject_Malloc ...: a stripped build, or one "
                                           "without pymalloc)")


def test_pymalloc_inlined_is_refused() -> None:
    """Debian's python3.11 (LTO, PGO) inlines _PyObject_Malloc where the table's
    function is compared with it: refused, and its symbols are stripped anyway."""
    exe = Path("/usr/bin/python3.11")
    if not exe.exists():
        pytest.skip(f"no {exe} here")
    info = read_elf(exe)
    why = pymalloc_refusal(exe, info)
    assert why is not None and why.startswith("PyObject_Malloc compares the allocator table")
    assert probes_for(info, python_allocators=True) == []
    assert pymalloc_refusal(LIB / "libc.so.6", read_elf(LIB / "libc.so.6")) is None


@pytest.mark.bpf
def test_file_offsets_agree_with_bcc() -> None:
    from bcc import BPF

    probes = {p.name: p for p in probes_for(read_elf(LIB / "libc.so.6"))}
    for name in ("malloc", "free", "posix_memalign"):
        _, off = BPF._check_path_symbol(b"c", name.encode(), None, -1, 0)
        assert probes[name].file_offset == off


def test_tcmalloc_alias_of_malloc_probed_once() -> None:
    probes = probes_for(read_elf(LIB / "libtcmalloc_minimal.so.4"))
    names = {p.name for p in probes}
    assert "malloc" in names and "tc_malloc" not in names  # same address
    assert {"_Znwm", "_ZdlPvm"} <= names


def test_static_allocator_found_in_symtab() -> None:
    exe = build(["capture/cxx.cc"], name="cxx-jemalloc-static",
                libs=(str(LIB / "libjemalloc.a"), "-lpthread", "-ldl", "-lm"))
    info = read_elf(exe)
    assert classify(info) == Allocator.JEMALLOC
    assert {"malloc", "mallocx", "_Znwm", "_ZdaPv"} <= {p.name for p in probes_for(info)}


def test_not_an_elf(tmp_path: Path) -> None:
    p = tmp_path / "x"
    p.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ElfReadError, match="not a readable ELF file .Magic number"):
        read_elf(p)
    p.write_bytes(b"\x7fELF\x02\x01" + b"\0" * 10)
    with pytest.raises(ElfReadError, match="not a readable ELF file"):
        read_elf(p)


def test_parse_maps() -> None:
    text = ("55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 123 /usr/bin/x\n"
            "7ffd1c3f0000-7ffd1c3f2000 r-xp 00000000 00:00 0                  [vdso]\n"
            "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n")
    m = parse_maps(text)
    assert [(x.start, x.perms, x.dev, x.inode, x.path) for x in m] == [
        (0x55D0C0A00000, "r--p", "fd:01", 123, "/usr/bin/x"),
        (0x7FFD1C3F0000, "r-xp", "00:00", 0, "[vdso]"),
        (0x7F0000000000, "rw-p", "00:00", 0, ""),
    ]


RING_PROG = r"""
BPF_RINGBUF_OUTPUT(ring, 1);
BPF_ARRAY(seq, u64, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if ((bpf_get_current_pid_tgid() >> 32) != MT_PID) return 0;
    int k = 0;
    u64 *s = seq.lookup(&k);
    if (!s) return 0;
    for (int i = 0; i < 20; i++) {
        u64 *e = ring.ringbuf_reserve(24);
        if (!e) return 0;
        e[0] = *s; e[1] = ~*s; e[2] = 7;
        *s += 1;
        ring.ringbuf_submit(e, 0);
    }
    return 0;
}
"""


@pytest.mark.bpf
def test_ring_reader_wraps_and_keeps_order() -> None:
    from bcc import BPF

    from memtrack.capture.ringbuf import RingReader

    dt = np.dtype([("seq", "<u8"), ("inv", "<u8"), ("seven", "<u8")])
    b = BPF(text=RING_PROG, cflags=[f"-DMT_PID={os.getpid()}"])
    try:
        reader = RingReader(b, "ring")
        assert reader.size == 4096
        getppid = ct.CDLL(None).getppid
        got = []
        for _ in range(50):  # 1000 records of 32 B through a 4 KiB ring: many wraps
            getppid()
            got.append(reader.read_fixed(dt))
            assert reader.pending() == 0
        rec = np.concatenate(got)
        assert rec["seq"].tolist() == list(range(1000))
        assert (rec["inv"] == ~rec["seq"]).all() and (rec["seven"] == 7).all()
        getppid()
        raw = reader.read_records()
        assert len(raw) == 20 and all(len(r) == 24 for r in raw)
        assert np.frombuffer(b"".join(raw), dtype=dt)["seq"].tolist() == list(range(1000, 1020))
        reader.close()
    finally:
        b.cleanup()


def test_every_shape_has_a_cookie_and_an_argument_count() -> None:
    import re

    from memtrack.capture import allocators as al

    src = (Path(__file__).resolve().parent.parent / "memtrack" / "bpf" / "alloc.c").read_text()
    assert {"mt_alloc", "mt_ret", "mt_free"} <= set(re.findall(r"^int (mt_\w+)\(", src, re.M))
    defines = {k: int(v) for k, v in re.findall(r"#define (MT_(?:CK|K)_\w+) (\d+)", src)}
    assert defines == {
        "MT_K_POSIX_MEMALIGN": al.KIND_POSIX_MEMALIGN, "MT_K_MALLOCX": al.KIND_MALLOCX,
        "MT_CK_ALLOCATOR": al.CK_ALLOCATOR, "MT_CK_SIZE": al.CK_SIZE, "MT_CK_MUL": al.CK_MUL,
        "MT_CK_OLD": al.CK_OLD, "MT_CK_OUTP": al.CK_OUTP, "MT_CK_FLAGS": al.CK_FLAGS,
        "MT_CK_WRAPPABLE": al.CK_WRAPPABLE}
    shapes = {*al.LIBC_NAMES.values(), *al.CXX_NAMES.values(), *al.JEMALLOC_NAMES.values(),
              *al.MIMALLOC_NAMES.values(), *al.TCMALLOC_NAMES.values(),
              *al.PYMALLOC_NAMES.values()}
    assert shapes <= set(al.SHAPES) and shapes <= set(al.SHAPE_ARG_REGS)
    for name, shape in al.SHAPES.items():
        assert ("free" in name) == (shape.kind == EventKind.FREE), name
        assert shape.kind != EventKind.FREE or shape.old, name  # the pointer freed
        # every argument selector fits its two bits, every field its place
        assert all(0 <= a <= 3 for a in (shape.size, shape.mul, shape.old, shape.outp,
                                         shape.flags)), name
        assert shape.cookie(Allocator.OTHER) >> al.CK_ALLOCATOR & 0xFF == Allocator.OTHER


def test_ring_records_read_in_bulk_are_copies_even_one_at_a_time() -> None:
    """A lone record's body is contiguous in the ring: the array handed out must still
    be a copy, or the producers' next records would overwrite it."""
    from memtrack.capture.ringbuf import _gather

    ring = np.arange(256, dtype=np.uint8)
    for n, stride, rec in ((1, 32, 24), (3, 32, 24), (1, 16, 5), (2, 16, 5)):
        out = _gather(ring[:n * stride], n, stride, rec)
        assert not np.shares_memory(out, ring)
        assert out.view(np.uint8).reshape(n, -1)[:, :rec].tolist() == [
            ring[i * stride + 8:i * stride + 8 + rec].tolist() for i in range(n)]


def test_cut_copies_are_noted_not_lost() -> None:
    from memtrack.capture.run import summary
    from memtrack.capture.tracker import CaptureResult

    result = CaptureResult(artifact=Path("x.memtrack"), pid=1, exit_code=0, signal=None,
                           events=10, losses={"stack_copies_cut": 5, "events_ring_full": 2,
                                              "stacks_ring_full": 0}, duration_s=1.0)
    assert result.nonzero_losses() == {"events_ring_full": 2}
    lines = summary(result, ["./prog"])
    assert "memtrack: LOST events_ring_full = 2" in lines
    assert any(line.startswith("memtrack: note: stack_copies_cut = 5 (allocations whose "
                               "stack went on beyond --stack-budget") for line in lines)
    assert not any("LOST stack_copies_cut" in line for line in lines)
