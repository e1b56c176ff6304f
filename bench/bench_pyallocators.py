"""--python-allocators on: what recording every Python object costs, against memray's
same mode (`memray run --trace-python-allocators`) and the bare program, in one run.

The workload is fixtures/python/objects.py's dict/list loop (`churn`), run by this
interpreter (memray must be importable by it: the dev extras). Each configuration runs
`--repeat` times, alternating; the medians are printed, as the loop's own time (measured
inside the program, what tracing slows down) and the whole command's wall time
(memtrack's includes loading its BPF programs and writing the artifact; memray's its
start-up and writing its file), each as a ratio to the bare program's.

`--suite`: also fixtures/pysuite (195 pytest tests, the memtrack.pytest plugin) captured
and processed through the command line with --python-allocators off and on: the tests
whose region holds no allocation, the allocations, and the capture's and process's wall
time, on against off (minutes: the suite has ~4 M object allocations).

Run as root: .venv/bin/python bench/bench_pyallocators.py [--rounds N] [--repeat K] [--suite]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.pysuite import SUITE_ENV, clear_bytecode, memtrack, suite_command  # noqa: E402

ZERO = ("SELECT count(*) AS tests, count(*) FILTER (WHERE calls = 0) AS empty, "
        "(SELECT count(*) FROM allocations) AS allocations FROM region_metrics")
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


def suite(tmp: Path) -> None:
    rows = {}
    for mode in ("off", "on"):
        art, db = tmp / f"suite-{mode}.memtrack", tmp / f"suite-{mode}.duckdb"
        clear_bytecode()
        t = time.perf_counter()
        r = memtrack("capture", "-o", str(art), "--force", "--python-allocators", mode, "--",
                     *suite_command(), env=SUITE_ENV, timeout=7200)
        cap = time.perf_counter() - t
        if r.returncode:
            raise SystemExit(f"capture of the suite failed: {r.stderr[-500:]}")
        t = time.perf_counter()
        r = memtrack("process", str(art), "-o", str(db), "-q", timeout=7200)
        proc = time.perf_counter() - t
        if r.returncode:
            raise SystemExit(f"process of the suite failed: {r.stderr[-500:]}")
        q = memtrack("query", str(db), ZERO, "--format", "json")
        rows[mode] = (json.loads(q.stdout)[0], cap, proc)
    print(f"{'fixtures/pysuite':20} {'tests':>6} {'empty':>6} {'allocations':>12} "
          f"{'capture s':>10} {'process s':>10}")
    for mode, (m, cap, proc) in rows.items():
        print(f"{'--python-allocators ' + mode:20} {m['tests']:6} {m['empty']:6} "
              f"{m['allocations']:12,} {cap:10.1f} {proc:10.1f}")
    (_, c0, p0), (_, c1, p1) = rows["off"], rows["on"]
    print(f"on / off: capture {c1 / c0:.1f}x, process {p1 / p0:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--suite", action="store_true", help="also fixtures/pysuite, off and on")
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
        if args.suite:
            suite(out)
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
