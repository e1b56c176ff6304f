"""Time `memtrack process` per stage, and the report queries, on a capture of the Python
allocation loop (fixtures/demo/workload.py under PYTHONMALLOC=malloc, >= 1 M events).

    .venv/bin/python bench/bench_process.py [ARTIFACT] [--rounds N] [--no-stacks]

Without ARTIFACT it captures the loop first (root). Every figure is printed next to a
baseline measured in the same run: reading events.arrow and sorting it by time, the
least any processing must do.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memtrack.schema import table_file  # noqa: E402


def capture_workload(out: Path, rounds: int, stacks: bool) -> Path:
    from memtrack.capture.parts import CaptureOptions
    from memtrack.capture.tracker import Tracker

    art = out / "workload.memtrack"
    cmd = [sys.executable, str(ROOT / "fixtures/demo/workload.py"), str(rounds)]
    with Tracker(CaptureOptions(stacks=stacks, rss=True)) as t:
        session = t.spawn(cmd, art, env={**os.environ, "PYTHONMALLOC": "malloc"})
        result = session.wait(timeout=1800)
    print(f"captured {result.events} events in {result.duration_s:.2f}s, "
          f"losses {result.nonzero_losses() or 'none'}")
    return art


def baseline(art: Path) -> float:
    t0 = time.perf_counter()
    tbl = pa.ipc.open_stream(pa.memory_map(str(art / table_file("events")))).read_all()
    np.argsort(tbl.column("ts").to_numpy(), kind="stable")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", nargs="?", type=Path)
    ap.add_argument("--rounds", type=int, default=40000)
    ap.add_argument("--no-stacks", action="store_true")
    args = ap.parse_args()

    from memtrack.process.export import costs, pprof
    from memtrack.process.html import page_data
    from memtrack.process.pipeline import process
    from memtrack.process.report import ReportOptions, report_data
    from memtrack.schema.ddl import open_run

    with tempfile.TemporaryDirectory(prefix="bench-process-") as d:
        tmp = Path(d)
        art = args.artifact or capture_workload(tmp, args.rounds, not args.no_stacks)
        base = min(baseline(art) for _ in range(3))
        t0 = time.perf_counter()
        s = process(art, tmp / "run.duckdb", progress=False)
        total = time.perf_counter() - t0
        print(f"\n{s.events} events, {s.allocations} allocations, {s.stacks} stacks")
        print(f"baseline (read events.arrow + sort by ts): {base * 1e3:.1f} ms "
              f"({s.events / base / 1e6:.1f} M events/s)")
        print(f"{'stage':<12}{'seconds':>10}{'x baseline':>12}{'share':>8}")
        for name, sec in s.timings.items():
            print(f"{name:<12}{sec:>10.3f}{sec / base:>12.1f}{100 * sec / total:>7.1f}%")
        print(f"{'process':<12}{total:>10.3f}{total / base:>12.1f}   "
              f"({s.events / total / 1e3:.0f} k events/s)")
        con = open_run(tmp / "run.duckdb")
        print(f"\n{'query':<24}{'seconds':>10}{'x baseline':>12}")
        for name, fn in (
            ("report (text/json)", lambda: report_data(con, ReportOptions())),
            ("report --pid root", lambda: report_data(con, ReportOptions(pid=int(
                con.execute("SELECT value FROM meta WHERE key = 'root_pid'").fetchone()[0])))),
            ("export pprof", lambda: pprof(costs(con))),
            ("html page data", lambda: page_data(con, ReportOptions())),
        ):
            t = time.perf_counter()
            fn()
            sec = time.perf_counter() - t
            print(f"{name:<24}{sec:>10.3f}{sec / base:>12.1f}")
        con.close()


if __name__ == "__main__":
    main()
