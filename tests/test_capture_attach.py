"""`memtrack capture --pid`: attaching to a running process records exactly the window
between attach and detach (fixtures/capture/service.c counts its own allocations), and
leaves the process as it was: running, no breakpoint, the same mappings (but the
kernel's `[uprobes]` page), signal dispositions and children; killed with SIGKILL
during an attach, memtrack leaves it running too; a CPython process attached to gets
its Python frames; `process` counts the frees of blocks allocated before apart."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from conftest import build
from support.capture import INT3, probe_bytes

from memtrack.capture.procfs import read_maps, task_states
from memtrack.schema import EventKind
from memtrack.schema.artifact import Artifact

pytestmark = pytest.mark.bpf

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]


@contextlib.contextmanager
def service(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The service, ticking: its pid and the file its counters go to."""
    exe = build(["capture/service.c"], libs=("-lpthread",))
    counts = tmp_path / "counts"
    p = subprocess.Popen([str(exe), str(counts)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().startswith("ready")
        yield p.pid, counts
    finally:
        p.terminate()
        assert p.wait(timeout=30) == 0  # it handled SIGTERM itself: it ran on


def ticks(pid: int, counts: Path) -> tuple[int, int]:
    """The ticks each thread of the service has done (it writes them on SIGUSR1)."""
    counts.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not counts.exists():
        assert time.monotonic() < deadline, "the service did not answer SIGUSR1"
        time.sleep(0.005)
    a, b = counts.read_text().split()
    return int(a), int(b)


def state(pid: int) -> dict[str, object]:
    """What an attach must not change: mappings (the kernel's [uprobes] page aside),
    signal dispositions, children, threads. (Not the mask: sigwait changes it.)"""
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines())
    maps = read_maps(pid) or []
    return {"maps": [m for m in maps if m.path != "[uprobes]"],
            "signals": [status[k].strip() for k in ("SigIgn", "SigCgt")],
            "children": [c.read_text() for c in
                         sorted(Path(f"/proc/{pid}/task").glob("*/children"))],
            "threads": len(task_states(pid) or [])}


def no_breakpoint_left(pid: int, art: Path) -> None:
    """None of the capture's probes in `pid`'s libc. A capture with host-wide probes
    running beside (another test run on this machine, or the host-wide perf-event links
    an earlier test's tracker left to release_in_background) puts them into every process:
    then the check waits until a process memtrack never traced is clean too."""
    control = subprocess.Popen(["sleep", "120"])
    try:
        deadline = time.monotonic() + 60
        # Popen returns at the exec: the dynamic loader maps libc a moment later
        while not any("libc.so" in line.path for line in read_maps(control.pid) or []):
            assert time.monotonic() < deadline, "the control process never mapped libc"
            time.sleep(0.01)
        while INT3 in probe_bytes(pid, art).values():
            assert INT3 in probe_bytes(control.pid, art).values(), "breakpoints left"
            assert time.monotonic() < deadline, "host-wide probes beside for a minute"
            time.sleep(0.2)
    finally:
        control.kill()
        control.wait()


def capture(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTRACK, "capture", *args], capture_output=True, text=True,
                          timeout=600)


def process(art: Path) -> duckdb.DuckDBPyConnection:
    db = art.with_suffix(".duckdb")
    r = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return duckdb.connect(str(db), read_only=True)


