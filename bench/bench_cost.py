"""What an allocation costs under capture, and where it goes: allocation-heavy native
programs through the command line, next to heaptrack and to the trap floor, all
measured in this run.

    sudo .venv/bin/python bench/bench_cost.py [--repeat 3] [--quick] [--busy]

Workloads: a C++ word count (fixtures/cost/wordcount.cc, -O2: std::string, std::vector
and std::map), Debian's sqlite3 inserting 100 k rows one statement each, a binary tree
of 2^18 - 1 malloc'd nodes (fixtures/placement/tree.c), a malloc/free loop of 2 M pairs
(fixtures/placement/allocloop.cc) and GNU sort of 20 MB (one thread).

Tools, interleaved round by round (the fastest of --repeat rounds each):
- bare: the program, forked and exec'd by this script;
- floor: the same with do-nothing BPF programs on exactly the functions and offsets
  memtrack probed in this workload (read from its artifact's manifest), entries,
  returns and frees, linked to this pid only: what the traps alone cost;
- heaptrack CMD;
- memtrack capture --stacks off, and memtrack capture with the defaults (stacks on).

Then, per allocator call of the default capture, the breakdown (ns per call): the
program's own time (bare), memtrack's fixed cost (`capture -- /bin/true` minus bare
/bin/true, this run), the traps (floor - bare), the BPF programs' own run time
(kernel.bpf_stats_enabled, from the manifest's `cost`), the drain, writer and main
threads' CPU (the manifest's `drain` and `cost`), and the rest of the wall time: what
the capture's threads on the other core and the program's sharing of the cores add
(negative where they overlapped the program). The parts add up to the measured wall.

--busy runs two CPU-bound processes beside every measurement (a CI runner).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_overhead import make_sort_input, wall  # noqa: E402
from bpfstats import bpf_stats  # noqa: E402
from conftest import build  # noqa: E402

from memtrack.capture.links import BPF_TRACE_UPROBE_MULTI, uprobe_multi_link  # noqa: E402
from memtrack.schema import EventKind  # noqa: E402
from memtrack.schema.artifact import Artifact  # noqa: E402

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
AIM = 3.0  # memtrack (stacks on) / heaptrack wall time, issue 27
ALLOC_KINDS = [int(k) for k in (EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC,
                                EventKind.ALIGNED_ALLOC, EventKind.FREE)]
FLOOR_PROGRAM = "int mt_floor(struct pt_regs *ctx) { return 0; }"


@dataclass
class Workload:
    name: str
    cmd: list[str]


def workloads(tmp: Path, quick: bool) -> list[Workload]:
    scale = 4 if quick else 1
    rng = random.Random(27)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 24)))
             for _ in range(20000)]
    text = tmp / "words.txt"
    text.write_text("".join(" ".join(rng.choices(vocab, k=12)) + "\n"
                            for _ in range(20000 // scale)))
    sql = tmp / "ins.sql"
    sql.write_text("CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);\nBEGIN;\n" +
                   "".join(f"INSERT INTO t(name, v) VALUES ('name-{i * 7919 % 100003}', "
                           f"{i}.5);\n" for i in range(100_000 // scale)) + "COMMIT;\n")
    lines = tmp / "sort.txt"
    make_sort_input(lines, (20 << 20) // scale)
    wc = build(["cost/wordcount.cc"], flags=("-O2",))
    tree = build(["placement/tree.c"], flags=("-O2",))
    loop = build(["placement/allocloop.cc"], flags=("-O2",))
    return [
        Workload("c++ word count", [str(wc), str(text)]),
        Workload("sqlite3 100k inserts", ["/usr/bin/sqlite3", "-init", str(sql), ":memory:",
                                          ".quit"]),
        Workload("binary tree 2^18", [str(tree)]),
        Workload("malloc/free loop", [str(loop), "malloc", str(2_000_000 // scale)]),
        Workload("sort 20 MB", ["/usr/bin/sort", "--parallel=1", "-o", "/dev/null",
                                str(lines)]),
    ]


def launch(cmd: list[str], links: list[tuple[int, str, list[int], bool]] | None = None
           ) -> float:
    """Wall time of `cmd` from its fork to its exit; `links` (prog fd, path, offsets,
    return probes) attached to it alone before it execs."""
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            os.execv(cmd[0], cmd)
        finally:
            os._exit(127)
    os.close(r)
    fds = [uprobe_multi_link(fd, path, offs, [0] * len(offs), retprobe=ret, pid=pid)
           for fd, path, offs, ret in links or ()]
    os.write(w, b"x")
    os.close(w)
    _, status = os.waitpid(pid, 0)
    elapsed = time.monotonic() - t0
    for fd in fds:
        os.close(fd)
    if status != 0:
        raise RuntimeError(f"{cmd[0]} ended with status {status:#x}")
    return elapsed


def floor_links(manifest: dict, prog_fd: int) -> list[tuple[int, str, list[int], bool]]:
    """Do-nothing links on every function memtrack probed (entry, and return where it
    had a uretprobe), at its offsets."""
    entries: dict[str, list[int]] = {}
    rets: dict[str, list[int]] = {}
    for p in manifest["probes"]:
        if p.get("probe_offset") is None or p.get("refused"):
            continue
        off = p["file_offset"] + p["probe_offset"]
        entries.setdefault(p["path"], []).append(off)
        if p.get("retprobe"):
            rets.setdefault(p["path"], []).append(off)
    return ([(prog_fd, path, sorted(set(o)), False) for path, o in entries.items()] +
            [(prog_fd, path, sorted(set(o)), True) for path, o in rets.items()])


def capture(cmd: list[str], out: Path, stacks: bool) -> tuple[float, dict, int]:
    """Wall time of `memtrack capture` around `cmd`, its manifest and allocator calls."""
    shutil.rmtree(out, ignore_errors=True)
    t = wall([*MEMTRACK, "capture", "-o", str(out),
              *(() if stacks else ("--stacks", "off")), "--", *cmd])
    manifest = json.loads((out / "manifest.json").read_text())
    kinds = Artifact.open(out).read("events").table.column("kind").to_numpy()
    calls = int(sum((kinds == k).sum() for k in ALLOC_KINDS))
    return t, manifest, calls


def traps_per_pair(manifest: dict, calls: int) -> dict[str, float]:
    """Probe hits per allocator call, by program (bpf_stats' run counts)."""
    bpf = manifest.get("cost", {}).get("bpf", {})
    return {k: v["runs"] / calls for k, v in bpf.items() if k in ("mt_alloc", "mt_ret", "mt_free")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a quarter of each workload")
    ap.add_argument("--busy", action="store_true", help="two CPU hogs beside")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_cost: needs root")
    from bcc import BPF

    tmp = Path(tempfile.mkdtemp(prefix="bench-cost-"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 if args.busy else 0)]
    floor = BPF(text=FLOOR_PROGRAM)
    floor_fd = floor.load_func(b"mt_floor", BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI).fd
    try:
        loads = workloads(tmp, args.quick)
        best: dict[tuple[str, str], float] = {}
        info: dict[str, tuple[dict, int, dict]] = {}

        def keep(w: str, tool: str, t: float) -> None:
            best[(w, tool)] = min(t, best.get((w, tool), t))

        capture(["/bin/true"], tmp / "t.memtrack", True)  # the program cache, warm
        with bpf_stats():
            for rnd in range(args.repeat):
                print(f"# round {rnd + 1}/{args.repeat}", file=sys.stderr, flush=True)
                keep("/bin/true", "bare", launch(["/bin/true"]))
                keep("/bin/true", "memtrack", capture(["/bin/true"], tmp / "t.memtrack", True)[0])
                keep("/bin/true", "heaptrack", wall(["heaptrack", "-o", str(tmp / "ht"),
                                                     "/bin/true"]))
                for w in loads:
                    keep(w.name, "bare", launch(w.cmd))
                    t, m, calls = capture(w.cmd, tmp / "on.memtrack", True)
                    keep(w.name, "on", t)
                    if t <= best[(w.name, "on")]:
                        info[w.name] = (m, calls, traps_per_pair(m, calls))
                    keep(w.name, "off", capture(w.cmd, tmp / "off.memtrack", False)[0])
                    keep(w.name, "floor", launch(w.cmd, floor_links(info[w.name][0], floor_fd)))
                    for f in tmp.glob("ht*"):
                        f.unlink()
                    keep(w.name, "heaptrack", wall(["heaptrack", "-o", str(tmp / "ht"),
                                                    *w.cmd]))
        report(loads, best, info)
    finally:
        for h in hogs:
            h.kill()
        floor.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def report(loads: list[Workload], best: dict[tuple[str, str], float],
           info: dict[str, tuple[dict, int, dict]]) -> None:
    print("wall time, the fastest round; x = / bare; memtrack stacks on / heaptrack: "
          f"aim <= {AIM:.0f}x")
    print(f"{'workload':<22} {'calls':>9} {'bare s':>7} {'floor':>6} {'heaptrack':>9} "
          f"{'off':>6} {'on':>6} {'on/ht':>6} {'on/floor':>8}  traps per call")
    for w in loads:
        b = best[(w.name, "bare")]
        m, calls, traps = info[w.name]
        x = {t: best[(w.name, t)] / b for t in ("floor", "heaptrack", "off", "on")}
        print(f"{w.name:<22} {calls:>9,} {b:>7.3f} {x['floor']:>5.1f}x {x['heaptrack']:>8.1f}x "
              f"{x['off']:>5.1f}x {x['on']:>5.1f}x {x['on'] / x['heaptrack']:>5.2f}x "
              f"{x['on'] / x['floor']:>7.2f}x  "
              + " ".join(f"{k[3:]} {v:.2f}" for k, v in sorted(traps.items())))
    fixed = best[("/bin/true", "memtrack")] - best[("/bin/true", "bare")]
    ht_fixed = best[("/bin/true", "heaptrack")] - best[("/bin/true", "bare")]
    print(f"\nfixed cost (capture -- /bin/true - bare): memtrack {fixed * 1e3:.0f} ms, "
          f"heaptrack {ht_fixed * 1e3:.0f} ms ({fixed / ht_fixed:.1f}x)")
    print("\nwhere the wall time of the default capture goes, ns per allocator call")
    cols = ("program", "fixed", "traps", "bpf", "drain", "writer", "main", "rest", "= wall")
    print(f"{'workload':<22} " + " ".join(f"{c:>8}" for c in cols))
    for w in loads:
        m, calls, _ = info[w.name]
        b = best[(w.name, "bare")]
        total = best[(w.name, "on")]
        traps = best[(w.name, "floor")] - b
        cost = m.get("cost", {})
        bpf = sum(v["run_ns"] for v in cost.get("bpf", {}).values()) / 1e9
        drain = m.get("drain", {}).get("cpu_ns", 0) / 1e9
        writer = cost.get("writer_cpu_ns", 0) / 1e9
        main_ = cost.get("main_cpu_ns", 0) / 1e9
        parts = [b, fixed, traps, bpf, drain, writer, main_]
        parts.append(total - sum(parts))
        print(f"{w.name:<22} " + " ".join(f"{p * 1e9 / calls:>8.0f}" for p in parts)
              + f" {total * 1e9 / calls:>8.0f}")


if __name__ == "__main__":
    main()
