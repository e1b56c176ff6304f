"""`memtrack process` at scale, through the command line: time and peak RSS against the
number of events (synthetic artifacts of bench/synth_artifact.py, 100 k distinct stacks),
jobs 1 against jobs 2 (speed-up, and a checksum of every table each wrote, printed as one
digest to compare with a run of another source tree), and the
issue's targets side by side; with --captures, also the captures the issue names (the
demo's Python workload, the C++ std::map program, sqlite3 at the issue's size: 33 k
inserts, ~730 k allocations) and sqlite3 with 300 k inserts (~6.6 M allocations).

    .venv/bin/python bench/bench_scale.py [--events 1M,10M] [--stacks 100k] [--big]
        [--captures] [--keep DIR] [--rss-cap MiB] [--no-warm] [--busy] [--hot N]

--big adds the 50 M case (run it alone: ~6 GB of disk for the artifact and the run
database, ~4 GB more for the spill while it runs, and minutes of both cores); --rss-cap
kills a run whose process tree goes over it; --busy runs everything beside two CPU-bound
processes (a CI runner's lot), the baselines too.
Every time is printed with its ratio to a baseline measured in the same run: reading
events.arrow and sorting it by time, the least any processing must do. Peak RSS is the
largest sum of the resident sets of `memtrack process` and its workers, sampled every
50 ms. The symbol and CFI caches are warmed by one unmeasured run first (every size has
the same stacks). The machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from synth_artifact import count, generate  # noqa: E402

from memtrack.schema import table_file  # noqa: E402

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
TARGETS = {"synthetic 10M": (60.0, 2048.0), "python demo": (8.0, None),
           "cxxmap": (15.0, None), "sqlite3": (15.0, None)}
SQLITE_INSERTS = {"sqlite3": 33_000, "sqlite3 300k": 300_000}


def tree_rss_mib(pid: int) -> float:
    """Resident MiB of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


class Capped(Exception):
    """The process tree went over --rss-cap and was killed."""


def run_process(art: Path, db: Path, jobs: int | None, cap_mib: float | None = None
                ) -> tuple[float, float, dict[str, float], str]:
    """(seconds, peak MiB, stage seconds, its summary's first line) of `memtrack process`
    from the shell; killed (Capped) when its tree's RSS goes over cap_mib."""
    cmd = [*MEMTRACK, "process", str(art), "-o", str(db), "--force"]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                         cwd=ROOT, start_new_session=True)
    peak = 0.0
    while p.poll() is None:
        peak = max(peak, tree_rss_mib(p.pid))
        if cap_mib and peak > cap_mib:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise Capped(f"over {cap_mib:.0f} MiB after {time.perf_counter() - t0:.0f} s")
        time.sleep(0.05)
    sec = time.perf_counter() - t0
    err = p.stderr.read() if p.stderr else ""
    if p.returncode:
        raise SystemExit(f"process {art} failed ({p.returncode}): {err[-800:]}")
    m = re.search(r"stages: (.*)", err)
    stages = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)s", m.group(1))} if m else {}
    counts = re.search(r"(\d+) events, (\d+) allocations", err)
    said = f"{int(counts[1]):,} events, {int(counts[2]):,} allocations" if counts else ""
    return sec, peak, stages, said


def baseline(art: Path) -> float:
    t0 = time.perf_counter()
    tbl = pa.ipc.open_stream(pa.memory_map(str(art / table_file("events")))).read_all()
    np.argsort(tbl.column("ts").to_numpy(), kind="stable")
    return time.perf_counter() - t0


def checksums(db: Path) -> dict[str, tuple]:
    import duckdb

    from memtrack.schema.ddl import DERIVED_NAMES, TABLE_NAMES

    con = duckdb.connect(str(db), read_only=True)
    out = {name: con.execute(
        f"SELECT count(*), sum(hash(t) * (n + 1)) FROM (SELECT t, row_number() OVER () AS n "
        f"FROM {name} t {'WHERE key <> ' + repr('artifact') if name == 'meta' else ''})"
    ).fetchone() for name in ("meta", *TABLE_NAMES, *DERIVED_NAMES)}
    con.close()
    return out


