"""Symbolization against `llvm-symbolizer --inlines` on 2000 random .text addresses of
libc (with libc6-dbg's debug file), libstdc++ (libstdc++6-12-dbg's debug build), the
system python3 (.dynsym only) and a C++ fixture built -O2 -g (DWARF 5, DWARF 4 and
compressed DWARF).

A frame agrees when function, file and line agree. Differences that are only LLVM 14's
way of printing the same answer are normalized, counted and printed:
  - demangler style: our raw symbol demangled by `llvm-cxxfilt` is llvm's name (lambda
    and clone-suffix spelling, `operator<< <T>` spacing);
  - llvm could not demangle: llvm prints the raw symbol we demangled;
  - DWARF 5 directory 0: LLVM 14 (and binutils 2.40 addr2line) prefix a relative
    DW_AT_comp_dir to directory 0, which already is the compilation directory
    (`./iconv/./iconv/gconv_db.c` for glibc's `./iconv/gconv_db.c`).
  - debug-file symbols: where llvm-symbolizer, which reads only the module's own
    symbol table, says `??` and we name the function from the debug file's .symtab,
    `llvm-symbolizer --obj=DEBUG_FILE` must give that same name.
Anything else is a disagreement and is listed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import BUILD_DIR, FIXTURES, build

from memtrack.addrspace.modules import ModuleStore
from memtrack.dwarf.lines import Dwarf
from memtrack.elf import ElfImage
from memtrack.elf.image import SHF_COMPRESSED
from memtrack.symbolize import Symbolizer

N = 2000
LLVM = shutil.which("llvm-symbolizer")
CXXFILT = shutil.which("llvm-cxxfilt")
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
LIBSTDCXX_DBG = Path("/usr/lib/x86_64-linux-gnu/debug/libstdc++.so.6.0.30")
PYTHON = Path("/usr/bin/python3.11")

pytestmark = pytest.mark.skipif(LLVM is None or CXXFILT is None,
                                reason="llvm-symbolizer / llvm-cxxfilt missing (apt llvm)")


def text_addresses(path: Path, n: int, seed: int = 1) -> np.ndarray:
    img = ElfImage(path)
    try:
        t = img.sections[".text"]
        lo, hi = t["sh_addr"], t["sh_addr"] + t["sh_size"]
    finally:
        img.close()
    return np.sort(np.random.default_rng(seed).integers(lo, hi, n, dtype=np.uint64))


def llvm_frames(path: Path, addrs: list[int]) -> list[list[tuple[str, str, int]]]:
    inp = "".join(f"{a:#x}\n" for a in addrs)
    out = subprocess.run([LLVM, "--inlines", f"--obj={path}"], input=inp, capture_output=True,
                         text=True, check=True).stdout  # type: ignore[list-item]
    res = []
    for block in out.strip("\n").split("\n\n"):
        lines = block.split("\n")
        frames = []
        for i in range(0, len(lines), 2):
            file, line, _col = lines[i + 1].rsplit(":", 2)
            frames.append((lines[i], file, int(line)))
        res.append(frames)
    assert len(res) == len(addrs)
    return res


def llvm_demangle(names: list[str]) -> dict[str, str]:
    names = sorted(set(names))
    out = subprocess.run([CXXFILT], input="\n".join(names) + "\n", capture_output=True,
                         text=True, check=True).stdout.split("\n")  # type: ignore[list-item]
    return dict(zip(names, out, strict=False))


@dataclass
class Agreement:
    addresses: int = 0
    addresses_agree: int = 0
    frames: int = 0
    frames_agree: int = 0
    normalized: dict[str, int] = field(default_factory=dict)
    disagreements: list[str] = field(default_factory=list)

    def note(self, kind: str) -> None:
        self.normalized[kind] = self.normalized.get(kind, 0) + 1

    def report(self, name: str) -> str:
        lines = [
            f"{name}: addresses {self.addresses_agree}/{self.addresses} agree "
            f"({100 * self.addresses_agree / self.addresses:.2f} %), frames "
            f"{self.frames_agree}/{self.frames} ({100 * self.frames_agree / self.frames:.2f} %)",
            f"  normalized: {self.normalized or 'none'}",
        ]
        lines.append(f"  disagreements ({len(self.disagreements)}):")
        lines += [f"    {d}" for d in self.disagreements[:10]]
        return "\n".join(lines)


def compare(path: Path, addrs: np.ndarray, store: ModuleStore | None = None,
            build_id: str | None = None) -> Agreement:
    if store is None:
        store = ModuleStore(None)
        build_id = store.add_file(path).build_id
    sym = Symbolizer(store)
    table = sym.symbolize(pa.array([build_id] * len(addrs)), addrs)
    sym.close()
    ref = llvm_frames(path, addrs.tolist())
    ours: list[list[dict]] = [[] for _ in addrs]
    for r in table.to_pylist():
        ours[r["row"]].append(r)
    assert [f["inline_depth"] for fr in ours for f in fr] == [
        d for fr in ours for d in range(len(fr))]
    demangled = llvm_demangle([f["symbol"] for fr in ours for f in fr if f["symbol"]])
    # where llvm has no name for the outermost frame and we do, ask llvm-symbolizer
    # about the debug file, whose .symtab is the one we named it from
    debug = store.get(build_id).debug_path if build_id else None
    unnamed = [i for i, (mine, theirs) in enumerate(zip(ours, ref, strict=True))
               if theirs[-1][0] == "??" and len(mine) == len(theirs)
               and mine[-1]["reason"] is None]
    if debug is not None and unnamed:
        dref = llvm_frames(debug, [int(addrs[i]) for i in unnamed])
        for i, d in zip(unnamed, dref, strict=True):
            if d[-1][0] != "??":
                ref[i] = ref[i][:-1] + [(d[-1][0], ref[i][-1][1], ref[i][-1][2])]
    ag = Agreement(addresses=len(addrs))
    for i, (a, mine, theirs) in enumerate(zip(addrs.tolist(), ours, ref, strict=True)):
        ag.frames += len(theirs)
        ok_frames = 0
        for m, (fn, file, line) in zip(mine, theirs, strict=False):
            name_ok = _name_agrees(m, fn, demangled, ag)
            if name_ok and i in unnamed and m["inline_depth"] == len(mine) - 1:
                ag.note("named from the debug file's .symtab (llvm --obj=DEBUG_FILE agrees)")
            file_ok = _file_agrees(m["file"], file, ag)
            if name_ok and file_ok and m["line"] == line:
                ok_frames += 1
        ag.frames_agree += ok_frames
        desc = f"{a:#x}: ours {[(f['function'][:80], f['file'], f['line']) for f in mine]} " \
               f"llvm {[(fn[:80], file, line) for fn, file, line in theirs]}"
        if ok_frames == len(theirs) == len(mine):
            ag.addresses_agree += 1
        else:
            ag.disagreements.append(desc)
    return ag


def _name_agrees(m: dict, fn: str, demangled: dict[str, str], ag: Agreement) -> bool:
    if m["reason"] is not None:
        return fn == "??"
    if m["function"] == fn:
        return True
    raw = m["symbol"]
    if raw and demangled.get(raw) == fn:
        ag.note("demangler style")
        return True
    if raw and raw == fn:
        ag.note("llvm could not demangle")
        return True
    return False


def _file_agrees(ours: str | None, theirs: str, ag: Agreement) -> bool:
    if ours is None:
        return theirs == "??"
    if ours == theirs:
        return True
    prefix = theirs[: len(theirs) - len(ours) - 1]
    if (theirs.endswith("/" + ours) and prefix and not prefix.startswith("/")
            and ours.startswith(prefix + "/")):
        ag.note("DWARF 5 directory 0 doubled by LLVM 14")
        return True
    return False


def check(name: str, ag: Agreement, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print("\n" + ag.report(name))
    assert ag.addresses_agree >= 0.99 * ag.addresses, ag.report(name)
    assert ag.frames_agree >= 0.99 * ag.frames, ag.report(name)


def test_libc_with_debug_file(capsys: pytest.CaptureFixture[str]) -> None:
    ag = compare(LIBC, text_addresses(LIBC, N))
    check("libc.so.6 + libc6-dbg", ag, capsys)
    assert ag.frames > ag.addresses  # inline frames were compared too


def test_libstdcxx(capsys: pytest.CaptureFixture[str]) -> None:
    if not LIBSTDCXX_DBG.is_file():
        pytest.skip("libstdc++6-12-dbg is not installed (scripts/setup installs it)")
    ag = compare(LIBSTDCXX_DBG, text_addresses(LIBSTDCXX_DBG, N))
    check("libstdc++ (debug build)", ag, capsys)


def test_python_symbols_only(capsys: pytest.CaptureFixture[str]) -> None:
    ag = compare(PYTHON, text_addresses(PYTHON, N))
    check("python3.11 (.dynsym only)", ag, capsys)


@pytest.mark.parametrize("flags", [("-O2", "-g"), ("-O2", "-gdwarf-4"), ("-O2", "-g", "-gz"),
                                   ("-O2", "-g", "-no-pie")],
                         ids=["dwarf5", "dwarf4", "compressed", "no-pie"])
def test_cxx_fixture_inlines(flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    exe = build(["symbolize/inl.cc"], flags=flags, name="inl")
    img = ElfImage(exe)
    try:
        info = img.sections[".debug_info"]
        assert bool(info["sh_flags"] & SHF_COMPRESSED) == ("-gz" in flags)
        version = Dwarf(img.dwarf_sections(), img.exec_ranges()).units[0].version
        assert version == (4 if "-gdwarf-4" in flags else 5)
    finally:
        img.close()
    addrs = text_addresses(exe, N)
    ag = compare(exe, addrs)
    check(f"fixture inl.cc {' '.join(flags)}", ag, capsys)
    assert ag.frames >= 2 * ag.addresses  # -O2 inlining: deep chains are compared


def _rustc() -> str | None:
    return shutil.which("rustc") or (str(p) if (p := Path.home() / ".cargo/bin/rustc").is_file()
                                     else None)


@pytest.mark.skipif(_rustc() is None, reason="rustc is not installed (optional: Rust names)")
def test_rust_fixture(capsys: pytest.CaptureFixture[str]) -> None:
    src = FIXTURES / "symbolize" / "hashmap.rs"
    rustc = _rustc()
    assert rustc
    digest = hashlib.sha256(src.read_bytes() + rustc.encode()).hexdigest()[:12]
    exe = BUILD_DIR / f"hashmap-rs-{digest}"
    if not exe.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
        subprocess.run([rustc, "-O", "-g", str(src), "-o", str(tmp)], check=True,
                       capture_output=True)
        os.replace(tmp, exe)
    ag = compare(exe, text_addresses(exe, N))
    check("Rust fixture hashmap.rs -O -g", ag, capsys)
    assert ag.frames >= 2 * ag.addresses
