"""Time `memtrack diff` and the run dataset on two captures of the Python allocation loop
(fixtures/demo/workload.py under PYTHONMALLOC=malloc, the head with 10 % more rounds).

    .venv/bin/python bench/bench_diff.py [BASE.memtrack HEAD.memtrack] [--rounds N]

Without artifacts it captures the two runs first (root). Every figure is printed next to
a baseline measured in the same run: the report of one run (`memtrack report`, which
reads it through the same reader) for the diff, `process` into a database for the
dataset append, the same SQL over the run databases for `query --dataset`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MEMTRACK = str(Path(sys.executable).with_name("memtrack"))
TOTALS_SQL = """SELECT {run} count(*), sum(size), count(*) FILTER (WHERE temporary)
                FROM allocations {group}"""


def capture(out: Path, rounds: dict[str, int]) -> dict[str, Path]:
    from memtrack.capture.options import CaptureOptions
    from memtrack.capture.tracker import Tracker

    arts = {}
    with Tracker(CaptureOptions(stacks=True, rss=True)) as t:
        for name, n in rounds.items():
            art = out / f"{name}.memtrack"
            cmd = [sys.executable, str(ROOT / "fixtures/demo/workload.py"), str(n)]
            result = t.spawn(cmd, art, env={**os.environ, "PYTHONMALLOC": "malloc"}).wait(
                timeout=1800)
            print(f"{name}: captured {result.events} events in {result.duration_s:.2f}s, "
                  f"losses {result.nonzero_losses() or 'none'}")
            arts[name] = art
    return arts


def best(fn: Callable[[], object], rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cli(*args: str) -> float:
    """Seconds of one memtrack command line, start-up included (best of three)."""
    def run() -> None:
        r = subprocess.run([MEMTRACK, *args], capture_output=True, text=True)
        if r.returncode not in (0, 1):
            raise SystemExit(f"memtrack {' '.join(args)}: {r.stderr.strip()}")
    return best(run)


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="*", type=Path)
    ap.add_argument("--rounds", type=int, default=20000)
    args = ap.parse_args()
    if len(args.artifacts) not in (0, 2):
        raise SystemExit("give BASE.memtrack HEAD.memtrack, or nothing to capture both")

    from memtrack.process.dataset import append_run
    from memtrack.process.pipeline import process
    from memtrack.report.diff import DiffOptions, Side, diff_data
    from memtrack.report.reader import RunReader
    from memtrack.report.text import ReportOptions, report_data
    from memtrack.schema.dataset import open_dataset, open_dataset_run
    from memtrack.schema.ddl import open_run

    with tempfile.TemporaryDirectory(prefix="bench-diff-") as d:
        tmp = Path(d)
        arts = dict(zip(("base", "head"), args.artifacts, strict=True)) if args.artifacts \
            else capture(tmp, {"base": args.rounds, "head": args.rounds * 11 // 10})
        ds = tmp / "dataset"
        print(f"\n{'dataset append':<28}{'seconds':>10}{'x process':>11}{'MiB':>8}"
              f"{'x db':>7}")
        for name, art in arts.items():
            db = tmp / f"{name}.duckdb"
            t0 = time.perf_counter()
            s = process(art, db, progress=False)
            sec_process = time.perf_counter() - t0
            t0 = time.perf_counter()
            append_run(ds, name, db, force=True)
            sec = time.perf_counter() - t0
            part = sum(size(p) for p in ds.glob(f"*/run={name}"))
            label = f"{name} ({s.events} events)"
            print(f"{label:<28}{sec:>10.3f}{sec / sec_process:>11.2f}{part / 2**20:>8.1f}"
                  f"{part / size(db):>7.2f}")

        cons = {k: open_run(tmp / f"{k}.duckdb") for k in arts}
        dcons = {k: open_dataset_run(ds, k) for k in arts}
        report = best(lambda: report_data(cons["base"], ReportOptions()))
        print(f"\n{'diff (in process)':<28}{'seconds':>10}{'x report':>10}")
        print(f"{'report of base (baseline)':<28}{report:>10.3f}{1:>10.2f}")
        for label, c in (("diff of databases", cons), ("diff of dataset runs", dcons)):
            sec = best(lambda c=c: diff_data(Side("base", RunReader(c["base"])),
                                             Side("head", RunReader(c["head"])),
                                             DiffOptions()))
            print(f"{label:<28}{sec:>10.3f}{sec / report:>10.2f}")
        sec = best(lambda: report_data(dcons["base"], ReportOptions()))
        print(f"{'report of a dataset run':<28}{sec:>10.3f}{sec / report:>10.2f}")

        per_db = best(lambda: [c.execute(TOTALS_SQL.format(run="", group="")).fetchall()
                               for c in cons.values()])
        con = open_dataset(ds)
        across = best(lambda: con.execute(TOTALS_SQL.format(
            run="run,", group="GROUP BY run")).fetchall())
        print(f"\n{'per-run totals by SQL':<28}{'seconds':>10}{'x dbs':>10}")
        print(f"{'each run database':<28}{per_db:>10.3f}{1:>10.2f}")
        print(f"{'one query over the dataset':<28}{across:>10.3f}{across / per_db:>10.2f}")

        base, head = str(tmp / "base.duckdb"), str(tmp / "head.duckdb")
        rep = cli("report", base, "--format", "json")
        print(f"\n{'command line (start-up incl.)':<30}{'seconds':>8}{'x report':>10}")
        print(f"{'memtrack report base':<30}{rep:>8.2f}{1:>10.2f}")
        for label, argv in (
            ("memtrack diff base head", ["diff", base, head, "--fail-above", "5"]),
            ("memtrack diff --dataset", ["diff", "--dataset", str(ds), "base", "head"]),
            ("memtrack diff --format markdown", ["diff", base, head, "--format", "markdown"]),
        ):
            sec = cli(*argv)
            print(f"{label:<30}{sec:>8.2f}{sec / rep:>10.2f}")


if __name__ == "__main__":
    main()
