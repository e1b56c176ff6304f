"""A run dataset at fleet size: appending a run costs the same whatever the runs already
there (no earlier partition is read or rewritten), and what reading it costs.

    .venv/bin/python bench/bench_dataset.py [--runs 1000] [--appends 15]

Two datasets of one small synthetic run (tests/support/runs.py: two benchmarks, 10
events): one of 9 runs, one of `--runs` - 1 (the run appended once, its files copied
to the other run ids: the same layout an append of each would leave). Then
`--appends` runs are appended to each, alternately (the same machine load for both),
and the medians printed: the 10th run's append against the 1000th's (and on), with
the ratio. Then `history --last 20` and a `query --dataset` over every run, on each.
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


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def populate(ds: Path, db: Path, runs: int) -> None:
    """`runs` runs: the first appended, its files copied for the others."""
    from memtrack.process.dataset import append_run

    append_run(ds, "run00000", db)
    for table in ds.iterdir():
        for i in range(1, runs):
            shutil.copytree(table / "run=run00000", table / f"run=run{i:05d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--appends", type=int, default=15)
    args = ap.parse_args()
    if args.runs < 20:
        raise SystemExit("--runs: at least 20")

    from support.runs import write_bench_run

    from memtrack.commands import history, query
    from memtrack.process.dataset import append_run

    tmp = Path(tempfile.mkdtemp(prefix="bench-dataset-"))
    try:
        db = write_bench_run(tmp / "run.duckdb", 1024)
        small, big = tmp / "small", tmp / "big"
        populate(small, db, 9)
        populate(big, db, args.runs - 1)
        times: dict[Path, list[float]] = {small: [], big: []}
        for k in range(args.appends):
            for ds in (small, big):
                times[ds].append(timed(lambda ds=ds, k=k: append_run(ds, f"new{k:03d}", db)))
        early, late = statistics.median(times[small]), statistics.median(times[big])
        n_small, n_big = 9 + args.appends, args.runs - 1 + args.appends
        print(f"append (median of {args.appends}, alternately): runs 10-{n_small} "
              f"{early * 1000:.1f} ms, runs {args.runs}-{n_big} {late * 1000:.1f} ms: "
              f"ratio {late / early:.2f}")
        files = sum(1 for _ in big.rglob("*.parquet"))
        print(f"dataset: {n_big} runs, {files} files, "
              f"{sum(p.stat().st_size for p in big.rglob('*.parquet')) / 2**20:.1f} MiB")
        for what, fn in (
                ("history --last 20", lambda ds: history.run(ds, fmt="json", last=20,
                                                             out=io.StringIO())),
                ("query --dataset over every run", lambda ds: query.run(
                    ["SELECT count(*) FROM allocations"], "csv", io.StringIO(), ds))):
            a, b = timed(lambda fn=fn: fn(small)), timed(lambda fn=fn: fn(big))
            print(f"{what}: {a:.2f} s at {n_small} runs, {b:.2f} s at {n_big} "
                  f"(ratio {b / a:.2f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
