"""Python frames: what they cost, on against off, in the same run.

1. BPF run time per allocator entry (kernel.bpf_stats_enabled, the mt_alloc program)
   with stacks on and Python frames off / on (a Python cut: --python-stacks python, the
   default) / on with the whole native stacks (--python-stacks mixed), on Debian's
   python3 (or --python, e.g. pyenv's 3.13) running a flat loop and the same loop 30
   Python calls deep (PYTHONMALLOC=malloc: every object is a malloc).
2. End to end through the command line: `memtrack capture` and `memtrack process`
   wall time with the same three, and the records each wrote.

Run as root: .venv/bin/python bench/bench_pyframes.py [--quick] [--python PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from bpfstats import bpf_stats, prog_stats  # noqa: E402

from memtrack.capture.options import CaptureOptions  # noqa: E402
from memtrack.schema import ALLOC_KINDS  # noqa: E402
from memtrack.schema.artifact import Artifact  # noqa: E402

PROBE = b"mt_alloc"
PYTHON = str(Path("/usr/bin/python3").resolve())
LOOP = ("def work(n):\n"
        "    keep = []\n"
        "    for i in range(n):\n"
        "        d = {{'a': i, 'b': [i, i + 1]}}\n"
        "        l = [d, str(i)]\n"
        "        if i % 1000 == 0:\n"
        "            keep.append(l)\n"
        "def deep(k, n):\n"
        "    return work(n) if k == 0 else deep(k - 1, n)\n"
        "deep({depth}, {n})\n")


def bpf_cost(workloads: dict[str, list[str]], tmp: Path) -> dict[str, dict[str, float]]:
    """ns of mt_alloc per tracked allocator entry: every process on the host runs the
    program (untracked ones return at once), so the untracked runs are costed at the
    stacks-off run's rate per run, as bench_stacks.py does."""
    from memtrack.capture.tracker import Tracker

    out: dict[str, dict[str, float]] = {}
    configs = (("base", CaptureOptions(stacks=False)), ("off", CaptureOptions(python_frames=False)),
               ("on", CaptureOptions(python_frames=True)),
               ("mixed", CaptureOptions(python_stacks="mixed")))
    for label, opts in configs:
        with Tracker(opts) as tracker:
            for wname, cmd in workloads.items():
                # the allocator programs are loaded with the first spawn
                funcs = tracker.bpf.funcs
                before = prog_stats(funcs[PROBE].fd) if PROBE in funcs else (0, 0)
                art = tmp / f"{label}-{wname}.memtrack"
                session = tracker.spawn(cmd, art, overwrite=True,
                                        env={**os.environ, "PYTHONMALLOC": "malloc"})
                session.wait(timeout=900)
                after = prog_stats(funcs[PROBE].fd)
                ns, runs = after[0] - before[0], after[1] - before[1]
                kind = Artifact.open(art).read("events").table.column("kind")
                tracked = int(pc.sum(pc.is_in(kind, value_set=pa.array(
                    [int(k) for k in ALLOC_KINDS], pa.uint8()))).as_py() or 0)
                r = out.setdefault(wname, {})
                base = r.get("base_run", ns / max(runs, 1))
                r.setdefault("base_run", base)
                r[label] = (ns - (runs - tracked) * base) / max(tracked, 1)
                r["tracked"] = tracked
    return out


def cli(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "memtrack.cli", *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def end_to_end(cmd: list[str], tmp: Path, repeat: int) -> dict[str, dict[str, Any]]:
    """The best of `repeat` alternating runs (the first also warms the program and
    symbol caches)."""
    out: dict[str, dict[str, Any]] = {}
    options = {"off": ["--python-frames", "off"], "on": [],
               "mixed": ["--python-stacks", "mixed"]}
    for _ in range(repeat):
        for label, opts in options.items():
            art, db = tmp / f"cli-{label}.memtrack", tmp / f"cli-{label}.duckdb"
            cap = cli(["capture", "-o", str(art), "--force", *opts, "--", *cmd])
            proc = cli(["process", str(art), "-o", str(db), "--force"])
            a = Artifact.open(art)
            r = out.setdefault(label, {"capture_s": cap, "process_s": proc})
            r["capture_s"] = min(r["capture_s"], cap)
            r["process_s"] = min(r["process_s"], proc)
            r.update(stack_records=a.read("stacks").table.num_rows,
                     py_stacks=a.read("py_stacks").table.num_rows,
                     py_codes=a.read("py_codes").table.num_rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    ap.add_argument("--python", default=PYTHON, help="the interpreter (default: %(default)s)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_pyframes: needs root (bcc)")
    n = 20000 if args.quick else 100000
    workloads = {
        "flat": [args.python, "-c", LOOP.format(depth=0, n=n)],
        "deep30": [args.python, "-c", LOOP.format(depth=30, n=n)],
    }
    tmp = Path(tempfile.mkdtemp(prefix="bench-pyframes-"))
    with bpf_stats():
        cost = bpf_cost(workloads, tmp)
    try:
        e2e = end_to_end(workloads["deep30"], tmp, 2 if args.quick else 3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.python}: BPF run time of mt_alloc per tracked allocator entry "
          "(PYTHONMALLOC=malloc), stacks off / stacks on, Python frames off / on (a Python "
          "cut) / on, mixed:")
    for wname, r in cost.items():
        print(f"  {wname:<7} {r['base']:5.0f} ns / {r['off']:5.0f} ns / {r['on']:5.0f} ns / "
              f"{r['mixed']:5.0f} ns  (a Python cut {r['on'] / r['off']:.2f}x frames off, "
              f"{r['on'] / r['mixed']:.2f}x mixed; {r['tracked']:,} entries)")
    print("\nend to end through the CLI, deep30 (pymalloc), --python-frames off / on / "
          "on with --python-stacks mixed:")
    off, on, mixed = e2e["off"], e2e["on"], e2e["mixed"]
    for k in ("capture_s", "process_s"):
        print(f"  {k:<10} {off[k]:6.2f} s / {on[k]:6.2f} s / {mixed[k]:6.2f} s  "
              f"(on {on[k] / off[k]:.2f}x off, {on[k] / mixed[k]:.2f}x mixed)")
    for label, r in e2e.items():
        print(f"  records, {label:<5}: stack {r['stack_records']:,}, python stacks "
              f"{r['py_stacks']:,}, code objects {r['py_codes']:,}")


if __name__ == "__main__":
    main()
