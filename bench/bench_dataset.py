"""A run dataset at fleet size: appending a run costs the same whatever the runs already
there (no earlier partition is read or rewritten), what reading it costs, and what
`compact` changes.

    .venv/bin/python bench/bench_dataset.py [--runs 1000] [--appends 15]

Two datasets of one small synthetic run (tests/support/runs.py: two benchmarks, 10
events): one of 9 runs, one of `--runs` - 1 (the run appended once, its files copied
to the other run ids: the same layout an append of each would leave). Then
`--appends` runs are appended to each, alternately (the same machine load for both),
and the medians printed: the 10th run's append against the 1000th's (and on), with
the ratio. Then `history --last 20` and a `query --dataset` over every run, on each;
the query also as memtrack read a dataset before it read one schema per run database
format (the baseline: every file's schema read), with the ratio. Then the large
dataset compacted: the query, history and an append again, each against the same
before compaction.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


@contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


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


def every_schema() -> object:
    """The baseline reader: Listing.files reading every file's schema (as memtrack did
    before it read one per run database format), the rest as it is."""
    from memtrack.schema.dataset import Listing, file_schema

    files = Listing.files

    def read_all(self: Listing, tf: object, ids: list[str], compacted: bool = True) -> object:
        found, _ = files(self, tf, ids, compacted)  # type: ignore[arg-type]
        return found, [file_schema(f, self.fs) for f in found]

    return read_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--appends", type=int, default=15)
    args = ap.parse_args()
    if args.runs < 20:
        raise SystemExit("--runs: at least 20")

    from support.runs import write_bench_run

    from memtrack.commands import history, query
    from memtrack.process.dataset import append_run, compact

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
        def hist(ds: Path) -> None:
            history.run(ds, fmt="json", last=20, out=io.StringIO())

        def count(ds: Path) -> None:
            query.run(["SELECT count(*) FROM allocations"], "csv", io.StringIO(), ds)

        for what, fn in (("history --last 20", hist), ("query --dataset over every run", count)):
            a, b = timed(lambda fn=fn: fn(small)), timed(lambda fn=fn: fn(big))
            print(f"{what}: {a:.2f} s at {n_small} runs, {b:.2f} s at {n_big} "
                  f"(ratio {b / a:.2f})")
        from memtrack.schema.dataset import Listing

        now = {ds: timed(lambda ds=ds: count(ds)) for ds in (small, big)}
        with patched(Listing, "files", every_schema()):
            then = {ds: timed(lambda ds=ds: count(ds)) for ds in (small, big)}
        for ds, n in ((small, n_small), (big, n_big)):
            print(f"query --dataset at {n} runs: {now[ds]:.2f} s, every file's schema read "
                  f"(before) {then[ds]:.2f} s: ratio {then[ds] / now[ds]:.2f}")
        files_before = sum(1 for _ in big.rglob("*.parquet"))
        q_before, h_before = timed(lambda: count(big)), timed(lambda: hist(big))
        took = timed(lambda: compact(big))
        files_after = sum(1 for _ in big.rglob("*.parquet"))
        print(f"compact: {n_big} runs, {files_before} files -> {files_after} in {took:.2f} s")
        q_after, h_after = timed(lambda: count(big)), timed(lambda: hist(big))
        print(f"query --dataset over every run: {q_before:.2f} s before compact, "
              f"{q_after:.2f} s after (ratio {q_after / q_before:.2f}); history --last 20: "
              f"{h_before:.2f} s, {h_after:.2f} s (ratio {h_after / h_before:.2f})")
        times = {small: [], big: []}
        for k in range(args.appends):
            for ds in (small, big):
                times[ds].append(timed(lambda ds=ds, k=k: append_run(ds, f"late{k:03d}", db)))
        early, late = statistics.median(times[small]), statistics.median(times[big])
        print(f"append after compact (median of {args.appends}, alternately): by run "
              f"{early * 1000:.1f} ms, compacted ({n_big} runs) {late * 1000:.1f} ms: "
              f"ratio {late / early:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
