"""Lossless capture under load: pause mode against drop mode, and the drain's worst gap.

    sudo .venv/bin/python bench/bench_lossless.py [--loops 300000] [--repeat 3]

The workload is the PYTHONMALLOC=malloc dict/list loop (fixtures/lossless/dictloop.py)
with stacks on, while two CPU hogs keep both cores busy (a busy runner). Each round
runs, interleaved: the bare loop, then `memtrack capture --on-ring-full pause` and
`--on-ring-full drop` from the command line, with the default rings and with small
ones (which the loaded program fills): a 256 KiB events ring and the smallest stack
ring capture accepts with the default stack budget, at least 256 KiB. The hogs run while the
program runs (the bare loop, or from the capture's spawn to its end): BPF compilation
before the spawn takes 10-100 s on a loaded 2-core machine and would drown the
difference between the modes, which lies in the run. Printed per configuration
(medians): the end-to-end time, the run (spawn to exit) and its ratio to bare, pause
against drop run by run, events written and lost, the pauses and the time paused,
and the drain thread's worst gap between two reads (the maximum) and its share of a
core (from the manifest's `drain` section).

Then (--bpf, or alone with --only-bpf) the BPF run time per hit (kernel.bpf_stats) of
the programs that write events, drop mode (the watermark check returns at once)
against pause mode (it queries the ring), on a malloc/free loop over a private libc
as bench_capture.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memtrack.capture.drain import min_ring_pages
from memtrack.capture.options import CaptureOptions
from memtrack.capture.stacks import record_words
from memtrack.schema import is_loss

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.load import cpu_hogs  # noqa: E402

LOOP = ROOT / "fixtures" / "lossless" / "dictloop.py"
MEMTRACK = [sys.executable, "-m", "memtrack.cli", "capture"]


def small_rings() -> list[str]:
    """A 256 KiB events ring; a stack ring of 256 KiB or the smallest that pause mode
    accepts for the default stack records."""
    stacks = max(64, min_ring_pages(record_words(CaptureOptions().stack_budget, False) * 8,
                                    os.cpu_count() or 1))
    return ["--events-ring-pages", "64", "--stacks-ring-pages", str(stacks)]


def bare(loops: int) -> float:
    with cpu_hogs(2):
        t0 = time.perf_counter()
        subprocess.run(["/usr/bin/python3", str(LOOP), str(loops)], check=True,
                       capture_output=True, env={**os.environ, "PYTHONMALLOC": "malloc"})
        return time.perf_counter() - t0


def captured(loops: int, mode: str, rings: list[str], out: Path) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen([*MEMTRACK, "-o", str(out), "--force", "--on-ring-full", mode, *rings,
                          "--", "/usr/bin/python3", str(LOOP), str(loops)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONMALLOC": "malloc"})
    manifest = out / "manifest.json"
    while not manifest.exists() or json.loads(manifest.read_text())["root_pid"] == 0:
        if p.poll() is not None:
            sys.exit(f"bench_lossless: capture failed: {p.communicate()[1]}")
        time.sleep(0.05)
    with cpu_hogs(2):
        _, err = p.communicate()
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench_lossless: capture failed: {err}")
    m = json.loads(manifest.read_text())
    run_s = (m["end_ns"] - m["start_ns"]) / 1e9
    lost = sum(v for k, v in m["losses"].items() if v and is_loss(k))
    info = subprocess.run([sys.executable, "-m", "memtrack.cli", "info", "--json", str(out)],
                          capture_output=True, text=True, check=True)
    rows = json.loads(info.stdout)["tables"]["events"]["rows"]
    bp, d = m["backpressure"], m["drain"]
    return {"wall": wall, "run": run_s, "events": rows, "lost": lost,
            "pauses": sum(bp.get("pauses", {}).values()), "paused": bp.get("paused_ns", 0) / 1e9,
            "gap_ms": d["worst_gap_ns"] / 1e6, "cpu": d["cpu_ns"] / 1e9 / run_s}


def bpf_cost(allocs: int = 200_000, repeat: int = 2) -> None:
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
    import bench_capture as bc
    from bpfstats import bpf_stats, prog_stats

    from memtrack.capture.options import CaptureOptions
    from memtrack.capture.tracker import Tracker

    loop = bc.build(["capture/loop.c"])
    names = ("mt_ret", "mt_free")
    per: dict[tuple[str, str], list[float]] = {}
    with bpf_stats():
        for _ in range(repeat):
            for mode in ("drop", "pause"):
                opts = CaptureOptions(stacks=False, rss=False, modules=False, on_ring_full=mode)
                with Tracker(opts) as t, tempfile.TemporaryDirectory() as d:
                    bc.captured_loop(t, [str(loop), "loop", str(allocs)], bc.private_libc(d))
                    for name in names:
                        rt, cnt = prog_stats(t.bpf.funcs[name.encode()].fd)
                        per.setdefault((name, mode), []).append(rt / cnt)
    print(f"BPF time per hit, malloc/free loop of {allocs:,} pairs, median of {repeat}:")
    for name in names:
        drop = statistics.median(per[(name, "drop")])
        pause = statistics.median(per[(name, "pause")])
        print(f"   {name:16s} drop {drop:6.0f} ns  pause {pause:6.0f} ns  "
              f"(+{pause - drop:.0f} ns, {pause / drop:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bpf", action="store_true", help="also the BPF cost of the check")
    ap.add_argument("--only-bpf", action="store_true", help="only the BPF cost of the check")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_lossless: needs root (BPF)")
    if args.only_bpf:
        bpf_cost()
        return
    configs = {"default rings": [], "small rings": small_rings()}
    results: dict[tuple[str, str], list[dict]] = {}
    bares: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeat):
            bares.append(bare(args.loops))
            for name, rings in configs.items():
                for mode in ("pause", "drop"):
                    results.setdefault((name, mode), []).append(
                        captured(args.loops, mode, rings, Path(d) / "b.memtrack"))
    b = statistics.median(bares)
    print(f"PYTHONMALLOC=malloc python3 dictloop.py {args.loops}, stacks on, two CPU hogs; "
          f"median of {args.repeat}; bare {b:.2f} s")
    print(f"{'':14s} {'mode':5s} {'end to end':>10s} {'run':>7s} {'x bare':>7s} "
          f"{'pause/drop':>10s} {'events':>10s} {'lost':>10s} {'pauses':>7s} {'paused':>7s} "
          f"{'worst gap':>9s} {'drain':>6s}")
    for name in configs:
        drop = [r["run"] for r in results[(name, "drop")]]
        for mode in ("pause", "drop"):
            rs = results[(name, mode)]
            wall = statistics.median(r["wall"] for r in rs)
            run = statistics.median(r["run"] for r in rs)
            ratio = statistics.median(p["run"] / q for p, q in
                                      zip(results[(name, "pause")], drop, strict=True))
            print(f"{name:14s} {mode:5s} {wall:9.2f}s {run:6.2f}s {run / b:6.1f}x "
                  f"{ratio if mode == 'pause' else 1.0:9.2f}x "
                  f"{statistics.median(r['events'] for r in rs):10,.0f} "
                  f"{statistics.median(r['lost'] for r in rs):10,.0f} "
                  f"{statistics.median(r['pauses'] for r in rs):7,.0f} "
                  f"{statistics.median(r['paused'] for r in rs):6.2f}s "
                  f"{max(r['gap_ms'] for r in rs):7.0f}ms "
                  f"{statistics.median(r['cpu'] for r in rs):5.1%}")
    print("worst gap: the drain thread's longest time between two reads (max over rounds); "
          "drain: its CPU time over the program's run")
    if args.bpf:
        bpf_cost()


if __name__ == "__main__":
    main()