def test_window_exact_and_process_untouched(tmp_path: Path) -> None:
    art = tmp_path / "run.memtrack"
    with service(tmp_path) as (pid, counts):
        before = state(pid)
        first = ticks(pid, counts)
        r = capture(["--pid", str(pid), "--duration", "2", "--stacks", "off", "-o", str(art)])
        last = ticks(pid, counts)
        assert r.returncode == 0, r.stderr
        assert f"memtrack: attached to {pid}; control FIFO " in r.stderr
        assert f"memtrack: detached from {pid}; " in r.stderr
        # no breakpoint left, nothing else changed, and it runs on
        no_breakpoint_left(pid, art)
        assert state(pid) == before
        assert set(task_states(pid) or []) <= set("SR")
        assert ticks(pid, counts) > last
    # every tick of the window, each thread's one contiguous run of sequence numbers
    events = Artifact.open(art).read("events").table.to_pylist()
    sizes = [e["size"] for e in events if e["pid"] == pid and e["kind"] == EventKind.MALLOC]
    for t in (0, 1):
        seen = sorted((s - 1 - t) // 2 for s in sizes if (s - 1) % 2 == t)
        assert len(seen) > 200, seen  # 2 s of 2 ms ticks
        assert seen == list(range(seen[0], seen[-1] + 1))
        assert first[t] <= seen[0] and seen[-1] < last[t]
    m = Artifact.open(art).manifest
    assert [a["pid"] for a in m.attached] == [pid] and m.root_pid == pid
    assert m.attached[0]["rss"]["anon"] > 0 and m.exit_status.code is None
    # each thread's first free in the window is of its block from before the attach
    # (and its second, where the attach met a malloc running)
    con = process(art)
    counters = json.loads(con.execute(
        "SELECT value FROM meta WHERE key = 'counters'").fetchone()[0])
    assert counters["frees_before_attach"] == frees_of_unrecorded_blocks(art), counters
    assert 2 <= counters["frees_before_attach"] <= 4, counters
    assert counters["frees_unmatched"] == 0, counters
    attached = json.loads(con.execute(
        "SELECT value FROM meta WHERE key = 'attached'").fetchone()[0])
    assert [a["pid"] for a in attached] == [pid]
    # the RSS timeline starts from the resident memory at the attach, not from 0
    first_rss = con.execute("""SELECT sum(bytes) FROM rss WHERE pid = ? AND ts = (
        SELECT min(ts) FROM rss WHERE pid = ?)""", [pid, pid]).fetchone()[0]
    assert first_rss == sum(m.attached[0]["rss"].values())
    report = subprocess.run([*MEMTRACK, "report", str(art.with_suffix(".duckdb"))],
                            capture_output=True, text=True, timeout=600)
    assert f"attached to {pid} at " in report.stdout, report.stderr


def window(art: Path, pid: int) -> list[list[int]]:
    """Each service thread's tick numbers recorded for `pid`, checked to be one
    contiguous run per thread."""
    events = Artifact.open(art).read("events").table.to_pylist()
    sizes = [e["size"] for e in events if e["pid"] == pid and e["kind"] == EventKind.MALLOC]
    out = []
    for t in (0, 1):
        seen = sorted((s - 1 - t) // 2 for s in sizes if (s - 1) % 2 == t)
        assert seen and seen == list(range(seen[0], seen[-1] + 1)), (pid, t, seen)
        out.append(seen)
    return out


def frees_of_unrecorded_blocks(art: Path) -> int:
    """The recorded frees whose block no recorded malloc of the process returned: each
    service thread's first free (of its block from before the attach), and the next one
    too where the attach came while a malloc was running (its entry unprobed, its block
    unrecorded)."""
    events = sorted(Artifact.open(art).read("events").table.to_pylist(), key=lambda e: e["ts"])
    live: set[tuple[int, int]] = set()
    n = 0
    for e in events:
        key = (e["pid"], e["addr"])
        if e["kind"] == EventKind.MALLOC:
            live.add(key)
        elif e["kind"] == EventKind.FREE and e["addr"]:
            n += key not in live
            live.discard(key)
    return n


def test_several_pids_at_once(tmp_path: Path) -> None:
    """Two processes of a service attached together: both recorded, each its whole
    window, and both left running."""
    art = tmp_path / "run.memtrack"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with service(tmp_path / "a") as (a, counts_a), service(tmp_path / "b") as (b, counts_b):
        first = {a: ticks(a, counts_a), b: ticks(b, counts_b)}
        r = capture(["--pid", str(a), "--pid", str(b), "--duration", "2", "--stacks", "off",
                     "-o", str(art)])
        last = {a: ticks(a, counts_a), b: ticks(b, counts_b)}
        assert r.returncode == 0, r.stderr
        assert f"memtrack: attached to {a}, {b}; control FIFO " in r.stderr
        assert f"memtrack: detached from {a}, {b}; " in r.stderr
        for pid, counts in ((a, counts_a), (b, counts_b)):
            assert set(task_states(pid) or []) <= set("SR")
            deadline = time.monotonic() + 10  # it ticks on (on a loaded machine, later)
            while ticks(pid, counts) == last[pid]:
                assert time.monotonic() < deadline, f"{pid} stopped ticking"
                time.sleep(0.01)
    for pid in (a, b):
        for t, seen in enumerate(window(art, pid)):
            assert len(seen) > 200, seen  # 2 s of 2 ms ticks, for the second one too
            assert first[pid][t] <= seen[0] and seen[-1] < last[pid][t]
    m = Artifact.open(art).manifest
    assert [x["pid"] for x in m.attached] == [a, b] and m.root_pid == a
    con = process(art)
    counters = json.loads(con.execute(
        "SELECT value FROM meta WHERE key = 'counters'").fetchone()[0])
    # each thread's first free, and its second where the attach met a malloc running
    assert counters["frees_before_attach"] == frees_of_unrecorded_blocks(art), counters
    assert 4 <= counters["frees_before_attach"] <= 8, counters
    assert counters["frees_unmatched"] == 0, counters
    assert con.execute("SELECT pid, ns_pid FROM processes ORDER BY pid").fetchall() == [
        (a, a), (b, b)]


def test_start_disabled_and_the_control_fifo(tmp_path: Path) -> None:
    """--start-disabled with --pid: nothing until a runner's `enable` on the control
    FIFO, everything from its answer to its `disable`, and a region a runner marks on a
    thread of the attached process holds that thread's allocations between its ends."""
    from memtrack.control import memtrack_control

    art = tmp_path / "run.memtrack"
    ctl, ack = tmp_path / "ctl", tmp_path / "ctl.ack"

    def send(command: str, tag: int | str = "") -> str | None:
        return memtrack_control.send(ctl, command, ack, str(tag), timeout=60)

    with service(tmp_path) as (pid, counts):
        cap = subprocess.Popen([*MEMTRACK, "capture", "--pid", str(pid), "--start-disabled",
                                "--control-fifo", str(ctl), "--stacks", "off", "-o",
                                str(art)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
        try:
            assert cap.stderr is not None
            while not (line := cap.stderr.readline()).startswith("memtrack: attached"):
                assert line, "capture ended before attaching"
            time.sleep(0.3)  # disabled: nothing of this goes in
            before = ticks(pid, counts)
            assert send("enable") == "ok"
            enabled = ticks(pid, counts)
            tid = min(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
            assert send(f"begin {tid} window", tid) == f"ok {tid}"
            time.sleep(0.5)
            assert send(f"end {tid}", tid) == f"ok {tid}"
            time.sleep(0.3)
            on = ticks(pid, counts)
            assert send("disable") == "ok"
            after = ticks(pid, counts)
            time.sleep(0.3)  # disabled again
            cap.send_signal(signal.SIGINT)
            assert cap.wait(timeout=120) == 128 + signal.SIGINT, cap.stderr.read()
        finally:
            if cap.poll() is None:
                cap.kill()
                cap.wait()
    for t, seen in enumerate(window(art, pid)):
        assert before[t] <= seen[0] <= enabled[t] + 1, (t, before, enabled, seen[0])
        assert on[t] - 1 <= seen[-1] <= after[t], (t, on, after, seen[-1])
    con = process(art)
    (region, rtid, begin, end), = con.execute(
        "SELECT region_id, tid, begin_ts, end_ts FROM regions WHERE name = 'window'"
    ).fetchall()
    assert rtid == tid
    inside = con.execute("""SELECT list(alloc_id ORDER BY alloc_id) FROM allocations
        WHERE tid = ? AND ts BETWEEN ? AND ? AND inherited_from IS NULL""",
                         [tid, begin, end]).fetchone()[0]
    assert len(inside) > 100  # 0.5 s of 2 ms ticks
    assert con.execute("""SELECT list(alloc_id ORDER BY alloc_id) FROM region_allocations
        WHERE region_id = ?""", [region]).fetchone()[0] == inside


def test_usage_errors(tmp_path: Path) -> None:
    out = str(tmp_path / "x.memtrack")
    for args, line in (
            (["--pid", "1", "--", "true"], "give either CMD or --pid, not both"),
            (["--pid", "999999999"], "--pid 999999999: no process 999999999"),
            (["--pid", "2"], "--pid 2: process 2 is a kernel thread"),
            (["--duration", "1", "--", "true"], "--duration ends an attached capture")):
        r = capture(["-o", out, *args])
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("memtrack: " + line), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not Path(out).exists()


def test_sigkill_during_attach_leaves_it_running(tmp_path: Path) -> None:
    art = tmp_path / "run.memtrack"
    with service(tmp_path) as (pid, counts):
        cap = subprocess.Popen([*MEMTRACK, "capture", "--pid", str(pid), "-o", str(art)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while set(task_states(pid) or "R") != {"T"}:  # memtrack stopped it to attach
            assert cap.poll() is None and time.monotonic() < deadline
            time.sleep(0.0005)
        cap.kill()
        cap.wait()
        deadline = time.monotonic() + 10
        while "T" in set(task_states(pid) or []):
            assert time.monotonic() < deadline, "left stopped"
            time.sleep(0.01)
        got = ticks(pid, counts)
        time.sleep(0.1)
        assert ticks(pid, counts) > got
        if (art / "manifest.json").exists() and json.loads(
                (art / "manifest.json").read_text()).get("probes"):
            no_breakpoint_left(pid, art)


LOOP = """
import sys, time
def leaf_of_attached(n):
    return bytearray(n)
print("ready", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    leaf_of_attached(123457)
    time.sleep(0.001)
"""


@pytest.mark.parametrize("python", ["/usr/bin/python3",
                                    str(Path.home() / ".pyenv/versions/3.10.13/bin/python3.10")])
def test_python_frames_of_an_attached_interpreter(tmp_path: Path, python: str) -> None:
    """Python frames of a CPython attached to (Debian's 3.11; pyenv's 3.10 where present,
    whose threads BPF tells apart by their FS base)."""
    if not Path(python).exists():
        pytest.skip(f"no {python} here")
    art = tmp_path / "run.memtrack"
    p = subprocess.Popen([python, "-c", LOOP], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONMALLOC": "malloc"})
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        r = capture(["--pid", str(p.pid), "--duration", "1.5", "-o", str(art)])
        assert r.returncode == 0, r.stderr
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
    con = process(art)
    rows = con.execute("""
        SELECT name, method FROM stack_lines
        WHERE stack_id = (SELECT any_value(stack_id) FROM allocations WHERE size = 123458)
        ORDER BY position""").fetchall()
    assert ("leaf_of_attached", "python") in rows, rows
    assert ("<module>", "python") in rows, rows
