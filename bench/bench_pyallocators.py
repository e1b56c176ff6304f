"""--python-allocators on: what recording every Python object costs, against memray's
same mode (`memray run --trace-python-allocators`) and the bare program, in one run.

The workload is fixtures/python/objects.py's dict/list loop (`churn`), run by this
interpreter (memray must be importable by it: the dev extras). Each configuration runs
`--repeat` times, alternating; the medians are printed, as the loop's own time (measured
inside the program, what tracing slows down) and the whole command's wall time
(memtrack's includes loading its BPF programs and writing the artifact; memray's its
start-up and writing its file), each as a ratio to the bare program's.

Run as root: .venv/bin/python bench/bench_pyallocators.py [--rounds N] [--repeat K]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import sys, time
sys.path.insert(0, {fixtures!r})
from objects import churn
t = time.perf_counter()
churn({rounds})
print("loop", time.perf_counter() - t)
"""


def configurations(script: Path, out: Path) -> dict[str, list[str]]:
    py = sys.executable
    memtrack = [py, "-m", "memtrack.cli", "capture", "--force", "-o", str(out / "m.memtrack")]
    memray = [py, "-m", "memray", "run", "-q", "-f", "-o", str(out / "r.bin")]
    return {
        "bare": [py, str(script)],
        "memtrack off": [*memtrack, "--", py, str(script)],
        "memtrack on": [*memtrack, "--python-allocators", "on", "--", py, str(script)],
        "memray": [*memray, str(script)],
        "memray --trace-python-allocators": [*memray, "--trace-python-allocators",
                                             str(script)],
    }


def once(cmd: list[str]) -> tuple[float, float]:
    """(the loop's seconds, the command's wall seconds)."""
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr}")
    loop = next(float(ln.split()[1]) for ln in r.stdout.splitlines() if ln.startswith("loop "))
    return loop, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-pyalloc-") as tmp:
        out = Path(tmp)
        script = out / "churn.py"
        script.write_text(SCRIPT.format(fixtures=str(ROOT / "fixtures" / "python"),
                                        rounds=args.rounds))
        configs = configurations(script, out)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
        for _ in range(args.repeat):
            for name, cmd in configs.items():
                times[name].append(once(cmd))
    med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v))
           for k, v in times.items()}
    bare_loop, bare_wall = med["bare"]
    print(f"{sys.executable} {Path(__file__).name}: churn {args.rounds} rounds, "
          f"median of {args.repeat}")
    print(f"{'configuration':36} {'loop s':>8} {'x bare':>8} {'wall s':>8} {'x bare':>8}")
    for name, (loop, wall) in med.items():
        print(f"{name:36} {loop:8.3f} {loop / bare_loop:8.2f} {wall:8.3f} "
              f"{wall / bare_wall:8.2f}")
    on, theirs = med["memtrack on"], med["memray --trace-python-allocators"]
    print(f"memtrack on / memray --trace-python-allocators: loop {on[0] / theirs[0]:.2f}x, "
          f"wall {on[1] / theirs[1]:.2f}x")


if __name__ == "__main__":
    main()
