"""ModuleStore / Module: artifact lookup, host lookup with build-id check, vDSO, debug
files, file offset -> ELF vaddr."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import build
from support.procfs import vdso_bytes

from memtrack.addrspace.modules import ModuleError, ModuleStore
from memtrack.elf import build_id_of_bytes, read_build_id
from memtrack.schema.artifact import ArtifactWriter
from memtrack.schema.manifest import Host

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")


def _artifact(tmp_path: Path) -> tuple[Path, ArtifactWriter]:
    w = ArtifactWriter(tmp_path / "run.memtrack")
    return w.path, w


def test_artifact_module_found_with_debug_file(tmp_path: Path) -> None:
    exe = build(["symbolize/inl.cc"], flags=("-O2", "-g"), name="inl")
    stripped = tmp_path / "inl.stripped"
    shutil.copyfile(exe, stripped)
    import subprocess

    subprocess.run(["strip", "--strip-debug", str(stripped)], check=True)
    bid = read_build_id(exe)
    assert bid
    path, w = _artifact(tmp_path)
    w.add_module(bid, "/opt/app/inl", stripped, debug_file=exe)
    w.close()
    store = ModuleStore(path)
    mod = store.get(bid)
    assert mod is not None
    assert mod.path == "/opt/app/inl"
    assert mod.elf_path == path / "modules" / bid / "inl"
    assert mod.debug_path == path / "modules" / bid / "inl.debug"
    assert not mod.is_vdso
    # only in the artifact: the mapped path does not exist here
    assert not Path("/opt/app/inl").exists()
    assert store.get("00" * 20, "/opt/app/inl") is None


def test_host_modules_checks_build_id(tmp_path: Path) -> None:
    bid = read_build_id(LIBC)
    assert bid
    assert ModuleStore(None).get(bid, str(LIBC)) is None  # host lookups are opt-in
    store = ModuleStore(None, host_modules=True)
    mod = store.get(bid, str(LIBC))
    assert mod is not None and mod.elf_path == LIBC
    assert mod.debug_path is not None
    assert read_build_id(mod.debug_path) == bid
    assert store.get("ab" * 20, str(LIBC)) is None
    assert any("build id differs" in p for p in store.problems)


def test_host_modules_read_only_regular_files(tmp_path: Path) -> None:
    """A FIFO, a device, a directory or a relative path at a mapping's path is refused
    without blocking or reading it; a symlink to the right file is that file."""
    bid = read_build_id(LIBC)
    assert bid
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened for reading, it would block until a writer came
    link = tmp_path / "libc.so.6"
    link.symlink_to(LIBC)
    store = ModuleStore(None, host_modules=True)
    for path in (fifo, "/dev/zero", tmp_path, "libc.so.6", tmp_path / "missing"):
        assert store.get(bid, str(path)) is None
    assert sum("not a regular file" in p for p in store.problems) == 3
    mod = store.get(bid, str(link))
    assert mod is not None and mod.elf_path == link


def test_captured_here() -> None:
    here = Host.current()
    assert here.machine_id and here.boot_id
    assert here.captured_here()
    assert not dataclasses.replace(here, boot_id="0" * 36).captured_here()  # rebooted
    assert not dataclasses.replace(here, machine_id="0" * 32).captured_here()  # elsewhere
    assert not Host().captured_here()  # an artifact from before format 2.4: unknown


def test_vdso_from_artifact(tmp_path: Path) -> None:
    data = vdso_bytes()
    bid = build_id_of_bytes(data)
    assert bid
    src = tmp_path / "vdso.bin"
    src.write_bytes(data)
    path, w = _artifact(tmp_path)
    w.add_module(bid, "[vdso]", src)
    w.close()
    store = ModuleStore(path, host_modules=True)
    mod = store.get(bid, "[vdso]")
    assert mod is not None and mod.is_vdso
    assert ModuleStore(None, host_modules=True).get(bid, "[vdso]") is None


def _readelf_loads(path: Path) -> list[tuple[int, int, int]]:
    import subprocess

    out = subprocess.run(["readelf", "-lW", str(path)], check=True, capture_output=True,
                         text=True).stdout
    rows = []
    for m in re.finditer(r"^\s+LOAD\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+0x[0-9a-f]+\s+"
                         r"(0x[0-9a-f]+)", out, re.M):
        rows.append((int(m[1], 16), int(m[2], 16), int(m[3], 16)))
    return rows


@pytest.mark.parametrize("path", [LIBC, Path("/usr/bin/python3.11")])
def test_file_offset_to_vaddr_matches_readelf(path: Path) -> None:
    store = ModuleStore(None)
    mod = store.add_file(path)
    loads = _readelf_loads(path)
    assert len(loads) >= 2
    offs, want = [], []
    for off, vaddr, filesz in loads:
        for d in (0, 1, filesz // 2, filesz - 1):
            offs.append(off + d)
            want.append(vaddr + d)
    got = mod.file_offset_to_vaddr(np.array(offs, dtype=np.uint64))
    assert got.tolist() == want
    end = max(o + f for o, _, f in loads)
    assert mod.file_offset_to_vaddr(np.array([end + 4096], dtype=np.uint64)).tolist() == [-1]
    # runtime address -> vaddr through a mapping (libc's text mapping at some base)
    off, vaddr, _ = loads[1]
    base = 0x7F0000000000
    rt = np.array([base + 0x10, base + 0x20], dtype=np.uint64)
    assert mod.runtime_to_vaddr(rt, base, off).tolist() == [vaddr + 0x10, vaddr + 0x20]


def test_bad_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + b"\0" * 10)
    with pytest.raises(ModuleError, match="junk.so"):
        ModuleStore(None).add_file(junk)
    path, w = _artifact(tmp_path)
    d = w.module_dir("cafe")
    d.mkdir()
    (d / "module.json").write_text(json.dumps({"build_id": "cafe", "path": "/x", "file": "gone"}))
    w.close()
    store = ModuleStore(path)
    assert store.get("cafe") is None
    assert any("missing" in p for p in store.problems)


def test_gnu_debuglink_debug_file_next_to_module(tmp_path: Path) -> None:
    import subprocess

    exe = build(["symbolize/inl.cc"], flags=("-O2", "-g"), name="inl")
    bid = read_build_id(exe)
    app = tmp_path / "app"
    dbg = tmp_path / "app.debug"
    subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(dbg)], check=True)
    subprocess.run(["objcopy", "--strip-debug", f"--add-gnu-debuglink={dbg}", str(exe), str(app)],
                   check=True)
    store = ModuleStore(None, host_modules=True)
    mod = store.get(str(bid), str(app))
    assert mod is not None and mod.debug_path == dbg
    # a debug file whose CRC does not match the link is not used
    dbg.write_bytes(dbg.read_bytes() + b"\0")
    assert ModuleStore(None, host_modules=True).get(str(bid), str(app)).debug_path is None  # type: ignore[union-attr]


def test_host_modules_symbolize_by_build_id_and_path() -> None:
    import pyarrow as pa

    from memtrack.symbolize import symbolize

    bid = read_build_id(LIBC)
    out = subprocess_nm_malloc()
    t = symbolize(ModuleStore(None, host_modules=True), pa.array([bid]),
                  np.array([out], dtype=np.uint64), paths=pa.array([str(LIBC)]))
    assert t.column("function").to_pylist()[-1] == "__libc_malloc"  # as llvm-symbolizer says
    assert t.column("file").to_pylist()[-1] == "./malloc/malloc.c"


def subprocess_nm_malloc() -> int:
    import subprocess

    out = subprocess.run(["nm", "-D", str(LIBC)], check=True, capture_output=True,
                         text=True).stdout
    return next(int(ln.split()[0], 16) for ln in out.splitlines()
                if ln.split()[-1].split("@")[0] == "malloc")
