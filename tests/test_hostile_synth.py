"""Hostile artifacts without a capture (issue 32): the small synthetic artifact (real
module copies: python3.11, libc with its debug file, libstdc++, libsqlite3) damaged as
the measured failures were, and every reading command run on it through the command
line under tests/test_hostile.py's harness (an audit hook names every file opened
outside the artifact): `info`, `process` with its default host modules, `report` as
text and `--html`, `export`, `diff` and `unwind`. Each exits 0 or 2 with one line,
within the harness's time and memory limits; a module copy that is refused falls back
to no host file for a run captured elsewhere (the synthetic one's manifest names no
host), and to a regular file only for one captured here. A fork/exec storm's report is
bounded too."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support.hostile import _section_size, module_info, read_table, reseal, write_table
from support.page import browsing, page_data
from support.synth import write_storm
from test_hostile import ROOT, check, memtrack

from memtrack.schema.manifest import Host

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def module_dir(art: Path, mapped: str) -> Path:
    """The module copy of what was mapped from `mapped`."""
    for d in (art / "modules").iterdir():
        if module_info(d)["path"] == mapped:
            return d
    raise AssertionError(f"no copy of {mapped}")


def map_libc_to(art: Path, path: str) -> None:
    """Every mapping of libc now says it was mapped from `path`."""
    t = read_table(art, "mappings")
    col = t.column("path")
    new = pc.if_else(pc.equal(col, LIBC), pa.scalar(path), col)
    write_table(art, "mappings", t.set_column(t.schema.get_field_index("path"), "path", new))


def refuse_copy(art: Path) -> None:
    (module_dir(art, LIBC) / "module.json").write_text("{")


def _fifo(art: Path, outside: Path) -> None:
    os.mkfifo(outside / "fifo")  # read, it blocks until a writer comes: none will
    map_libc_to(art, str(outside / "fifo"))


def _wrong_build_id(art: Path, outside: Path) -> None:
    d = module_dir(art, LIBC)
    shutil.copyfile(module_dir(art, "/usr/bin/python3.11") / "python3.11", d / "libc.so.6")
    map_libc_to(art, str(outside / "libc.so.6"))


def _symlink_out(art: Path, outside: Path) -> None:
    d = module_dir(art, LIBC)
    (d / "libc.so.6").unlink()
    (d / "libc.so.6").symlink_to(outside / "libc.so.6")
    map_libc_to(art, str(outside / "libc.so.6"))


def _stacks_field_name(art: Path, outside: Path) -> None:
    f = art / "stacks.arrow"
    data = bytearray(f.read_bytes())
    data[data.index(b"copy_len")] = 0xFF  # one flipped byte: a name that is not UTF-8
    f.write_bytes(bytes(data))


def _debug_section(name: str) -> Callable[[Path, Path], None]:
    def damage(art: Path, outside: Path) -> None:
        _section_size(module_dir(art, LIBC) / "libc.so.6.debug", name, 1 << 40)
    return damage


def _segment_size(art: Path, outside: Path) -> None:
    """libc's executable PT_LOAD says it holds 2^40 bytes of the file (p_filesz)."""
    elf = module_dir(art, LIBC) / "libc.so.6"
    data = bytearray(elf.read_bytes())
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for h in range(phoff, phoff + phnum * phentsize, phentsize):
        kind, flags = struct.unpack_from("<II", data, h)
        if kind == 1 and flags & 1:  # PT_LOAD, PF_X
            struct.pack_into("<Q", data, h + 0x20, 1 << 40)
    elf.write_bytes(bytes(data))


def _note_size(art: Path, outside: Path) -> None:
    """libc's build-id note says its descriptor holds 2 GiB (n_descsz)."""
    d = module_dir(art, LIBC)
    elf = d / "libc.so.6"
    data = bytearray(elf.read_bytes())
    at = data.index(b"GNU\0" + bytes.fromhex(d.name)) - 12
    struct.pack_into("<I", data, at + 4, 0x7FFF_FFF0)
    elf.write_bytes(bytes(data))


CASES: dict[str, Callable[[Path, Path], None]] = {
    # a copy refused or missing: process fell back to the mapping's host path
    "copy-refused-etc-shadow": lambda a, o: (refuse_copy(a), map_libc_to(a, "/etc/shadow")),
    "copy-refused-etc-passwd": lambda a, o: (refuse_copy(a), map_libc_to(a, "/etc/passwd")),
    "copy-missing-host-libc": lambda a, o: shutil.rmtree(module_dir(a, LIBC)),
    "copy-refused-fifo": lambda a, o: (refuse_copy(a), _fifo(a, o)),
    "copy-refused-dev-zero": lambda a, o: (refuse_copy(a), map_libc_to(a, "/dev/zero")),
    "copy-wrong-build-id-other-artifact": _wrong_build_id,
    "copy-symlink-out-other-artifact": _symlink_out,
    "copy-refused-relative-path": lambda a, o: (refuse_copy(a), map_libc_to(a, "libc.so.6")),
    # sizes and bytes that were tracebacks
    "debug-info-2^40": _debug_section(".debug_info"),
    "debug-line-2^40": _debug_section(".debug_line"),
    "debug-strtab-2^40": _debug_section(".strtab"),
    "libc-segment-2^40": _segment_size,
    "libc-build-id-note-2^31": _note_size,
    "stacks-field-name-not-utf8": _stacks_field_name,
}


