"""Time `memtrack process` per stage, and the report queries, on a capture of the Python
allocation loop (fixtures/demo/workload.py under PYTHONMALLOC=malloc, >= 1 M events).

    .venv/bin/python bench/bench_process.py [ARTIFACT] [--rounds N] [--no-stacks] [--memory]

Without ARTIFACT it captures the loop first (root). Every figure is printed next to a
baseline measured in the same run: reading events.arrow and sorting it by time, the
least any processing must do.

--memory: the peak RSS and time of `process` in a fresh process each, decoding and
unwinding the stack records in runs of the default size against all of them in one run
(what process did before it went run by run), and a checksum of the tables each wrote.
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
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memtrack.schema import table_file  # noqa: E402


def capture_workload(out: Path, rounds: int, stacks: bool) -> Path:
    from memtrack.capture.options import CaptureOptions
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


CHECKSUMS = {
    "stacks": "SELECT count(*), sum(hash(stack_id, stack_hash, pid, depth, truncated, "
              "complete, stop)) FROM stacks",
    "stack_frames": "SELECT count(*), sum(hash(stack_id, depth, address, module_id, method, "
                    "lookup_vaddr, frame_id)) FROM stack_frames",
    "frames": "SELECT count(*), sum(hash(frame_id, inline_depth, name, file, line, "
              "module_id, vaddr)) FROM frames",
    "allocations": "SELECT count(*), sum(hash(alloc_id, size, ts, free_ts, stack_id)) "
                   "FROM allocations",
}

_RUN = """
import sys, time
from memtrack.process.pipeline import process
t0 = time.perf_counter()
process(sys.argv[1], sys.argv[2], progress=False, piece_bytes=int(sys.argv[3]))
print(time.perf_counter() - t0)
"""


def peak_run(art: Path, out: Path, piece_bytes: int) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of `process` in a process of its own."""
    p = subprocess.Popen([sys.executable, "-c", _RUN, str(art), str(out), str(piece_bytes)],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout is not None
    sec = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"process (piece_bytes={piece_bytes}) failed: {p.returncode}")
    return float(sec), usage.ru_maxrss / 1024


def memory(art: Path, tmp: Path) -> None:
    from memtrack.process.decode import DEFAULT_MAX_BYTES
    from memtrack.schema.ddl import open_run

    runs = {"one run (all records)": 1 << 62, "default runs": DEFAULT_MAX_BYTES}
    got = {}
    print(f"\n{'decode + unwind in':<24}{'seconds':>10}{'peak MiB':>10}{'x one run':>11}")
    for name, size in runs.items():
        sec, mib = peak_run(art, tmp / f"{size}.duckdb", size)
        got[name] = (sec, mib)
        one = got["one run (all records)"][1]
        print(f"{name:<24}{sec:>10.2f}{mib:>10.0f}{mib / one:>11.2f}")
    sums = []
    for size in runs.values():
        con = open_run(tmp / f"{size}.duckdb")
        sums.append({t: con.execute(q).fetchone() for t, q in CHECKSUMS.items()})
        con.close()
    for t in CHECKSUMS:
        print(f"{t:<14} rows {sums[0][t][0]:>9}  checksum {sums[0][t][1]:>22}  "
              f"{'same' if sums[0][t] == sums[1][t] else 'DIFFERENT: ' + str(sums[1][t])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", nargs="?", type=Path)
    ap.add_argument("--rounds", type=int, default=40000)
    ap.add_argument("--no-stacks", action="store_true")
    ap.add_argument("--memory", action="store_true",
                    help="peak RSS of process with runs of the default size vs one run")
    args = ap.parse_args()

    from memtrack.process.pipeline import process
    from memtrack.report import pprof
    from memtrack.report.html import page_data
    from memtrack.report.reader import RunReader
    from memtrack.report.text import ReportOptions, report_data
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
            ("export pprof", lambda: pprof.render(RunReader(con), "allocated")),
            ("html page data", lambda: page_data(con, ReportOptions())),
        ):
            t = time.perf_counter()
            fn()
            sec = time.perf_counter() - t
            print(f"{name:<24}{sec:>10.3f}{sec / base:>12.1f}")
        con.close()
        if args.memory:
            memory(art, tmp)


if __name__ == "__main__":
    main()
