"""Stack capture figures: record sizes and ring write rates raw vs delta, BPF run time per
malloc probe with capture off / raw / delta at 8 and 32 KiB, decode time per record.

Run as root: .venv/bin/python bench/bench_stacks.py [--quick]
Every figure is measured in this run; ratios are against the same run's baseline (capture
off for BPF time, raw records for sizes and rates).
"""

from __future__ import annotations

import argparse
import os
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

from conftest import build  # noqa: E402

from memtrack.capture.parts import CaptureOptions  # noqa: E402
from memtrack.process.decode import decode  # noqa: E402
from memtrack.schema import NUM_REGS, Allocator, EventKind, StackEncoding  # noqa: E402
from memtrack.schema.artifact import Artifact  # noqa: E402

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
PROBE = "mt_alloc"
CONFIGS = [("off", None, False), ("raw 8K", 8192, False), ("delta 8K", 8192, True),
           ("raw 32K", 32768, False), ("delta 32K", 32768, True)]


def fdinfo(fd: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        k, _, v = line.partition(":")
        v = v.strip()
        if v.isdigit():
            out[k] = int(v)
    return out


def record_sizes(art: Artifact) -> np.ndarray:
    """Bytes of each stack record as it crossed the ring (header, fp chain, fixups, body)."""
    t = art.read("stacks").table
    if not t.num_rows:
        return np.zeros(0)
    payload = pc.binary_length(t.column("payload")).to_numpy()
    fp = pc.list_value_length(t.column("fp_chain")).to_numpy()
    fix = pc.list_value_length(t.column("ret_fixups")).to_numpy()
    raw = t.column("encoding").to_numpy() == StackEncoding.RAW
    return 56 + 8 * fp + 16 * fix + payload + np.where(raw, 8 * NUM_REGS, 0)


def run_one(label: str, budget: int | None, delta: bool, workloads: dict[str, list[str]],
            tmp: Path) -> dict[str, dict[str, Any]]:
    from memtrack.capture.tracker import Tracker

    opts = CaptureOptions(stacks=budget is not None, stack_budget=budget or 8192,
                          stack_compression=delta)
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    with Tracker(opts) as tracker:
        load_s = time.monotonic() - t0
        for wname, cmd in workloads.items():
            before = fdinfo(tracker.bpf.funcs[PROBE.encode()].fd) \
                if PROBE.encode() in tracker.bpf.funcs else {}
            out = tmp / f"{label.replace(' ', '_')}-{wname}.memtrack"
            session = tracker.spawn(cmd, out, overwrite=True)
            result = session.wait(timeout=600)
            info = fdinfo(tracker.bpf.funcs[PROBE.encode()].fd)
            runs = info.get("run_cnt", 0) - before.get("run_cnt", 0)
            ns = info.get("run_time_ns", 0) - before.get("run_time_ns", 0)
            art = Artifact.open(out)
            sizes = record_sizes(art)
            dur = (art.manifest.end_ns - art.manifest.start_ns) / 1e9
            ev = art.read("events").table
            tracked = int(pc.sum(pc.and_(
                pc.equal(ev.column("kind"), int(EventKind.MALLOC)),
                pc.equal(ev.column("allocator"), int(Allocator.LIBC)))).as_py() or 0)
            row: dict[str, Any] = {
                "probe_ns": ns / runs if runs else float("nan"), "probe_runs": runs,
                "total_ns": ns, "tracked": tracked,
                "verified_insns": info.get("verified_insns"), "load_s": load_s,
                "records": sizes.size, "wall_s": dur,
                "size_median": float(np.median(sizes)) if sizes.size else 0.0,
                "size_p99": float(np.percentile(sizes, 99)) if sizes.size else 0.0,
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
    n_py = 20000 if args.quick else 60000
    iters = 500 if args.quick else 2000
    churn = build(["stacks/churn.c"], flags=("-O1", "-pthread"))
    workloads = {
        "python": ["python3", "-c",
                   f"l = [('%d' % i) * 150 for i in range({n_py})]; del l"],
        "churn": [str(churn), str(iters), "4"],
    }
    saved = STATS.read_text().strip()
    STATS.write_text("1")
    table: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-stacks-") as d:
            for label, budget, delta in CONFIGS:
                print(f"# {label} ...", file=sys.stderr, flush=True)
                table[label] = run_one(label, budget, delta, workloads, Path(d))
    finally:
        STATS.write_text(saved)
    print("probe ns: BPF run time of the libc malloc entry program per run (every process"
          " on the host runs it; untracked ones return at once); tracked ns: the same with"
          " the untracked runs costed at the capture-off rate, per malloc of the workload")
    for wname in workloads:
        base = table["off"][wname]["probe_ns"]
        print(f"\n== {wname}: {table['off'][wname]['probe_runs']:,} malloc probe runs, "
              f"{table['off'][wname]['tracked']:,} from the workload "
              f"(capture off: {base:.0f} ns per probe)")
        print(f"{'config':<10} {'probe ns':>9} {'tracked ns':>10} {'x off':>6} {'verified':>9} "
              f"{'records':>8} {'median B':>9} {'p99 B':>8} {'ring MB/s':>10} {'decode us':>10}"
              " losses")
        for label, _, _ in CONFIGS:
            r = table[label][wname]
            tns = (r["total_ns"] - (r["probe_runs"] - r["tracked"]) * base) / max(r["tracked"], 1)
            r["tracked_ns"] = tns
            print(f"{label:<10} {r['probe_ns']:>9.0f} {tns:>10.0f} {tns / base:>6.1f} "
                  f"{r['verified_insns'] or 0:>9,} {r['records']:>8,} {r['size_median']:>9.0f} "
                  f"{r['size_p99']:>8.0f} {r['ring_mb_s']:>10.1f} "
                  f"{r.get('decode_us', 0):>10.1f} {r['losses'] or ''}")
        for budget in ("8K", "32K"):
            raw, dl = table[f"raw {budget}"][wname], table[f"delta {budget}"][wname]
            if raw["size_median"] and dl["size_median"]:
                print(f"delta/raw at {budget}: median record "
                      f"{dl['size_median'] / raw['size_median']:.3f}, ring bytes/s "
                      f"{dl['ring_mb_s'] / raw['ring_mb_s']:.3f}, probe time "
                      f"{dl['tracked_ns'] / raw['tracked_ns']:.2f}")
    print("\n(compile+load of the capture program, s: "
          + ", ".join(f"{k} {table[k]['python']['load_s']:.0f}" for k, _, _ in CONFIGS) + ")")


if __name__ == "__main__":
    main()
