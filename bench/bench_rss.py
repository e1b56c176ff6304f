"""What resident-memory capture costs per page fault, and how fast processing replays it.

    .venv/bin/python bench/bench_rss.py [--mib 256] [--rounds 4] [--repeat 3]   (root)

fixtures/rss/touch_loop.c maps, touches and unmaps anonymous memory; it times its own
touch loop, so process start-up and attach stops are not in the figure. It runs bare,
then under one Tracker each (no stacks): RSS off (the capture core alone), RSS on
(kmem:rss_stat), RSS with --track-faults. Per-fault cost is printed as ns and as a
ratio to the bare run of the same round, and the BPF programs' own run time per hit
(kernel.bpf_stats_enabled, switched on for the run) as a share of a bare fault.
Processing figures (timeline and fault
replay) are printed next to the time to read the same tables, measured in the same run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bpfstats import bpf_stats, prog_stats  # noqa: E402
from support.capture import spawn  # noqa: E402

from memtrack.capture.options import CaptureOptions  # noqa: E402
from memtrack.process.anon_replay import reconstruct_anon  # noqa: E402
from memtrack.process.lifecycle import lifecycle  # noqa: E402
from memtrack.process.rss import effective_rss  # noqa: E402
from memtrack.schema.artifact import Artifact  # noqa: E402


def build(tmp: Path) -> Path:
    exe = tmp / "touch_loop"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(ROOT / "fixtures/rss/touch_loop.c")],
                   check=True)
    return exe


def parse(out: str) -> tuple[int, int]:
    m = re.search(r"pages (\d+) ns (\d+)", out)
    if not m:
        raise SystemExit(f"touch_loop printed {out!r}")
    return int(m[1]), int(m[2])


PROGS = ("mt_rss_stat", "mt_fault_user")


def captured(options: CaptureOptions, cmd: list[str], art: Path,
             hits: dict[str, list[int]]) -> tuple[int, int]:
    from memtrack.capture.tracker import Tracker

    out = art.with_suffix(".out")
    with Tracker(options) as t:
        result = spawn(t, cmd, art, out, timeout=600, overwrite=True)
        for name in PROGS:
            fn = t.bpf.funcs.get(name.encode())
            if fn is not None:
                ns, cnt = prog_stats(fn.fd)
                acc = hits.setdefault(name, [0, 0])
                acc[0] += ns
                acc[1] += cnt
    if result.nonzero_losses():
        print(f"  losses: {result.nonzero_losses()}")
    return parse(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-rss-"))
    cmd = [str(build(tmp)), str(a.mib), str(a.rounds)]
    configs = {
        "core only": CaptureOptions(stacks=False, rss=False, modules=False),
        "rss_stat": CaptureOptions(stacks=False, rss=True, modules=False),
        "rss_stat + faults": CaptureOptions(stacks=False, rss=True, track_faults=True,
                                            modules=False),
    }
    best: dict[str, float] = {}
    pages = 0
    hits: dict[str, list[int]] = {}
    with bpf_stats():
        for _ in range(a.repeat):
            pages, ns = parse(subprocess.run(cmd, check=True, capture_output=True,
                                             text=True).stdout)
            best["bare"] = min(best.get("bare", 1e18), ns / pages)
            for name, opts in configs.items():
                p, ns = captured(opts, cmd, tmp / f"{name.replace(' ', '_')}.memtrack", hits)
                best[name] = min(best.get(name, 1e18), ns / p)
    print(f"page faults: {pages:,} per run, best of {a.repeat}")
    for name, v in best.items():
        print(f"  {name:<18} {v:8.0f} ns/fault   x{v / best['bare']:.2f} of bare")
    for name, (ns, cnt) in hits.items():
        per = ns / cnt if cnt else 0.0
        print(f"  BPF {name:<14} {per:8.0f} ns/hit     {per / best['bare']:.1%} of a bare fault "
              f"({cnt:,} hits, every tracepoint hit on the machine)")
    art = Artifact.open(tmp / "rss_stat_+_faults.memtrack")
    t0 = time.perf_counter()
    rss = art.read("rss").table
    ev = art.read("events").table
    faults = art.read("faults").table
    maps = art.read("mappings").table
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    lc = lifecycle(ev)
    effective_rss(rss, lc)
    t_tl = time.perf_counter() - t0
    t0 = time.perf_counter()
    reconstruct_anon(faults, ev, maps, lc, page_size=art.manifest.host.page_size)
    t_rp = time.perf_counter() - t0
    print(f"processing: {rss.num_rows:,} rss rows, {faults.num_rows:,} faults")
    print(f"  read tables        {t_read * 1e3:8.1f} ms   x1.00")
    print(f"  lifecycle + rss    {t_tl * 1e3:8.1f} ms   x{t_tl / t_read:.2f} of reading "
          f"({rss.num_rows / t_tl / 1e6:.2f} M rows/s)")
    print(f"  reconstruct_anon   {t_rp * 1e3:8.1f} ms   x{t_rp / t_read:.2f} of reading "
          f"({faults.num_rows / t_rp / 1e6:.2f} M faults/s)")


if __name__ == "__main__":
    main()
