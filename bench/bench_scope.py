"""What a capture costs outside its own process tree, and what scoping its probes to
the tree costs inside it: probes scoped per traced process (the default, "after")
against host-wide probes (`--probe-scope host`, what every capture did "before"),
measured side by side in this run, through the command line.

    sudo .venv/bin/python bench/bench_scope.py [--repeat 3] [--busy]

Figures:
1. an unrelated malloc/free loop (2 M pairs, started outside any capture) alone, and
   beside a running `memtrack capture -- sleep` with scoped and with host-wide probes:
   the loop's own time, best of --repeat, as a ratio against alone;
2. the fixed cost, `memtrack capture -o X -- /bin/true`;
3. fork-heavy trees: a shell script forking 500 children (`/bin/true` each) and
   `make -j2` of a small C project (24 files), bare and under each scope (median).
Each round interleaves the variants; --busy runs them beside two CPU-bound processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench_startup import wall  # noqa: E402
from conftest import build  # noqa: E402
from support.load import cpu_hogs  # noqa: E402

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
SCOPES = ("auto", "host")
LABEL = {"auto": "scoped (after)", "host": "host-wide (before)"}


def capture(out: Path, scope: str, cmd: list[str]) -> list[str]:
    return [*MEMTRACK, "capture", "-o", str(out), "--force", "--probe-scope", scope,
            "--", *cmd]


@contextlib.contextmanager
def running_capture(tmp: Path, scope: str) -> Iterator[None]:
    """A capture of `sleep` whose probes are attached while the block runs."""
    art = tmp / f"beside-{scope}.memtrack"
    shutil.rmtree(art, ignore_errors=True)
    proc = subprocess.Popen(capture(art, scope, ["sleep", "600"]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                m = json.loads((art / "manifest.json").read_text())
                if any("libc.so" in p["path"] for p in m.get("probes", [])):
                    break
            except (OSError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the capture beside did not start")
            time.sleep(0.05)
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def loop_ns(loop: Path, pairs: int) -> float:
    out = subprocess.run([str(loop), "loop", str(pairs)], capture_output=True, text=True,
                         check=True).stdout
    return float(out.split()[0])


def make_project(d: Path, files: int = 24) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (d / f"f{i}.c").write_text(
            f"#include <stdio.h>\n#include <string.h>\nint f{i}(const char *s) "
            f"{{ char b[64]; snprintf(b, sizeof b, \"%s{i}\", s); return (int)strlen(b); }}\n")
    objs = " ".join(f"f{i}.o" for i in range(files))
    (d / "Makefile").write_text(f"all: {objs}\n%.o: %.c\n\tcc -O1 -c $< -o $@\n")
    return d


def measure(args: argparse.Namespace, tmp: Path) -> None:
    loop = build(["capture/loop.c"], flags=("-O2",))
    project = make_project(tmp / "project")
    script = "i=0; while [ $i -lt 500 ]; do /bin/true; i=$((i+1)); done"
    beside: dict[str, list[float]] = {"alone": [], **{s: [] for s in SCOPES}}
    fixed: dict[str, list[float]] = {"bare": [], **{s: [] for s in SCOPES}}
    forks: dict[str, list[float]] = {"bare": [], **{s: [] for s in SCOPES}}
    make: dict[str, list[float]] = {"bare": [], **{s: [] for s in SCOPES}}
    art = tmp / "run.memtrack"
    for r in range(args.repeat):
        order = SCOPES if r % 2 == 0 else SCOPES[::-1]
        beside["alone"].append(loop_ns(loop, args.pairs))
        fixed["bare"].append(wall(["/bin/true"]))
        forks["bare"].append(wall(["sh", "-c", script]))
        make["bare"].append(wall(["make", "-s", "-B", "-j2", "-C", str(project)]))
        for scope in order:
            with running_capture(tmp, scope):
                beside[scope].append(loop_ns(loop, args.pairs))
            fixed[scope].append(wall(capture(art, scope, ["/bin/true"])))
            forks[scope].append(wall(capture(art, scope, ["sh", "-c", script])))
            make[scope].append(wall(capture(art, scope, ["make", "-s", "-B", "-j2", "-C",
                                                         str(project)])))
    alone = min(beside["alone"])
    print(f"1. an unrelated malloc/free loop ({args.pairs:,} pairs), best of {args.repeat}")
    print(f"   {'alone':38s} {alone / 1e9:8.3f} s   1.00x")
    for scope in SCOPES:
        best = min(beside[scope])
        print(f"   {'beside a capture, ' + LABEL[scope]:38s} {best / 1e9:8.3f} s  "
              f"{best / alone:6.2f}x")
    for title, res in (("2. `memtrack capture -- /bin/true`", fixed),
                       ("3a. a shell script forking 500 children", forks),
                       ("3b. make -j2, 24 C files", make)):
        bare = statistics.median(res["bare"])
        print(f"{title}, median of {args.repeat}")
        print(f"   {'bare':38s} {bare:8.3f} s")
        for scope in SCOPES:
            med = statistics.median(res[scope])
            print(f"   {LABEL[scope]:38s} {med:8.3f} s  {med / bare:6.2f}x bare")
        after, before = (statistics.median(res[s]) for s in SCOPES)
        print(f"   scoped / host-wide: {after / before:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=2_000_000)
    ap.add_argument("--busy", action="store_true", help="beside two CPU-bound processes")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_scope: needs root (BPF)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-scope-"))
    try:
        with cpu_hogs(2) if args.busy else contextlib.nullcontext():
            measure(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
