"""What attaching to a running process costs: `memtrack capture --pid` on a process
with ~100 mapped modules (fixtures/capture/manylibs.c dlopens --libs tiny shared
libraries), next to `memtrack capture -- /bin/true` measured in the same run.

    sudo .venv/bin/python bench/bench_attach.py [--libs 100] [--runs 5]

Figures (medians of --runs, in ms):
- attach: from `memtrack capture --pid` starting to the first event it recorded (for
  /bin/true: from `memtrack capture` starting to its first event);
- detach: from SIGINT to memtrack's exit (for /bin/true: from its exit to memtrack's);
- the attach stop: how long the process was held stopped (stops.arrow).
The BPF program comes from the program cache (a first run compiles it).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import build  # noqa: E402

from memtrack.schema import EventKind  # noqa: E402
from memtrack.schema.artifact import Artifact  # noqa: E402

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
CAPTURE = ["capture", "--force", "--stacks", "off", "--rss", "off"]


def tiny_libs(directory: Path, n: int) -> list[str]:
    """n shared libraries of one function each."""
    out = []
    for i in range(n):
        src, lib = directory / f"t{i}.c", directory / f"libt{i}.so"
        src.write_text(f"int t{i}(int x) {{ return x + {i}; }}\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)],
                       check=True)
        out.append(str(lib))
    return out


def first_event(art: Path) -> int:
    ts = Artifact.open(art).read("events").table.column("ts").to_pylist()
    return min(ts)


def attach_once(exe: Path, libs: list[str], art: Path) -> tuple[float, float, float, int]:
    """(attach ms, detach ms, attach stop ms, modules mapped) of one --pid capture."""
    p = subprocess.Popen([str(exe), *libs], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        modules = sum(1 for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines()
                      if " r-xp " in line and "/" in line)
        t0 = time.monotonic_ns()
        cap = subprocess.Popen([*MEMTRACK, *CAPTURE, "--pid", str(p.pid), "-o", str(art)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert cap.stderr is not None
        while not cap.stderr.readline().startswith("memtrack: attached to"):
            assert cap.poll() is None
        time.sleep(0.5)  # some events after the attach
        t1 = time.monotonic_ns()
        cap.send_signal(signal.SIGINT)
        cap.communicate(timeout=120)
        t2 = time.monotonic_ns()
        assert cap.returncode == 128 + signal.SIGINT
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
    a = Artifact.open(art)
    stops = a.read("stops").table.to_pylist()
    stop = next(s for s in stops if s["pid"] == p.pid)
    return ((first_event(art) - t0) / 1e6, (t2 - t1) / 1e6,
            (stop["end_ts"] - stop["begin_ts"]) / 1e6, modules)


def true_once(art: Path) -> tuple[float, float]:
    """(start ms, end ms) of `memtrack capture -- /bin/true`."""
    t0 = time.monotonic_ns()
    subprocess.run([*MEMTRACK, *CAPTURE, "-o", str(art), "--", "/bin/true"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t2 = time.monotonic_ns()
    events = Artifact.open(art).read("events").table.to_pylist()
    exit_ts = max(e["ts"] for e in events if e["kind"] == EventKind.EXIT)
    return (first_event(art) - t0) / 1e6, (t2 - exit_ts) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    exe = build(["capture/manylibs.c"], libs=("-ldl",))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        libs = tiny_libs(tmp, args.libs)
        true_once(tmp / "warm.memtrack")  # the program cache
        att = [attach_once(exe, libs, tmp / "a.memtrack") for _ in range(args.runs)]
        tru = [true_once(tmp / "t.memtrack") for _ in range(args.runs)]
    med = statistics.median
    print(f"capture --pid, {att[0][3]} executable modules mapped ({args.runs} runs, "
          "medians):")
    print(f"  attach (start -> first event)   {med(a[0] for a in att):8.1f} ms")
    print(f"  the attach stop (held stopped)  {med(a[2] for a in att):8.1f} ms")
    print(f"  detach (SIGINT -> exit)         {med(a[1] for a in att):8.1f} ms")
    print("capture -- /bin/true:")
    print(f"  start -> first event            {med(t[0] for t in tru):8.1f} ms")
    print(f"  its exit -> memtrack's exit     {med(t[1] for t in tru):8.1f} ms")


if __name__ == "__main__":
    main()
