"""Stack records end to end, through the command line: records per allocation, capture
and process time, and how many allocations have a complete stack (reaching _start),
with default options, on Debian's sqlite3 (100 k inserts, one statement each), a C++
std::map program built -O2 -g (fixtures/stacks/cxxmap.cc, 1.68 M allocations) and the
Python loop of issue 13 (/usr/bin/python3, PYTHONMALLOC=malloc, 1 M iterations), and
issue 34's case: a toolz-like pytest suite (fixtures/pysuite, 195 tests) captured with
the memtrack.pytest plugin, with the default pymalloc and with PYTHONMALLOC=malloc,
whose records are also set against the distinct Python call paths and the distinct
call paths (native and Python frames) of its allocations.

Run as root: .venv/bin/python bench/bench_stack_records.py [--quick] [--before DIR]
    [--only NAME,...]
--before DIR runs the same with the memtrack source tree in DIR too (e.g. an export of
an earlier commit: `git archive main | tar -x -C DIR`), side by side, in this run, and
prints this tree's figures as ratios of DIR's. --only runs some workloads (sqlite3,
cxxmap, python, pysuite, pysuite-malloc). Times are wall seconds of `memtrack capture`
(compile and attach included; the session's own seconds, from spawn to the artifact
closed, in parentheses) and of `memtrack process`; peak RSS is the largest sum of the
resident sets of `memtrack process` and its workers, sampled every 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_scale import tree_rss_mib  # noqa: E402
from conftest import build  # noqa: E402
from support.pysuite import (  # noqa: E402
    PYTHON,
    SUITE_ENV,
    call_paths,
    clear_bytecode,
    memtrack,
    suite_command,
)

PY_LOOP = """import sys
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000000
keep = []
for i in range(n):
    d = {"a": i, "b": [i, i + 1]}
    l = [d, str(i)]
    if i % 1000 == 0:
        keep.append(l)
