"""What regions cost a benchmark run: a region boundary's round trip, and the pytest
plugin's cost per test, all through `memtrack capture` from the shell.

    sudo .venv/bin/python bench/bench_regions.py [--boundaries 2000] [--tests 300]

Figures:
- microseconds per region boundary (begin or end) from C (memtrack_control.h) and from
  Python (memtrack_control.py), each a traced program timing its own loop; next to the
  same helpers' round trip through a FIFO pair answered by a bare Python loop (no
  memtrack, no kernel mark: what the protocol itself costs), measured in this run;
- a pytest suite of --tests empty tests under capture with the memtrack.pytest plugin
  against the same run with -p no:memtrack.pytest: the ratio of the wall times, and
  the plugin's cost per test.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import build  # noqa: E402

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
CAPTURE = ["capture", "--force", "--stacks", "off", "--rss", "off"]
PY_LOOP = """
import sys, time
sys.path.insert(0, sys.argv[2])
import memtrack_control as m
n = int(sys.argv[1])
t0 = time.perf_counter()
for _ in range(n):
    assert m.begin("case") and m.end()
print(f"{(time.perf_counter() - t0) * 1e6 / (2 * n):.2f}")
"""


def traced(out: Path, cmd: list[str]) -> str:
    p = subprocess.run([*MEMTRACK, *CAPTURE, "-o", str(out), "--", *cmd],
                       capture_output=True, text=True, check=True)
    return p.stdout


def bare_fifo(cmd: list[str]) -> str:
    """Run `cmd` with MEMTRACK_CONTROL* pointing at FIFOs a plain Python loop answers
    "ok TAG" (poll, read, write: what the session does, without the kernel mark)."""
    d = Path(tempfile.mkdtemp(prefix="bench-regions-"))
    ctl, ack = d / "control", d / "control.ack"
    os.mkfifo(ctl)
    os.mkfifo(ack)
    fd = os.open(ctl, os.O_RDONLY | os.O_NONBLOCK)
    keep = os.open(ctl, os.O_WRONLY | os.O_NONBLOCK)
    done = threading.Event()

    def serve() -> None:
        ep = select.epoll()
        ep.register(fd, select.EPOLLIN)
        buf = b""
        while not done.is_set():
            if not ep.poll(0.02):
                continue
            buf += os.read(fd, 4096)
            *lines, buf = buf.split(b"\n")
            for line in lines:
                tag = line.split(b" ")[1]
                a = os.open(ack, os.O_WRONLY | os.O_NONBLOCK)
                os.write(a, b"ok " + tag + b"\n")
                os.close(a)

    t = threading.Thread(target=serve)
    t.start()
    try:
        env = {**os.environ, "MEMTRACK_CONTROL": str(ctl), "MEMTRACK_CONTROL_ACK": str(ack)}
        return subprocess.run(cmd, capture_output=True, text=True, check=True,
                              env=env).stdout
    finally:
        done.set()
        t.join()
        for f in (fd, keep):
            os.close(f)
        for p in (ctl, ack):
            p.unlink()
        d.rmdir()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boundaries", type=int, default=2000)
    ap.add_argument("--tests", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    exe = build(["regions/boundaries.c"])
    control = str(ROOT / "memtrack" / "control")
    work = Path(tempfile.mkdtemp(prefix="bench-regions-"))
    out = work / "b.memtrack"
    n = str(args.boundaries)
    py = [sys.executable, "-c", PY_LOOP, n, control]
    rows = []
    for name, cmd in (("C (memtrack_control.h)", [str(exe), n]),
                      ("Python (memtrack_control.py)", py)):
        ours = median([float(traced(out, cmd)) for _ in range(args.repeat)])
        bare = median([float(bare_fifo(cmd)) for _ in range(args.repeat)])
        rows.append((name, ours, bare))
    print(f"region boundary round trip ({args.boundaries} begin/end pairs, median of "
          f"{args.repeat}):")
    for name, ours, bare in rows:
        print(f"  {name:<30} {ours:7.1f} us under memtrack capture; bare FIFO answered by "
              f"Python {bare:6.1f} us ({ours / bare:.2f}x)")

    suite = work / "test_empty.py"
    suite.write_text("import pytest\n\n@pytest.mark.parametrize('i', range("
                     f"{args.tests}))\ndef test_empty(i):\n    pass\n")
    timings: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.repeat):
        for mode, extra in (("on", ["-p", "memtrack.pytest"]),
                            ("off", ["-p", "no:memtrack.pytest"])):
            t0 = time.monotonic()
            traced(out, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         *extra, str(suite)])
            timings[mode].append(time.monotonic() - t0)
    on, off = median(timings["on"]), median(timings["off"])
    print(f"pytest, {args.tests} empty tests under capture: plugin on {on:.2f} s, off "
          f"{off:.2f} s ({on / off:.2f}x; {(on - off) / args.tests * 1e3:.2f} ms per test)")


if __name__ == "__main__":
    main()
