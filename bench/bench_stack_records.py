"""Stack records end to end, through the command line: records per allocation, capture
and process time, and how many allocations have a complete stack (reaching _start),
with default options, on Debian's sqlite3 (100 k inserts, one statement each), a C++
std::map program built -O2 -g (fixtures/stacks/cxxmap.cc, 1.68 M allocations) and the
Python loop of issue 13 (/usr/bin/python3, PYTHONMALLOC=malloc, 1 M iterations).

Run as root: .venv/bin/python bench/bench_stack_records.py [--quick] [--before DIR]
--before DIR runs the same with the memtrack source tree in DIR too (e.g. an export of
an earlier commit: `git archive main | tar -x -C DIR`), side by side, in this run.
Times are wall seconds of `memtrack capture` (compile and attach included; the
session's own seconds, from spawn to the artifact closed, in parentheses) and of
`memtrack process`.
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

from conftest import build  # noqa: E402

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


def memtrack(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`memtrack ARGS` from a source tree: run in it, `-m` finds its package first."""
    return subprocess.run([sys.executable, "-m", "memtrack.cli", *args], text=True,
                          capture_output=True, cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)})


def run(tree: Path, name: str, cmd: list[str], tmp: Path) -> dict[str, Any]:
    art, db = tmp / f"{name}.memtrack", tmp / f"{name}.duckdb"
    t0 = time.monotonic()
    r = memtrack(tree, "capture", "-o", str(art), "--force", "--", *cmd)
    capture_s = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"capture of {name} failed: {r.stderr[-500:]}")
    manifest = json.loads((art / "manifest.json").read_text())
    session_s = (manifest["end_ns"] - manifest["start_ns"]) / 1e9
    lost = {k: v for k, v in manifest["losses"].items() if v}
    t0 = time.monotonic()
    r = memtrack(tree, "process", str(art), "-o", str(db))
    process_s = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"process of {name} failed: {r.stderr[-500:]}")
    q = memtrack(tree, "query", str(db), QUERY, "--format", "json")
    allocs, complete, records = json.loads(q.stdout)[0].values()
    shutil.rmtree(art, ignore_errors=True)
    db.unlink(missing_ok=True)
    return {"allocs": allocs, "records": records, "complete": complete,
            "capture_s": capture_s, "session_s": session_s, "process_s": process_s,
            "lost": lost}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a tenth of the work")
    ap.add_argument("--before", type=Path, help="another memtrack source tree to compare")
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
        }
        trees = {"this": ROOT} | ({"before": args.before.resolve()} if args.before else {})
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for wname, cmd in workloads.items():
            for label, tree in trees.items():
                print(f"# {wname} with {label} ...", file=sys.stderr, flush=True)
                rows[(wname, label)] = run(tree, f"{wname}-{label}", cmd, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'workload':<9} {'tree':<7} {'allocations':>11} {'records':>9} {'per alloc':>9} "
          f"{'complete':>8} {'capture s':>16} {'process s':>9}  lost")
    for (wname, label), r in rows.items():
        per = r["records"] / r["allocs"] if r["allocs"] else 0.0
        done = r["complete"] / r["allocs"] if r["allocs"] else 0.0
        cap = f"{r['capture_s']:.1f} ({r['session_s']:.1f})"
        print(f"{wname:<9} {label:<7} {r['allocs']:>11,} {r['records']:>9,} {per:>9.4f} "
              f"{done:>8.2%} {cap:>16} {r['process_s']:>9.1f}  {r['lost'] or ''}")
    if args.before:
        for wname in workloads:
            a, b = rows[(wname, "this")], rows[(wname, "before")]
            print(f"{wname}: records {a['records'] / max(b['records'], 1):.4f}x, capture "
                  f"session {a['session_s'] / b['session_s']:.2f}x, process "
                  f"{a['process_s'] / b['process_s']:.2f}x of before")


if __name__ == "__main__":
    main()