print(len(keep))
"""
QUERY = """SELECT count(*), count(*) FILTER (WHERE s.complete),
                  (SELECT count(*) FROM stacks)
           FROM allocations a LEFT JOIN stacks s USING (stack_id)"""


def process(tree: Path, art: Path, db: Path) -> tuple[float, float]:
    """(seconds, peak MiB of the process tree) of `memtrack process` from `tree`."""
    t0 = time.monotonic()
    p = subprocess.Popen([PYTHON, "-m", "memtrack.cli", "process", str(art), "-o", str(db)],
                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while p.poll() is None:
        peak = max(peak, tree_rss_mib(p.pid))
        time.sleep(0.05)
    if p.returncode:
        raise RuntimeError(f"process of {art} failed: {p.stderr.read()[-500:]}")  # type: ignore[union-attr]
    return time.monotonic() - t0, peak


def run(tree: Path, name: str, cmd: list[str], tmp: Path, env: dict[str, str],
        paths: bool) -> dict[str, Any]:
    art, db = tmp / f"{name}.memtrack", tmp / f"{name}.duckdb"
    t0 = time.monotonic()
    r = memtrack("capture", "-o", str(art), "--force", "--", *cmd, tree=tree, env=env)
    capture_s = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"capture of {name} failed: {r.stderr[-500:]}")
    manifest = json.loads((art / "manifest.json").read_text())
    session_s = (manifest["end_ns"] - manifest["start_ns"]) / 1e9
    lost = {k: v for k, v in manifest["losses"].items() if v}
    process_s, rss_mib = process(tree, art, db)
    q = memtrack("query", str(db), QUERY, "--format", "json", tree=tree)
    allocs, complete, records = json.loads(q.stdout)[0].values()
    out = {"allocs": allocs, "records": records, "complete": complete,
           "capture_s": capture_s, "session_s": session_s, "process_s": process_s,
           "rss_mib": rss_mib, "db_mib": db.stat().st_size / 2**20, "lost": lost}
    if paths:
        p = call_paths(db, tree)
        out |= {"python_paths": p.python_paths, "paths": p.paths}
    shutil.rmtree(art, ignore_errors=True)
    db.unlink(missing_ok=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a tenth of the work")
    ap.add_argument("--before", type=Path, help="another memtrack source tree to compare")
    ap.add_argument("--only", help="workloads to run, comma-separated")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_stack_records: needs root (bcc)")
    scale = 10 if args.quick else 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-stack-records-"))
    try:
        sql = tmp / "ins.sql"
        sql.write_text("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);\nBEGIN;\n"
                       + "".join(f"INSERT INTO t(name, v) VALUES ('name-{i * 7919 % 100003}',"
                                 f" {i}.5);\n" for i in range(100_000 // scale))
                       + "COMMIT;\n")
        loop = tmp / "pyloop.py"
        loop.write_text(PY_LOOP)
        cxxmap = build(["stacks/cxxmap.cc"], flags=("-O2", "-g"))
        workloads = {
            "sqlite3": ["/usr/bin/sqlite3", "-init", str(sql), ":memory:", ".quit"],
            "cxxmap": [str(cxxmap), str(100_000 // scale), "3"],
            "python": ["env", "PYTHONMALLOC=malloc", str(Path("/usr/bin/python3").resolve()),
                       str(loop), str(1_000_000 // scale)],
            "pysuite": suite_command(),
            "pysuite-malloc": suite_command(),
        }
        envs = {"pysuite": SUITE_ENV, "pysuite-malloc": SUITE_ENV | {"PYTHONMALLOC": "malloc"}}
        if args.only:
            workloads = {k: v for k, v in workloads.items() if k in args.only.split(",")}
        trees = {"this": ROOT} | ({"before": args.before.resolve()} if args.before else {})
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        failed: dict[tuple[str, str], str] = {}
        for wname, cmd in workloads.items():
            for label, tree in trees.items():
                print(f"# {wname} with {label} ...", file=sys.stderr, flush=True)
                if wname.startswith("pysuite"):
                    clear_bytecode()
                try:
                    rows[(wname, label)] = run(tree, f"{wname}-{label}", cmd, tmp,
                                               envs.get(wname, {}), wname.startswith("pysuite"))
                except RuntimeError as e:  # printed, and the other workloads go on
                    failed[(wname, label)] = str(e).splitlines()[-1]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'workload':<14} {'tree':<7} {'allocations':>11} {'records':>9} {'per alloc':>9} "
          f"{'complete':>8} {'capture s':>16} {'process s':>9} {'RSS MiB':>7} {'db MiB':>7}  lost")
    for (wname, label), r in rows.items():
        per = r["records"] / r["allocs"] if r["allocs"] else 0.0
        done = r["complete"] / r["allocs"] if r["allocs"] else 0.0
        cap = f"{r['capture_s']:.1f} ({r['session_s']:.1f})"
        print(f"{wname:<14} {label:<7} {r['allocs']:>11,} {r['records']:>9,} {per:>9.4f} "
              f"{done:>8.2%} {cap:>16} {r['process_s']:>9.1f} {r['rss_mib']:>7.0f} "
              f"{r['db_mib']:>7.1f}  {r['lost'] or ''}")
        if "paths" in r:
            print(f"{'':<14} {label:<7} Python call paths {r['python_paths']:,}, call paths "
                  f"{r['paths']:,}: records {r['records'] / max(r['python_paths'], 1):.2f}x "
                  f"and {r['records'] / max(r['paths'], 1):.2f}x of them")
    for (wname, label), why in failed.items():
        print(f"{wname:<14} {label:<7} failed: {why}")
    if args.before:
        for wname in workloads:
            if (wname, "this") not in rows or (wname, "before") not in rows:
                continue
            a, b = rows[(wname, "this")], rows[(wname, "before")]
            print(f"{wname}: records {a['records'] / max(b['records'], 1):.4f}x, capture "
                  f"session {a['session_s'] / b['session_s']:.2f}x, process "
                  f"{a['process_s'] / b['process_s']:.2f}x, process peak RSS "
                  f"{a['rss_mib'] / b['rss_mib']:.2f}x, database "
                  f"{a['db_mib'] / b['db_mib']:.2f}x of before")


if __name__ == "__main__":
    main()