def digest(sums: dict[str, tuple]) -> str:
    """One short digest of every table's checksum: equal digests from two runs (another
    source tree, before and after a change) mean the same tables."""
    return hashlib.sha256(repr(sorted(sums.items())).encode()).hexdigest()[:16]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def hot_artifact(path: Path, n: int) -> None:
    """n events of one thread's malloc(16)/free loop that gets one address every time."""
    from support import synth

    from memtrack.schema import EVENTS

    i = np.arange(n)
    kind = np.where(i % 2 == 0, 1, 5).astype(np.uint8)
    synth.write_artifact(path, pa.table({
        "ts": (1000 + i).astype(np.uint64), "pid": np.full(n, 100, np.uint32),
        "tid": np.full(n, 100, np.uint32), "kind": kind, "allocator": np.ones(n, np.uint8),
        "flags": np.zeros(n, np.uint64), "addr": np.full(n, 0x5000, np.uint64),
        "old_addr": np.zeros(n, np.uint64), "size": np.where(kind == 1, 16, 0).astype(np.uint64),
        "stack_hash": np.zeros(n, np.uint64)}, schema=EVENTS))


def capture(tmp: Path) -> dict[str, Path]:
    """The three captures of the issue, through the command line (root)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build

    cxxmap = build(["stacks/cxxmap.cc"], flags=("-O2", "-g"))
    cmds = {
        "python demo": ["env", "PYTHONMALLOC=malloc", "/usr/bin/python3",
                        str(ROOT / "fixtures/demo/workload.py"), "40000"],
        "cxxmap": [str(cxxmap), "100000", "3"],
    }
    for name, n in SQLITE_INSERTS.items():
        sql = tmp / f"ins-{n}.sql"
        sql.write_text("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);\nBEGIN;\n"
                       + "".join(f"INSERT INTO t(name, v) VALUES ('name-{i * 7919 % 100003}',"
                                 f" {i}.5);\n" for i in range(n))
                       + "COMMIT;\n")
        cmds[name] = ["/usr/bin/sqlite3", "-init", str(sql), ":memory:", ".quit"]
    arts = {}
    for name, cmd in cmds.items():
        art = tmp / f"{name.replace(' ', '-')}.memtrack"
        r = subprocess.run([*MEMTRACK, "capture", "-o", str(art), "--force", "--", *cmd],
                           capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            raise SystemExit(f"capture of {name} failed: {r.stderr[-500:]}")
        arts[name] = art
    return arts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", default="1M,10M", help="comma-separated sizes")
    ap.add_argument("--stacks", type=count, default=count("100k"))
    ap.add_argument("--big", action="store_true", help="add the 50 M case")
    ap.add_argument("--captures", action="store_true", help="also the issue's captures (root)")
    ap.add_argument("--keep", type=Path, help="write the artifacts here and keep them")
    ap.add_argument("--rss-cap", type=float, help="MiB: kill a run whose tree goes over")
    ap.add_argument("--no-warm", action="store_true", help="caches already warm: no warm-up")
    ap.add_argument("--busy", action="store_true", help="beside two CPU-bound processes")
    ap.add_argument("--hot", type=count, help="also N events of a malloc/free loop on one "
                    "address (one bucket however many its operations)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from support.load import cpu_hogs

    with cpu_hogs(2) if args.busy else contextlib.nullcontext():
        measure(args)


def measure(args: argparse.Namespace) -> None:
    sizes = [count(s) for s in args.events.split(",")] + ([count("50M")] if args.big else [])
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {loadavg()} ({os.cpu_count()} cores)"
          + (", beside two CPU-bound processes" if args.busy else ""))
    rows, speed = [], []
    try:
        for n in sizes:
            art = tmp / f"synth-{n}.memtrack"
            if not (art / "manifest.json").is_file():
                generate(art, n, args.stacks)
            base = min(baseline(art) for _ in range(2))
            if n == sizes[0] and not args.no_warm:  # the same stacks in every size
                run_process(art, tmp / "warm.duckdb", None)
                (tmp / "warm.duckdb").unlink()
            results = {}
            try:
                for jobs in (1, 2):
                    db = tmp / f"synth-{n}-j{jobs}.duckdb"
                    results[jobs] = run_process(art, db, jobs, args.rss_cap)
            except Capped as e:
                print(f"{n:,} events, jobs {jobs}: killed, {e}")
                break
            sums = checksums(tmp / f"synth-{n}-j1.duckdb")
            same = sums == checksums(tmp / f"synth-{n}-j2.duckdb")
            for jobs in (1, 2):
                (tmp / f"synth-{n}-j{jobs}.duckdb").unlink()
            rows.append((n, base, results))
            speed.append((n, results[1][0] / results[2][0], same, digest(sums)))
            if not args.keep:
                shutil.rmtree(art)
        caps = {}
        if args.hot:
            art = tmp / f"hot-{args.hot}.memtrack"
            if not (art / "manifest.json").is_file():
                hot_artifact(art, args.hot)
            caps[f"one address {args.hot // 10**6}M"] = (
                baseline(art), run_process(art, tmp / "cap.duckdb", None))
            if not args.keep:
                shutil.rmtree(art)
        if args.captures:
            for name, art in capture(tmp).items():
                caps[name] = (baseline(art), run_process(art, tmp / "cap.duckdb", None))
                shutil.rmtree(art)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nsynthetic artifacts, {args.stacks:,} distinct stacks, through the CLI")
    print(f"{'events':>11} {'jobs':>4} {'seconds':>8} {'x base':>7} {'us/event':>8} "
          f"{'peak MiB':>9} {'B/event':>8}  stages")
    for n, base, results in rows:
        for jobs, (sec, mib, stages, _) in results.items():
            st = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
            print(f"{n:>11,} {jobs:>4} {sec:>8.1f} {sec / base:>7.0f} {sec / n * 1e6:>8.2f} "
                  f"{mib:>9.0f} {mib * 2**20 / n:>8.0f}  {st}")
    print(f"\n{'events':>11} {'jobs 1 / jobs 2':>16}  tables (checksums), their digest")
    for n, ratio, same, dig in speed:
        print(f"{n:>11,} {ratio:>15.2f}x  {'identical' if same else 'DIFFERENT'}  {dig}")
    if len(rows) > 1:  # time linear, memory flat: the largest against the smallest
        (n0, _, r0), (n1, _, r1) = rows[0], rows[-1]
        print(f"\n{n1 // n0}x the events (jobs 2): {r1[2][0] / r0[2][0]:.1f}x the time, "
              f"{r1[2][1] / r0[2][1]:.2f}x the peak")
    if caps:
        print(f"\n{'capture':<12} {'events base s':>13} {'seconds':>8} {'peak MiB':>9}  "
              "what it holds; stages")
        for name, (base, (sec, mib, stages, said)) in caps.items():
            st = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
            print(f"{name:<12} {base:>13.2f} {sec:>8.1f} {mib:>9.0f}  {said}; {st}")
    print("\ntargets (issue 20) side by side, default jobs where not said")
    got = {f"synthetic {n // 10**6}M": (results[2][0], results[2][1])
           for n, _, results in rows} | {k: (v[1][0], v[1][1]) for k, v in caps.items()}
    for name, (t_sec, t_mib) in TARGETS.items():
        if name in got:
            sec, mib = got[name]
            mem = f", peak {mib:.0f} MiB (target <= {t_mib:.0f})" if t_mib else ""
            print(f"  {name:<14} {sec:6.1f} s (target <= {t_sec:.0f} s){mem}")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
