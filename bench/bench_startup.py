"""Fixed cost of a capture: `memtrack capture -o X -- /bin/true` from the shell, next to
`heaptrack /bin/true` and bare `/bin/true`, all measured in this run.

    sudo .venv/bin/python bench/bench_startup.py [--repeat 5] [--no-busy]

Figures (wall time of the whole command, Python start-up, compile or cache load,
attach, the run, module copies and detach included):
- memtrack with stacks off and on, its program cache warm (the usual case) and cold
  (a fresh cache directory each run: what the first capture on a new machine pays);
- heaptrack's fixed cost (heaptrack /bin/true minus bare /bin/true) and memtrack's as
  a multiple of it;
- the same again with two CPU-bound processes beside (a CI runner is rarely idle),
  unless --no-busy;
- where memtrack's warm time goes, measured in-process through the Tracker API (a
  second figure: the CLI's is the headline): imports, program load, tracepoint and
  uprobe attach, the session, finish.

Each figure is the median of --repeat runs (the fastest is printed too); every run
first waits until no other tracer's allocator uprobes are attached on the machine
(bench_overhead.Quiet): another capture's probes slow the mallocs of memtrack's own
Python and clang.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench_overhead import Quiet  # noqa: E402
from conftest import build  # noqa: E402
from support.load import cpu_hogs  # noqa: E402

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
TRUE = "/bin/true"
AIM = {"stacks off": 1.0, "stacks on": 1.5}  # seconds, issue 13
AIM_RATIO = 8.0  # x heaptrack's fixed cost


def wall(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} exited with {proc.returncode}: "
                           f"{proc.stderr.strip()[-300:]}")
    return elapsed


class Runs:
    def __init__(self, repeat: int, quiet: Quiet) -> None:
        self.repeat = repeat
        self.quiet = quiet

    def measure(self, fn: Callable[[], float]) -> list[float]:
        out = []
        for _ in range(self.repeat):
            self.quiet.wait()
            out.append(fn())
        return out


def memtrack_cmd(out: Path, stacks: bool, cache: Path) -> list[str]:
    return [*MEMTRACK, "capture", "-o", str(out), "--force", "--stacks",
            "on" if stacks else "off", "--program-cache", str(cache), "--", TRUE]


def measure_round(runs: Runs, tmp: Path, heaptrack: str | None) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {}
    res["bare /bin/true"] = runs.measure(lambda: wall([TRUE]))
    if heaptrack:
        res["heaptrack /bin/true"] = runs.measure(
            lambda: wall([heaptrack, "-o", str(tmp / "ht" / "run"), TRUE]))
    warm = tmp / "cache-warm"
    for stacks in (False, True):
        name = "stacks on" if stacks else "stacks off"
        wall(memtrack_cmd(tmp / "w.memtrack", stacks, warm))  # fills the cache
        res[f"memtrack {name}, cache warm"] = runs.measure(
            lambda s=stacks: wall(memtrack_cmd(tmp / "w.memtrack", s, warm)))

        def cold(s: bool = stacks) -> float:
            d = Path(tempfile.mkdtemp(dir=tmp, prefix="cold-"))
            try:
                return wall(memtrack_cmd(tmp / "c.memtrack", s, d / "bpf"))
            finally:
                shutil.rmtree(d, ignore_errors=True)

        res[f"memtrack {name}, cache cold"] = runs.measure(cold)
    return res


def report(title: str, res: dict[str, list[float]], *, aims: bool = True) -> None:
    print(title)
    bare = statistics.median(res["bare /bin/true"])
    ht = res.get("heaptrack /bin/true")
    ht_fixed = statistics.median(ht) - bare if ht else None
    print(f"   {'':34s} {'median':>8s} {'fastest':>8s}  {'x heaptrack fixed':>17s}"
          + ("  aim" if aims else ""))
    for name, times in res.items():
        med, low = statistics.median(times), min(times)
        ratio = (f"{(med - bare) / ht_fixed:16.1f}x" if ht_fixed and name.startswith("memtrack")
                 else f"{'':17s}")
        aim = ""
        for key, limit in AIM.items() if aims else ():
            if name.startswith(f"memtrack {key}, cache warm"):
                ok = med <= limit and (ht_fixed is None or (med - bare) / ht_fixed <= AIM_RATIO)
                aim = (f"<= {limit:.1f} s and <= {AIM_RATIO:.0f}x: "
                       f"{'met' if ok else 'NOT met'}")
        print(f"   {name:34s} {med:7.3f}s {low:7.3f}s  {ratio}  {aim}")
    if ht_fixed is not None:
        print(f"   heaptrack's fixed cost: {ht_fixed * 1000:.0f} ms")


def phases(tmp: Path) -> None:
    """Where a warm capture's time goes, in-process (the Tracker API)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import memtrack.cli, memtrack.capture.run"],
                   check=True)
    imports = time.monotonic() - t0
    from memtrack.capture.options import CaptureOptions
    from memtrack.capture.tracker import Tracker

    print("3. Where a warm capture's time goes (Tracker API, in-process; median of 3)")
    print(f"   python start-up and imports (a subprocess)  {imports * 1000:6.0f} ms")
    for stacks in (False, True):
        cache = tmp / "cache-warm"
        rows: dict[str, list[float]] = {}
        for _ in range(3):
            t = time.monotonic()
            tracker = Tracker(CaptureOptions(stacks=stacks, program_cache=str(cache)))
            t_load = time.monotonic()
            session = tracker.spawn([TRUE], tmp / "p.memtrack", overwrite=True)
            result = session.wait(timeout=60)
            t_run = time.monotonic()
            tracker.finish()
            t_end = time.monotonic()
            assert result.status == 0
            for k, v in (("program load, tracepoints, uprobe programs", t_load - t),
                         ("session: spawn, attach, run, module copies", t_run - t_load),
                         ("finish: uprobe links closed, rest handed over", t_end - t_run)):
                rows.setdefault(k, []).append(v)
        print(f"   stacks {'on' if stacks else 'off'}:")
        for k, v in rows.items():
            print(f"     {k:44s}{statistics.median(v) * 1000:6.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    ap.add_argument("--no-busy", action="store_true", help="skip the busy-machine round")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_startup: needs root (BPF)")
    allocloop = build(["placement/allocloop.cc"], flags=("-O2", "-fno-builtin"))
    quiet = Quiet([str(allocloop), "malloc", "200000"])
    runs = Runs(args.repeat, quiet)
    heaptrack = shutil.which("heaptrack")
    tmp = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        report("1. `memtrack capture -o X -- /bin/true` from the shell, quiet machine",
               measure_round(runs, tmp, heaptrack))
        if not args.no_busy:
            with cpu_hogs(2):
                report("2. The same beside two CPU-bound processes (a runner; the aims are "
                       "for a quiet machine)", measure_round(runs, tmp, heaptrack), aims=False)
        phases(tmp)
        if not heaptrack:
            print("heaptrack not found: no baseline (scripts/setup installs it)")
        print(f"quiet machine check: fastest canary {min(quiet.seen):.1f} ns/iteration, "
              f"waited {quiet.waited:.0f} s" +
              (f"; NOT quiet {quiet.gave_up} times" if quiet.gave_up else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
