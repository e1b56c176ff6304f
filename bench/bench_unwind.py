"""Unwinding speed on a capture of a Python allocation loop, against `perf script`.

memtrack captures the system python3 running an allocation loop (stacks on, default
copies), decodes its stack records and unwinds every distinct one (CFI tables cold,
then warm); perf records the same loop with a uprobe on libc's malloc and
`--call-graph dwarf,8192`, and `perf script` unwinds (and names) its samples.
Printed: stacks/s and frames/s, time per stack next to perf's per sample (ratio),
frames by method, stacks that reach _start / a thread start. Needs root and bcc.

    .venv/bin/python bench/bench_unwind.py [--iterations 1000]
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

from memtrack.addrspace.modules import ModuleStore
from memtrack.capture.options import CaptureOptions
from memtrack.process.decode import decode
from memtrack.process.unwind import unwind
from memtrack.schema.artifact import Artifact
from memtrack.symbolize import symbolize_frames

WORKLOAD = """
import sys
def leaf(n):
    return bytearray(n)
def mid(i):
    return [leaf(64 + (i * 7 + k) % 4000) for k in range(3)]
keep = []
for i in range(int(sys.argv[1])):
    keep.append(mid(i))
    if len(keep) > 100:
        keep.clear()
"""
PYTHON = str(Path("/usr/bin/python3").resolve())
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
TRACEFS = Path("/sys/kernel/tracing")


def _tracefs_write(path: Path, line: str) -> None:
    """Append one definition (tracefs files refuse the seek of Python's append mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def malloc_file_offset() -> int:
    out = subprocess.run(["nm", "-D", str(LIBC)], capture_output=True, text=True,
                         check=True).stdout
    vaddr = next(int(ln.split()[0], 16) for ln in out.splitlines()
                 if ln.split()[-1].split("@")[0] == "malloc")
    mod = ModuleStore(None).add_file(LIBC)
    seg = mod.segments
    i = int(np.flatnonzero((seg.vaddr <= vaddr) & (vaddr < seg.vaddr + seg.filesz))[0])
    return vaddr - int(seg.vaddr[i]) + int(seg.offset[i])


def perf_baseline(script: Path, iterations: int, tmp: Path) -> tuple[int, float] | str:
    """(samples, seconds of `perf script`), or why perf could not run."""
    group = f"mtbench{os.getpid()}"
    events = TRACEFS / "uprobe_events"
    try:
        _tracefs_write(events, f"p:{group}/malloc {LIBC.resolve()}:{malloc_file_offset():#x}")
    except OSError as e:
        return f"cannot add a uprobe event ({e}); run as root"
    try:
        data = tmp / "perf.data"
        rec = subprocess.run(
            ["perf", "record", "-q", "-m", "16384", "-o", str(data), "-e", f"{group}:malloc",
             "--call-graph", "dwarf,8192", "--", PYTHON, str(script), str(iterations)],
            capture_output=True, text=True)
        if rec.returncode != 0:
            return f"perf record failed: {rec.stderr.strip()[:200]}"
        t = time.perf_counter()
        res = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True,
                             text=True)
        dt = time.perf_counter() - t
        samples = sum(1 for line in res.stdout.splitlines() if f"{group}:malloc" in line)
        return samples, dt
    finally:
        _tracefs_write(events, f"-:{group}/malloc")


def capture(script: Path, iterations: int, out: Path) -> Path:
    from memtrack.capture.tracker import Tracker

    with Tracker(CaptureOptions(stacks=True, rss=False)) as t:
        result = t.spawn([PYTHON, str(script), str(iterations)], out).wait(timeout=600)
    if result.exit_code != 0:
        raise SystemExit(f"bench: the workload exited with {result.exit_code}")
    lost = {k: v for k, v in result.losses.items() if v}
    if lost:
        print(f"capture losses: {lost}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=1000)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root (capture with bcc, perf uprobes)")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")  # cold CFI tables on the first pass
        script = tmp / "work.py"
        script.write_text(WORKLOAD)
        path = capture(script, args.iterations, tmp / "py.memtrack")
        art = Artifact.open(path)
        t = time.perf_counter()
        decoded = decode(art).table
        t_decode = time.perf_counter() - t
        mappings = art.read("mappings").table
        n_events = art.read("events").table.num_rows
        store = ModuleStore(path)
        t = time.perf_counter()
        unwind(decoded, mappings, store)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        res = unwind(decoded, mappings, store)
        warm = time.perf_counter() - t
        frames = res.stack_frames
        t = time.perf_counter()
        symbolize_frames(store, frames)
        sym = time.perf_counter() - t
        n = res.stacks.num_rows
        nf = frames.num_rows
        print(f"workload: python3 allocation loop x{args.iterations}: {n_events} events, "
              f"{decoded.num_rows} stack records (decoded in {t_decode:.3f} s), {nf} frames")
        print(f"memtrack unwind, CFI tables cold: {cold:.3f} s   warm: {warm:.3f} s")
        print(f"  warm: {n / warm:,.0f} stacks/s, {nf / warm:,.0f} frames/s, "
              f"{warm / n * 1e6:.1f} us/stack")
        print(f"  + symbolize (uncached): {sym:.3f} s")
        methods = frames.column("method").to_numpy(zero_copy_only=False)
        for m in ("regs", "cfi", "fp", "fp-kernel"):
            print(f"  frames by method {m:<9} {np.mean(methods == m):7.2%}")
        done = np.array(res.stacks.column("complete").to_pylist())
        print(f"  stacks reaching _start / a thread start: {done.mean():.2%}")
        stops = res.stacks.column("stop").to_pylist()
        others = {s: stops.count(s) for s in set(stops) if s != "complete"}
        if others:
            print(f"  other stops: {others}")
        base = perf_baseline(script, args.iterations, tmp)
        if isinstance(base, str):
            print(f"perf baseline: not measured: {base}")
            return
        samples, dt = base
        per_perf = dt / max(samples, 1)
        print(f"perf script (dwarf unwinding + symbols): {samples} samples in {dt:.3f} s, "
              f"{per_perf * 1e6:.1f} us/sample")
        print(f"ratio perf script per sample / memtrack unwind per stack (warm): "
              f"{per_perf / (warm / n):.1f}x")
        print(f"ratio perf script per sample / memtrack unwind+symbolize per stack: "
              f"{per_perf / ((warm + sym) / n):.1f}x")


if __name__ == "__main__":
    sys.exit(main())
