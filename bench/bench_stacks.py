"""Stack capture figures: BPF run time per malloc probe with stacks off and at two
budgets, and what the skeleton records make of it: records per allocation, record
sizes, ring write rate, decode time per record.

Run as root: .venv/bin/python bench/bench_stacks.py [--quick]
Every figure is measured in this run; ratios are against the same run's capture-off
probe. Workloads: a Python allocation loop (Debian's python3, PYTHONMALLOC=malloc: the
loop of issue 13), Debian's sqlite3 inserting rows one statement at a time, a C++
std::map program built -O2 -g (fixtures/stacks/cxxmap.cc) and fixtures/stacks/churn.c
(four threads, frames full of changing values, nine depths).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bpfstats import bpf_stats, prog_info  # noqa: E402
from conftest import build  # noqa: E402

from memtrack.capture.options import CaptureOptions  # noqa: E402
from memtrack.process.decode import decode  # noqa: E402
from memtrack.schema import NUM_REGS, Allocator, EventKind  # noqa: E402
from memtrack.schema.artifact import Artifact  # noqa: E402

# the entry program of every allocator function (an attach cookie tells which it is):
# its run time per hit covers libc's malloc and operator new alike
PROBE = "mt_alloc"
CONFIGS = [("off", None), ("8K", 8192), ("32K", 32768)]
PY_LOOP = ("keep = []\n"
           "for i in range({n}):\n"
           "    d = {{'a': i, 'b': [i, i + 1]}}\n"
           "    l = [d, str(i)]\n"
           "    if i % 1000 == 0:\n"
           "        keep.append(l)\n")


def record_sizes(art: Artifact) -> np.ndarray:
    """Bytes of each stack record as it crossed the ring (header, fp chain, fixups, body)."""
    t = art.read("stacks").table
    if not t.num_rows:
        return np.zeros(0)
    payload = pc.binary_length(t.column("payload")).to_numpy()
    fp = pc.list_value_length(t.column("fp_chain")).to_numpy()
    fix = pc.list_value_length(t.column("ret_fixups")).to_numpy()
    return 56 + 8 * fp + 16 * fix + payload + 8 * NUM_REGS


Workload = tuple[list[str], dict[str, str], Allocator]


def run_one(label: str, budget: int | None, workloads: dict[str, Workload],
            tmp: Path) -> dict[str, dict[str, Any]]:
    from memtrack.capture.tracker import Tracker

    opts = CaptureOptions(stacks=budget is not None, stack_budget=budget or 32768)
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    with Tracker(opts) as tracker:
        load_s = time.monotonic() - t0
        for wname, (cmd, env, allocator) in workloads.items():
            probe = PROBE.encode()
            before = prog_info(tracker.bpf.funcs[probe].fd) if probe in tracker.bpf.funcs else {}
            out = tmp / f"{label}-{wname}.memtrack"
            session = tracker.spawn(cmd, out, overwrite=True, env={**os.environ, **env})
            result = session.wait(timeout=900)
            info = prog_info(tracker.bpf.funcs[probe].fd)
            runs = info.get("run_cnt", 0) - before.get("run_cnt", 0)
            ns = info.get("run_time_ns", 0) - before.get("run_time_ns", 0)
            art = Artifact.open(out)
            sizes = record_sizes(art)
            dur = (art.manifest.end_ns - art.manifest.start_ns) / 1e9
            ev = art.read("events").table
            kind = ev.column("kind")
            allocs = int(pc.sum(pc.is_in(kind, value_set=pc.cast(
                [int(k) for k in (EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC,
                                  EventKind.ALIGNED_ALLOC)], "uint8"))).as_py() or 0)
            tracked = int(pc.sum(pc.and_(
                pc.equal(kind, int(EventKind.MALLOC)),
                pc.equal(ev.column("allocator"), int(allocator)))).as_py() or 0)
            row: dict[str, Any] = {
                "probe_ns": ns / runs if runs else float("nan"), "probe_runs": runs,
                "total_ns": ns, "tracked": tracked, "allocs": allocs,
                "verified_insns": info.get("verified_insns"), "load_s": load_s,
                "records": sizes.size, "wall_s": dur,
                "size_median": float(np.median(sizes)) if sizes.size else 0.0,
                "ring_mb_s": sizes.sum() / dur / 1e6 if dur else 0.0,
                "losses": {k: v for k, v in result.losses.items() if v},
            }
            if sizes.size:
                t1 = time.perf_counter()
                dec = decode(art)
                row["decode_us"] = (time.perf_counter() - t1) * 1e6 / sizes.size
                row["mismatch"] = dec.counters["decode_mismatch"]
            results[wname] = row
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_stacks: needs root (bcc)")
    scale = 1 if args.quick else 5
    tmpdir = Path(tempfile.mkdtemp(prefix="bench-stacks-"))
    sql = tmpdir / "ins.sql"
    sql.write_text("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);\nBEGIN;\n" +
                   "".join(f"INSERT INTO t(name, v) VALUES ('name-{i * 7919 % 100003}', "
                           f"{i}.5);\n" for i in range(4000 * scale)) + "COMMIT;\n")
    churn = build(["stacks/churn.c"], flags=("-O1", "-pthread"))
    cxxmap = build(["stacks/cxxmap.cc"], flags=("-O2", "-g"))
    python = str(Path("/usr/bin/python3").resolve())
    workloads: dict[str, Workload] = {
        "python": ([python, "-c", PY_LOOP.format(n=40000 * scale)],
                   {"PYTHONMALLOC": "malloc"}, Allocator.LIBC),
        "sqlite3": (["/usr/bin/sqlite3", ":memory:", "-init", "/dev/null", "-cmd",
                     f".read {sql}", ".quit"], {}, Allocator.LIBC),
        "cxxmap": ([str(cxxmap), str(6000 * scale)], {}, Allocator.CXX),
        "churn": ([str(churn), str(400 * scale), "4"], {}, Allocator.LIBC),
    }
    table: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        with bpf_stats():
            for label, budget in CONFIGS:
                print(f"# {label} ...", file=sys.stderr, flush=True)
                table[label] = run_one(label, budget, workloads, tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    print("probe ns: BPF run time of the malloc (operator new for cxxmap) entry program per"
          " run (every process on the host runs it; untracked ones return at once); tracked"
          " ns: the same with the untracked runs costed at the capture-off rate, per call of"
          " the workload")
    for wname in workloads:
        base = table["off"][wname]["probe_ns"]
        print(f"\n== {wname}: {table['off'][wname]['probe_runs']:,} probe runs, "
              f"{table['off'][wname]['tracked']:,} from the workload "
              f"(capture off: {base:.0f} ns per probe)")
        print(f"{'config':<7} {'probe ns':>9} {'tracked ns':>10} {'x off':>6} {'verified':>9} "
              f"{'records':>8} {'per alloc':>9} {'median B':>9} {'ring MB/s':>10} "
              f"{'decode us':>10} losses")
        for label, _ in CONFIGS:
            r = table[label][wname]
            tns = (r["total_ns"] - (r["probe_runs"] - r["tracked"]) * base) / max(r["tracked"], 1)
            per = r["records"] / r["allocs"] if r["allocs"] else 0.0
            print(f"{label:<7} {r['probe_ns']:>9.0f} {tns:>10.0f} {tns / base:>6.1f} "
                  f"{r['verified_insns'] or 0:>9,} {r['records']:>8,} {per:>9.4f} "
                  f"{r['size_median']:>9.0f} {r['ring_mb_s']:>10.2f} "
                  f"{r.get('decode_us', 0):>10.1f} {r['losses'] or ''}")
    print("\n(compile+load of the capture program, s: "
          + ", ".join(f"{k} {table[k]['python']['load_s']:.0f}" for k, _ in CONFIGS) + ")")


if __name__ == "__main__":
    main()
