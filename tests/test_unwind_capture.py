"""The unwinder end to end on real captures: malloc's callers in the fixtures built
four ways, a thread, the system python3, and the `memtrack unwind` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support.capture import spawn
from support.snaps import VARIANTS, build_fixture

from memtrack.addrspace.modules import ModuleStore
from memtrack.capture.options import CaptureOptions
from memtrack.process.decode import decode
from memtrack.process.pyframes import native_hashes
from memtrack.process.unwind import unwind
from memtrack.schema import EventKind
from memtrack.schema.artifact import Artifact
from memtrack.symbolize import symbolize

pytestmark = pytest.mark.bpf

LIBC_START = ["__libc_start_call_main", "__libc_start_main", "_start"]
MALLOC = ("malloc", "__libc_malloc")  # one address, two symbols


@pytest.fixture(scope="module")
def tracker() -> Any:
    from memtrack.capture.tracker import Tracker

    # the whole native stacks of Python code too (a Python cut keeps its caller alone)
    with Tracker(CaptureOptions(stacks=True, rss=False, python_stacks="mixed")) as t:
        yield t


def capture(t: Any, tmp: Path, cmd: list[str], name: str) -> Path:
    result = spawn(t, cmd, tmp / f"{name}.memtrack", tmp / "stdout", timeout=120)
    assert result.status == 0
    return tmp / f"{name}.memtrack"


def stacks_by_size(path: Path) -> tuple[dict[int, list[list[str]]], Any]:
    """Unwound, symbolized stacks of the malloc events, keyed by requested size."""
    art = Artifact.open(path)
    decoded = decode(art)
    store = ModuleStore(path)
    res = unwind(decoded.table, art.read("mappings").table, store)
    frames = res.stack_frames
    sym = symbolize(store, frames.column("build_id").combine_chunks(),
                    frames.column("lookup_vaddr").fill_null(0).to_numpy().astype(np.uint64),
                    paths=frames.column("path").combine_chunks())
    outer: dict[int, str] = {}
    for r in sym.select(["row", "function"]).to_pylist():
        outer[r["row"]] = r["function"] or "?"  # the last level is the real function
    names: dict[tuple[int, int], list[str]] = {}
    for i, f in enumerate(frames.select(["stack_hash", "pid"]).to_pylist()):
        names.setdefault((f["stack_hash"], f["pid"]), []).append(outer.get(i, "?"))
    ev = art.read("events").table
    ev = ev.filter(pc.equal(ev.column("kind"), pa.scalar(EventKind.MALLOC, pa.uint8())))
    # a Python stack's native frames are those of the native stack it extends
    native = native_hashes(art.read("py_stacks").table, ev.column("stack_hash").to_numpy())
    out: dict[int, list[list[str]]] = {}
    for e, h in zip(ev.select(["size", "pid"]).to_pylist(), native.tolist(), strict=True):
        out.setdefault(e["size"], []).append(names.get((h, e["pid"]), []))
    return out, res


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_malloc_callers_four_builds(tracker: Any, variant: str, tmp_path: Path) -> None:
    exe = build_fixture(["unwind/chain.c"], (*VARIANTS[variant], "-DSNAP=malloc"),
                        f"chain-malloc-{variant}")
    by_size, res = stacks_by_size(capture(tracker, tmp_path, [str(exe)], "chain"))
    for size in (102, 112, 122):
        (stack,) = by_size[size]
        assert stack[0] in MALLOC
        assert stack[1:] == ["c", "b", "a", "main", *LIBC_START], size
    assert res.counters["unwind_frames_fp"] == 0


@pytest.mark.parametrize("mode, size, tail", [
    ("thread", 501, ["t_b", "t_a", "worker", "start_thread", "clone3"]),
    ("signal", 314, ["handler", "__restore_rt", "victim", "main", *LIBC_START]),
    ("dlopen", 601, ["p_inner", "plugin_entry", "main", *LIBC_START]),
])
def test_thread_signal_dlopen(tracker: Any, mode: str, size: int, tail: list[str],
                              tmp_path: Path) -> None:
    """mt_snap without MT_SNAP_OUT is a plain malloc wrapper: malloc(size) from a thread,
    a signal handler, a dlopen'd library."""
    exe = build_fixture(["unwind/cases.c"], VARIANTS["O2"], "cases-O2", libs=("-lpthread",))
    plugin = build_fixture(["unwind/plugin.c"], VARIANTS["O2"], "plugin-O2", shared=True)
    by_size, _ = stacks_by_size(capture(tracker, tmp_path, [str(exe), mode, str(plugin)],
                                        mode))
    (stack,) = by_size[size]
    assert stack[0] in MALLOC
    assert "mt_snap" in stack[1:3]
    assert stack[stack.index("mt_snap") + 1:] == tail


def test_system_python3(tracker: Any, tmp_path: Path) -> None:
    py = str(Path("/usr/bin/python3").resolve())
    code = "x = [bytearray(100000 + i) for i in range(50)]"
    by_size, res = stacks_by_size(capture(tracker, tmp_path, [py, "-c", code], "py"))
    # Each bytearray is one malloc of its size plus the object's header.
    stacks = [s for size, ss in by_size.items() if 100000 <= size < 100200 for s in ss]
    assert len(stacks) == 50, sorted(by_size)[-60:]
    for s in stacks:
        assert "_PyEval_EvalFrameDefault" in s
        assert s[-5:] == ["Py_RunMain", "Py_BytesMain", *LIBC_START]


def test_unwind_command(tracker: Any, tmp_path: Path) -> None:
    exe = build_fixture(["unwind/chain.c"], (*VARIANTS["O2"], "-DSNAP=malloc"),
                        "chain-malloc-O2")
    art = capture(tracker, tmp_path, [str(exe)], "cmd")
    ev = Artifact.open(art).read("events").table.to_pylist()
    (h,) = [e["stack_hash"] for e in ev if e["kind"] == EventKind.MALLOC and e["size"] == 112]
    out = subprocess.run([sys.executable, "-m", "memtrack.cli", "unwind", str(art),
                          "--record", f"{h:#x}"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "(complete)" in lines[0]
    names = [ln.split()[3].split("+")[0] for ln in lines[1:6]]
    assert names[0] in MALLOC and names[1:] == ["c", "b", "a", "main"]
    assert [ln.split()[2] for ln in lines[1:6]] == ["regs", "cfi", "cfi", "cfi", "cfi"]
    bad = subprocess.run([sys.executable, "-m", "memtrack.cli", "unwind", str(art),
                          "--record", "0x1234"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"memtrack: unwind: no stack record with hash 0x1234 in {art}"