def damaged(small_synth: Path, tmp_path: Path, damage: Callable[[Path, Path], None]
            ) -> tuple[Path, Path]:
    art = tmp_path / "run.memtrack"
    shutil.copytree(small_synth, art, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copyfile(LIBC, outside / "libc.so.6")  # another artifact's libc: the same build id
    damage(art, outside)
    reseal(art)
    return art, outside


def first_hash(art: Path) -> str:
    return str(read_table(art, "stacks").column("hash")[0].as_py())


@pytest.mark.parametrize("name", CASES)
def test_hostile_synthetic_artifact(small_synth: Path, tmp_path: Path, name: str) -> None:
    art, outside = damaged(small_synth, tmp_path, CASES[name])
    record = first_hash(small_synth)
    out = tmp_path / "out"
    out.mkdir()
    db = out / "run.duckdb"  # unwind keeps its CFI cache under $XDG_CACHE_HOME (xdg)
    results, bad = memtrack(
        tmp_path, ["info", str(art)], ["unwind", str(art), "--record", record],
        ["process", str(art), "-o", str(db), "--cache", "off"],
        ["?", "report", str(db)], ["?", "report", str(db), "--html", str(out / "r.html")],
        ["?", "export", str(db), "--format", "folded", "-o", str(out / "r.folded")],
        ["?", "diff", str(db), str(db)], read=[art, out], write=[out, tmp_path / "xdg"])
    said = [check(r, bad, " ".join(r.args[:1])) for r in results if r is not None]
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        ["libc.so.6", *(["fifo"] if "fifo" in name else [])])
    proc = results[2]
    assert proc is not None
    if name != "stacks-field-name-not-utf8":
        assert proc.returncode == 0 and "note: host modules off" in said[2], said[2]
        assert all(r is not None and r.returncode == 0 for r in results[3:]), said
    else:
        assert proc.returncode == 2 and "not UTF-8" in said[2], said[2]


def test_captured_here_reads_only_regular_host_files(small_synth: Path,
                                                     tmp_path: Path) -> None:
    """A run captured on this machine uses host modules by default, but a FIFO or a
    device at a mapping's path is refused from its fstat (never opened for reading: it
    would block) and a file of another build id is named, not used."""
    art, outside = damaged(small_synth, tmp_path, CASES["copy-refused-fifo"])
    m = json.loads((art / "manifest.json").read_text())
    here = Host.current()
    m["host"].update(machine_id=here.machine_id, boot_id=here.boot_id)
    (art / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "out"
    out.mkdir()
    (r,), bad = memtrack(tmp_path, ["process", str(art), "-o", str(out / "r.duckdb"),
                                    "--cache", "off"], read=[art, out, outside], write=[out])
    said = check(r, bad, "process")
    assert r.returncode == 0 and "fifo: not a regular file" in said, said
    assert "host modules off" not in said


def test_fork_exec_storm_report_is_bounded(tmp_path: Path) -> None:
    """5,000 processes forked and exec'd: the text report and the page each take a few
    seconds, and the page embeds 200 processes and 20 timelines, and says so."""
    art = write_storm(tmp_path / "storm.memtrack", 5000)
    db, page = tmp_path / "storm.duckdb", tmp_path / "storm.html"
    run = [sys.executable, "-m", "memtrack.cli"]
    subprocess.run([*run, "process", str(art), "-o", str(db), "--quiet", "--cache", "off"],
                   check=True, cwd=ROOT, timeout=120)
    for cmd in (["report", str(db)], ["report", str(db), "--html", str(page)]):
        t0 = time.perf_counter()
        r = subprocess.run([*run, *cmd], capture_output=True, text=True, cwd=ROOT,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert time.perf_counter() - t0 < 20, cmd
        assert "(4981 more with fewer calls" in r.stdout
    blob = page_data(page)
    assert len(blob["report"]["processes"]) == 200 and blob["processes_total"] == 5001
    assert len(blob["timelines"]) == 20
    assert {n[0] for n in blob["flame"]["calls"] if n[2] == 1} >= {"other processes"}
    assert page.stat().st_size < 1 << 20
    with browsing(page) as b:
        assert b.eval("document.querySelectorAll('#timeline svg').length") == 20
        assert "4801 more processes" in b.eval("document.getElementById('tables').textContent")
