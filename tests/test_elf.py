"""memtrack.elf against binutils: functions, segments, build ids, debug links and code
as readelf, nm and objdump see them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import build

from memtrack.elf import ElfImage, ElfReadError, find_debug_file, read_build_id

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
LIBSTDCXX = Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
ALLOCATORS = {"malloc", "free", "calloc", "realloc", "posix_memalign", "aligned_alloc",
              "_Znwm", "_ZdlPv", "_ZdlPvm", "__libc_start_main", "no_such_function"}


def nm_functions(path: Path, dynamic: bool) -> dict[str, tuple[int, int]]:
    out = subprocess.run(["nm", "-S", "--defined-only", *(["-D"] if dynamic else []),
                          str(path)], capture_output=True, text=True).stdout
    got: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        m = re.fullmatch(r"([0-9a-f]+) ([0-9a-f]+) [TtWw] (\S+?)(@+\S+)?", line)
        if m and m.group(3) in ALLOCATORS and int(m.group(1), 16):
            got.setdefault(m.group(3), (int(m.group(1), 16), int(m.group(2), 16)))
    return got


@pytest.mark.parametrize("path", [LIBC, LIBSTDCXX], ids=lambda p: p.name)
def test_functions_are_nm_s_definitions(path: Path) -> None:
    with ElfImage(path) as img:
        got = img.functions(ALLOCATORS)
    want = nm_functions(path, dynamic=True)
    assert want and got == want


def test_static_functions_and_code_match_objdump(tmp_path: Path) -> None:
    exe = build(["smoke/count_mallocs.c"], flags=("-O2", "-g", "-static"), name="static-cm")
    with ElfImage(exe) as img:
        got = img.functions(ALLOCATORS)
        code, vaddr = img.function_code("malloc")
        assert img.elf_type == "ET_EXEC"
    assert got == nm_functions(exe, dynamic=False) and "malloc" in got
    assert vaddr == got["malloc"][0] and len(code) == got["malloc"][1]
    dump = subprocess.run(["objdump", "-d", f"--start-address={vaddr:#x}",
                           f"--stop-address={vaddr + 16:#x}", str(exe)],
                          capture_output=True, text=True, check=True).stdout
    hexes = "".join(re.findall(r"^\s+[0-9a-f]+:\s+((?:[0-9a-f]{2} )+)", dump, re.M))
    assert code[:16].hex() == hexes.replace(" ", "")[:32]


def test_build_id_and_debug_file_as_readelf_says() -> None:
    notes = subprocess.run(["readelf", "-n", str(LIBC)], capture_output=True, text=True,
                           check=True).stdout
    want = re.search(r"Build ID: ([0-9a-f]+)", notes).group(1)  # type: ignore[union-attr]
    assert read_build_id(LIBC) == want
    debug = find_debug_file(LIBC)
    assert debug is not None and read_build_id(debug) == want
    with ElfImage(debug) as img:
        assert img.has_dwarf and img.build_id == want
    with ElfImage(LIBC) as img:
        assert not img.has_dwarf


def test_unreadable_files_fail_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.so"
    bad.write_bytes(b"\x7fELF" + b"\0" * 12)
    for path in (bad, tmp_path / "missing"):
        with pytest.raises(ElfReadError) as e:
            ElfImage(path)
        assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
        assert read_build_id(path) is None


@pytest.mark.parametrize("field", [4, 8])  # a note's n_namesz, n_descsz
def test_a_note_size_is_not_a_read(tmp_path: Path, field: int) -> None:
    """A build-id note whose sizes say 4 GiB: no build id, and nothing near that read
    (pyelftools read n_descsz bytes as it stood)."""
    import struct
    import tracemalloc

    bid = read_build_id(LIBC)
    assert bid
    data = bytearray(LIBC.read_bytes())
    struct.pack_into("<I", data, data.index(b"GNU\0" + bytes.fromhex(bid)) - 12 + field - 4,
                     0xFFFF_FFF0)
    bad = tmp_path / "libc.so.6"
    bad.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        assert read_build_id(bad) is None
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
