"""Unwinding speed against `perf script` on the same Python allocation loop.

The workload is the system python3 calling the fixture's snapshot entry through ctypes
in a loop (each call: what a malloc uprobe sees — registers, 8 KiB of stack, the maps).
memtrack unwinds those stacks (CFI tables cold, then warm); perf records the same loop
with a uprobe on the same entry and `--call-graph dwarf,8192`, and `perf script`
unwinds (and names) its samples. Printed: stacks/s and frames/s, time per stack next
to perf's per sample (ratio), frames by method, stacks that reach _start / a thread
start.

    .venv/bin/python bench/bench_unwind.py [--calls 1000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from unwind_support import run_snaps, snap_lib  # noqa: E402

from memtrack.process.unwind import unwind  # noqa: E402
from memtrack.symbolize import symbolize  # noqa: E402
from memtrack.symbolize.modules import ModuleStore  # noqa: E402

WORKLOAD = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
for i in range(int(sys.argv[2])):
    lib.mt_snap(64 + i % 50)
"""
TRACEFS = Path("/sys/kernel/tracing")


def perf_baseline(lib: Path, calls: int, tmp: Path) -> tuple[int, float] | str:
    """(samples, seconds of `perf script`), or why perf could not run."""
    out = subprocess.run(["nm", str(lib)], capture_output=True, text=True).stdout
    off = next(int(line.split()[0], 16) for line in out.splitlines()
               if line.endswith(" mt_snap"))
    group = f"mtbench{os.getpid()}"
    events = TRACEFS / "uprobe_events"
    try:
        _tracefs_write(events, f"p:{group}/snap {lib}:{off:#x}")
    except OSError as e:
        return f"cannot add a uprobe event ({e}); run as root"
    try:
        data = tmp / "perf.data"
        script = tmp / "work.py"
        script.write_text(WORKLOAD)
        rec = subprocess.run(
            ["perf", "record", "-q", "-m", "8192", "-o", str(data), "-e", f"{group}:snap",
             "--call-graph", "dwarf,8192", "--", "/usr/bin/python3", str(script), str(lib),
             str(calls)], capture_output=True, text=True)
        if rec.returncode != 0:
            return f"perf record failed: {rec.stderr.strip()[:200]}"
        t = time.perf_counter()
        res = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True,
                             text=True)
        dt = time.perf_counter() - t
        samples = sum(1 for line in res.stdout.splitlines() if f"{group}:snap" in line)
        return samples, dt
    finally:
        _tracefs_write(events, f"-:{group}/snap")


def _tracefs_write(path: Path, line: str) -> None:
    """Append one definition (tracefs files refuse the seek of Python's append mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    lib = snap_lib()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")  # cold CFI tables on the first pass
        snaps = run_snaps(["/usr/bin/python3", "-c", WORKLOAD, str(lib), str(args.calls)],
                          tmp)
        n = snaps.stacks.num_rows
        store = ModuleStore(None, host_modules=True)
        t = time.perf_counter()
        unwind(snaps.stacks, snaps.mappings, store)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        res = unwind(snaps.stacks, snaps.mappings, store)
        warm = time.perf_counter() - t
        frames = res.frames
        t = time.perf_counter()
        symbolize(store, frames.column("build_id").combine_chunks(),
                  frames.column("lookup_vaddr").fill_null(0).to_numpy().astype(np.uint64))
        sym = time.perf_counter() - t
        nf = frames.num_rows
        print(f"workload: python3 ctypes loop, {n} stacks (8 KiB copies), {nf} frames, "
              f"{len(snaps.mappings)} mapping rows")
        print(f"memtrack unwind, CFI tables cold: {cold:.3f} s   warm: {warm:.3f} s")
        print(f"  warm: {n / warm:,.0f} stacks/s, {nf / warm:,.0f} frames/s, "
              f"{warm / n * 1e6:.1f} us/stack")
        print(f"  + symbolize (uncached): {sym:.3f} s")
        methods = frames.column("method").to_numpy(zero_copy_only=False)
        for m in ("regs", "cfi", "fp", "fp-kernel"):
            print(f"  frames by method {m:<9} {np.mean(methods == m):7.2%}")
        done = np.array(res.stacks.column("complete").to_pylist())
        print(f"  stacks reaching _start / a thread start: {done.mean():.2%}")
        base = perf_baseline(lib, args.calls, tmp)
        if isinstance(base, str):
            print(f"perf baseline: not measured: {base}")
            return
        samples, dt = base
        print(f"perf script (dwarf unwinding + symbols): {samples} samples in {dt:.3f} s, "
              f"{dt / max(samples, 1) * 1e6:.1f} us/sample")
        per_perf = dt / max(samples, 1)
        print(f"ratio perf script per sample / memtrack unwind per stack (warm): "
              f"{per_perf / (warm / n):.1f}x")
        print(f"ratio perf script per sample / memtrack unwind+symbolize per stack: "
              f"{per_perf / ((warm + sym) / n):.1f}x")


if __name__ == "__main__":
    main()
