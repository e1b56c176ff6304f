"""A run dataset at fleet size: appending a run costs the same whatever the runs already
there (no earlier partition is read or rewritten), and what reading it costs.

    .venv/bin/python bench/bench_dataset.py [--runs 1000] [--keep DIR]

Appends `--runs` copies of one small synthetic run (tests/support/runs.py: two
benchmarks, 10 events) to a new dataset and prints the append's time around the 10th
run against around the last (medians of 10 appends each), with the ratio; then
`history --last 20` and a `query --dataset` over every run at that size against the
same at 20 runs.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WINDOW = 10  # appends per median


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--keep", type=Path, help="Leave the dataset here.")
    args = ap.parse_args()
    if args.runs < 3 * WINDOW:
        raise SystemExit(f"--runs: at least {3 * WINDOW}")

    from support.runs import write_bench_run

    from memtrack.commands import history, query
    from memtrack.process.dataset import append_run

    tmp = Path(tempfile.mkdtemp(prefix="bench-dataset-"))
    try:
        db = write_bench_run(tmp / "run.duckdb", 1024)
        ds = args.keep or tmp / "ds"
        times = []
        reads = {}

        def read(label: str) -> None:
            reads[label] = (
                timed(lambda: history.run(ds, fmt="json", last=20, out=io.StringIO())),
                timed(lambda: query.run(["SELECT count(*) FROM allocations"], "csv",
                                        io.StringIO(), ds)))

        for i in range(1, args.runs + 1):
            times.append(timed(lambda i=i: append_run(ds, f"run{i:05d}", db)))
            if i == 20:
                read("20")
            if i % 100 == 0:
                print(f"{i} runs: last append {times[-1] * 1000:.0f} ms", flush=True)
        read(str(args.runs))
        early = statistics.median(times[5:5 + WINDOW])  # appends 6-15: around the 10th
        late = statistics.median(times[-WINDOW:])
        files = sum(1 for p in ds.rglob("*.parquet"))
        print(f"append: around the 10th run {early * 1000:.1f} ms, around the "
              f"{args.runs}th {late * 1000:.1f} ms: ratio {late / early:.2f}")
        print(f"dataset: {args.runs} runs, {files} files, "
              f"{sum(p.stat().st_size for p in ds.rglob('*.parquet')) / 2**20:.1f} MiB")
        h20, q20 = reads["20"]
        hn, qn = reads[str(args.runs)]
        print(f"history --last 20: {h20:.2f} s at 20 runs, {hn:.2f} s at {args.runs} "
              f"(ratio {hn / h20:.2f})")
        print(f"query --dataset over every run: {q20:.2f} s at 20 runs, {qn:.2f} s at "
              f"{args.runs} (ratio {qn / q20:.2f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
