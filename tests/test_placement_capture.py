"""Probe placement through `memtrack capture`: the choices recorded in the manifest,
and exact event sequences with the chosen offsets and with --probe-placement entry."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build

from memtrack.capture.placement import function_code, place_symbol
from memtrack.schema import EventKind
from memtrack.schema.artifact import Artifact

pytestmark = pytest.mark.bpf

HEAP = {EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC, EventKind.ALIGNED_ALLOC,
        EventKind.FREE}
MEMTRACK = [sys.executable, "-c", "from memtrack.cli import main; main()"]


def capture(tmp_path: Path, exe: Path, placement: str) -> tuple[dict[str, Any], list[dict], str]:
    out = tmp_path / f"{exe.name}-{placement}.memtrack"
    proc = subprocess.run([*MEMTRACK, "capture", "-o", str(out), "--stacks", "off", "--rss", "off",
                           "--probe-placement", placement, "--", str(exe)],
                          input="g", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    art = Artifact.open(out)
    manifest = json.loads((out / "manifest.json").read_text())
    events = [e for e in art.read("events").table.to_pylist() if e["kind"] in HEAP]
    return manifest, events, proc.stdout


def probes_of(manifest: dict[str, Any], path_part: str) -> dict[str, dict[str, Any]]:
    return {p["function"]: p for p in manifest["probes"] if path_part in Path(p["path"]).name}


@pytest.fixture(scope="module")
def scenario_exe() -> Path:
    lib = build(["placement/prologues.S"], shared=True, name="libprologues")
    return build(["placement/scenario.c"], flags=("-O0", "-fno-builtin"),
                 libs=(str(lib), f"-Wl,-rpath,{lib.parent}"))


def expected_scenario(stdout: str) -> list[tuple[EventKind, int, int, int]]:
    a = {k: int(v, 16) for k, v in re.findall(r"^(\w+) (0x[0-9a-f]+)$", stdout, re.M)}
    M, C, R, A, F = (EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC,
                     EventKind.ALIGNED_ALLOC, EventKind.FREE)
    return [(M, a["begin"], 0, 0x5EED01), (M, a["a"], 0, 24), (M, a["b"], 0, 40),
            (C, a["c"], 0, 24), (R, a["d"], 0, 64), (R, a["e"], a["b"], 80),
            (A, a["f"], 0, 128), (F, a["a"], 0, 0), (F, a["c"], 0, 0), (F, a["d"], 0, 0),
            (F, a["e"], 0, 0), (F, a["f"], 0, 0), (M, a["end"], 0, 0x5EED02),
            (F, a["begin"], 0, 0), (F, a["end"], 0, 0)]


@pytest.mark.parametrize("placement", ["auto", "entry"])
def test_fixture_library_exact_events(tmp_path: Path, scenario_exe: Path,
                                      placement: str) -> None:
    manifest, events, stdout = capture(tmp_path, scenario_exe, placement)
    got = [(EventKind(e["kind"]), e["addr"], e["old_addr"], e["size"]) for e in events]
    assert got == expected_scenario(stdout)
    probes = probes_of(manifest, "libprologues")
    offsets = {name: p["probe_offset"] for name, p in probes.items()}
    if placement == "auto":
        assert offsets == {"malloc": 0, "free": 5, "calloc": 0, "realloc": 3,
                           "aligned_alloc": 4}
        assert "writes rdi (an argument register)" in probes["calloc"]["reason"]
        assert "taken path returns without a call or a store" in probes["free"]["reason"]
        assert "not skipping je" in probes["realloc"]["reason"]
        assert "skipped endbr64" in probes["aligned_alloc"]["reason"]
    else:
        assert set(offsets.values()) == {0}


LIBC = "libc.so.6"


@pytest.mark.parametrize("placement", ["auto", "entry"])
def test_glibc_free_skips_the_null_test_and_records_every_free(tmp_path: Path,
                                                              placement: str) -> None:
    exe = build(["placement/libcfree.c"], flags=("-O1", "-fno-builtin"))
    manifest, events, stdout = capture(tmp_path, exe, placement)
    ptrs = [int(v, 16) for v in re.findall(r"^p (0x[0-9a-f]+)$", stdout, re.M)]
    assert len(ptrs) == 64
    mine = [(EventKind(e["kind"]), e["addr"], e["size"]) for e in events
            if e["addr"] in set(ptrs)]
    expect = [(EventKind.MALLOC, p, 16 + 8 * i) for i, p in enumerate(ptrs)]
    expect += [(EventKind.FREE, p, 0) for p in reversed(ptrs)]
    assert mine == expect
    assert not [e for e in events if e["kind"] == EventKind.FREE and e["addr"] == 0]
    free = probes_of(manifest, LIBC)["free"]
    if placement == "entry":
        assert free["probe_offset"] == 0
        return
    code, _ = function_code(free["path"], "free")
    je_len = 6 if code[3] == 0x0F else 2
    assert code[:3] == bytes.fromhex("4885ff")  # test %rdi,%rdi
    assert free["probe_offset"] == 3 + je_len == place_symbol(free["path"], "free").offset
    assert "skipped test rdi, rdi; je" in free["reason"]
