"""Lossless capture: nothing dropped when the machine is busy or the rings are small
(the producers pause instead), nothing left stopped and a readable artifact when
capture is killed, and a status line that stays out of the program's output."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, ROOT, build
from support.load import cpu_hogs

from memtrack.capture.cmdenv import command_environment, own_environment
from memtrack.capture.stops import ATTACH, PAUSE, StopRegistry
from memtrack.process.pyframes import native_hashes
from memtrack.schema import Allocator, EventKind
from memtrack.schema.artifact import Artifact

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
M, C, R, F = EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC, EventKind.FREE
DICTLOOP = FIXTURES / "lossless" / "dictloop.py"


def capture(args: list[str], env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTRACK, "capture", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2]


def gone(pid: int) -> bool:
    """Exited (a zombie too: after memtrack's death, init reaps it in its own time)."""
    return state(pid) in (None, "Z")


def wait_for(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def started(out: Path) -> int:
    """The root pid, once a capture has written its first manifest."""
    wait_for(lambda: (out / "manifest.json").exists(), 300, "the capture to start")
    return int(json.loads((out / "manifest.json").read_text())["root_pid"])


def min_stack_ring_pages() -> int:
    """The smallest --stacks-ring-pages capture accepts here in pause mode with
    --stack-copies."""
    from memtrack.capture.drain import min_ring_pages
    from memtrack.capture.options import CaptureOptions
    from memtrack.capture.stacks import record_words

    return min_ring_pages(record_words(CaptureOptions().stack_budget, True) * 8,
                          os.cpu_count() or 1)


def printed_pauses(stderr: str, ring: str) -> int:
    m = re.search(rf"paused the traced processes [\d,]+ times \(.*{ring} ring ([\d,]+)", stderr)
    assert m, stderr
    return int(m[1].replace(",", ""))


# ---- no loss under load ---------------------------------------------------------------

@pytest.mark.bpf
def test_python_loop_under_two_cpu_hogs_loses_nothing(tmp_path: Path) -> None:
    """The PYTHONMALLOC=malloc loop with stacks on while two CPU hogs keep both cores
    busy: every allocation the program made, as an LD_PRELOAD shim counted them in the
    program, is in the artifact, each with its stack record."""
    shim = build(["lossless/count_shim.c"], shared=True, flags=("-O0",))
    out, counts = tmp_path / "py.memtrack", tmp_path / "counts.txt"
    p = subprocess.Popen(
        [*MEMTRACK, "capture", "-o", str(out), "--", "env", f"LD_PRELOAD={shim}",
         f"COUNT_SHIM_OUT={counts}", "/usr/bin/python3", str(DICTLOOP), "100000"],
        env={**os.environ, "PYTHONMALLOC": "malloc"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    started(out)
    with cpu_hogs(2):
        stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    assert stdout.strip() == "100" and "LOST" not in stderr
    art = Artifact.open(out)
    assert art.manifest.complete and art.manifest.nonzero_losses() == {}
    want = {k: int(v) for k, v in (line.split() for line in counts.read_text().splitlines())}
    # PYTHONMALLOC=malloc reached the program (~5 a loop), though memtrack's own
    # interpreter runs without it (cmdenv)
    assert want["malloc"] > 400_000
    ev = art.read("events").table
    mine = ev.filter(np.asarray(ev["allocator"]) == Allocator.OTHER)  # the shim's calls
    got = Counter(mine["kind"].to_pylist())
    assert {"malloc": got[M], "calloc": got[C], "realloc": got[R], "free": got[F]} == want
    kinds = mine["kind"].to_numpy()
    hashes = mine["stack_hash"].to_numpy()[np.isin(kinds, [M, C, R])]
    assert (hashes != 0).all()
    # a Python stack names the native stack record it extends
    native = native_hashes(art.read("py_stacks").table, hashes)
    assert np.isin(native, art.read("stacks").table["hash"].to_numpy()).all()
    drain = art.manifest.drain
    assert drain["rounds"] > 0 and 0 < drain["worst_gap_ns"] and drain["cpu_ns"] > 0


@pytest.mark.bpf
def test_tiny_events_ring_pauses_and_loses_nothing(tmp_path: Path) -> None:
    """A one-page events ring (56 records) under four allocating threads: the default
    mode stops the program whenever the ring is half full; every event is there, in
    order, and the pauses are counted and printed."""
    exe = build(["capture/threads.c"], libs=("-lpthread",))
    out = tmp_path / "t.memtrack"
    r = capture(["-o", str(out), "--stacks", "off", "--rss", "off", "--modules", "off",
                 "--events-ring-pages", "1", "--fail-on-loss", "--", str(exe)])
    assert r.returncode == 0, r.stderr
    assert "LOST" not in r.stderr and "ev/s" not in r.stderr  # no status line off a tty
    art = Artifact.open(out)
    bp = art.manifest.backpressure
    assert art.manifest.nonzero_losses() == {} and bp["mode"] == "pause"
    assert bp["pauses"]["events"] == printed_pauses(r.stderr, "events") > 10
    assert bp["paused_ns"] > 0
    ev = art.read("events").table.to_pylist()
    tids = {int(t): int(tid) for t, tid in re.findall(r"^thread (\d) (\d+)$", r.stdout, re.M)}
    assert len(tids) == 4
    for t, tid in tids.items():
        mine = [(e["kind"], e["size"]) for e in ev if e["tid"] == tid and e["kind"] in (M, F)]
        assert mine[:2000] == [(M, 1000 + t), (F, 0)] * 1000
        assert all(k == F for k, _ in mine[2000:]) and len(mine) <= 2002  # tcache at exit


@pytest.mark.bpf
def test_sigcont_from_outside_does_not_undo_a_pause(tmp_path: Path) -> None:
    """A SIGCONT sent to a paused program (a shell's `bg`, a supervisor; the drain's own
    resume racing with a thread still running) cancels its pending stop: the next
    producer that finds the ring above its watermark stops it again. Before, the program
    ran free until the drain's next round and most of its events were lost."""
    exe = build(["capture/threads.c"], libs=("-lpthread",))
    out = tmp_path / "t.memtrack"
    p = subprocess.Popen([*MEMTRACK, "capture", "-o", str(out), "--stacks", "off", "--rss",
                          "off", "--modules", "off", "--events-ring-pages", "4",
                          "--fail-on-loss", "--", str(exe), "20000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    tids = [int(p.stdout.readline().split()[2]) for _ in range(4)]  # the threads run
    pid = int(re.search(r"^Tgid:\s+(\d+)", Path(f"/proc/{tids[0]}/status").read_text(),
                        re.M)[1])
    sent = 0
    while p.poll() is None:
        try:
            os.kill(pid, signal.SIGCONT)
            sent += 1
        except ProcessLookupError:
            break
        time.sleep(0.01)
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    assert sent > 20 and "LOST" not in stderr
    art = Artifact.open(out)
    assert art.manifest.nonzero_losses() == {}
    assert art.manifest.backpressure["pauses"]["events"] > sent // 2
    ev = art.read("events").table
    mine = np.isin(ev["tid"].to_numpy(), tids)
    assert Counter(ev.filter(mine)["kind"].to_pylist())[M] == 4 * 20000


@pytest.mark.bpf
def test_small_stack_ring_pauses_and_loses_nothing(tmp_path: Path) -> None:
    """Eight threads whose every allocation writes a stack record (--stack-copies: its
    raw copy too), through the smallest stack ring capture accepts: the stack ring
    pauses them, no record is lost and every allocation's stack has its record."""
    exe = build(["stacks/churn.c"], libs=("-lpthread",), flags=("-O1",))
    out = tmp_path / "s.memtrack"
    r = capture(["-o", str(out), "--rss", "off", "--modules", "off", "--stack-copies", "on",
                 "--stacks-ring-pages", str(min_stack_ring_pages()), "--", str(exe), "1000", "8"])
    assert r.returncode == 0, r.stderr
    assert "LOST" not in r.stderr
    art = Artifact.open(out)
    assert art.manifest.nonzero_losses() == {}
    assert art.manifest.backpressure["pauses"]["stacks"] == printed_pauses(r.stderr, "stacks")
    assert art.manifest.backpressure["pauses"]["stacks"] > 0
    ev = art.read("events").table
    kinds, hashes = ev["kind"].to_numpy(), ev["stack_hash"].to_numpy()
    alloc = hashes[(kinds == M) & (ev["pid"].to_numpy() == art.manifest.root_pid)]
    assert alloc.size >= 8000 and (alloc != 0).all()
    assert np.isin(alloc, art.read("stacks").table["hash"].to_numpy()).all()


# ---- capture killed -----------------------------------------------------------------

def check_cut_short(out: Path) -> dict:
    info = subprocess.run([*MEMTRACK, "info", "--json", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert any("the capture was cut short" in w for w in data["warnings"])
    db = out.with_suffix(".duckdb")
    proc = subprocess.run([*MEMTRACK, "process", str(out), "-o", str(db)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "the capture was cut short" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return data


@pytest.mark.bpf
def test_sigkill_mid_run_leaves_a_readable_artifact(tmp_path: Path) -> None:
    out = tmp_path / "k.memtrack"
    p = subprocess.Popen([*MEMTRACK, "capture", "-o", str(out), "--modules", "off", "--",
                          "/usr/bin/python3", str(DICTLOOP), "400000"],
                         env={**os.environ, "PYTHONMALLOC": "malloc"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = started(out)
    wait_for(lambda: (out / "events.arrow").stat().st_size > 1 << 20, 300, "events written")
    p.send_signal(signal.SIGKILL)
    stdout, _ = p.communicate(timeout=300)  # EOF once the program is done too
    assert stdout.strip() == "400"  # it ran to its end
    wait_for(lambda: gone(root), 30, "the program to exit")
    data = check_cut_short(out)
    assert data["tables"]["events"]["rows"] > 10_000
    assert not data["manifest"]["complete"]


@pytest.mark.bpf
@pytest.mark.parametrize("why", ["attach", "pause"])
def test_sigkill_while_the_program_is_stopped(tmp_path: Path, why: str) -> None:
    """memtrack frozen, the program stops (its next exec files an attach request; or
    the one-page events ring fills up), then memtrack is killed: the supervisor
    continues it, it runs to its end, and the artifact reads as cut short."""
    out, go = tmp_path / "k.memtrack", tmp_path / "go"
    if why == "attach":
        cmd = ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; ls -l /proc/$$/fd; "
               "echo done"]
        opts = ["--stacks", "off"]
    else:
        cmd = [str(build(["capture/loop.c"])), "loop", "200000"]
        opts = ["--stacks", "off", "--events-ring-pages", "1"]
    p = subprocess.Popen([*MEMTRACK, "capture", "-o", str(out), "--modules", "off", *opts,
                          "--", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    root = started(out)
    if why == "pause":  # the loop runs (its exec's attach stop is over)
        wait_for(lambda: json.loads((out / "manifest.json").read_text())
                 .get("backpressure", {}).get("pauses", {}).get("events"), 60, "a pause")
    else:
        time.sleep(0.3)
    p.send_signal(signal.SIGSTOP)  # memtrack stops serving; BPF still stops the program

    def tree() -> list[int]:
        kids = Path(f"/proc/{root}/task/{root}/children")
        try:
            return [root, *map(int, kids.read_text().split())]
        except OSError:
            return [root]

    wait_for(lambda: any(state(pid) == "T" for pid in tree()), 60, f"a stop for {why}")
    stopped = [pid for pid in tree() if state(pid) == "T"]
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    wait_for(lambda: all(state(pid) != "T" for pid in stopped), 30, "the supervisor")
    go.touch()
    stdout, _ = p.communicate(timeout=300)
    if why == "attach":
        assert stdout.split()[-1] == "done"
        assert ".memtrack/" not in stdout  # no artifact file was inherited by the program
    else:
        assert int(stdout.split()[-1]) > 0  # the loop's elapsed ns: it ran to its end
    wait_for(lambda: gone(root), 60, "the program to finish")
    check_cut_short(out)


# ---- the stop registry and the environment --------------------------------------------

def test_a_process_goes_on_only_when_no_reason_holds_it() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        stops = StopRegistry()
        os.kill(p.pid, signal.SIGSTOP)  # as BPF does, for an attach and a pause at once
        t0 = time.monotonic_ns()
        wait_for(lambda: state(p.pid) == "T", 10, "the stop")
        stops.hold(p.pid, ATTACH, t0)
        stops.hold(p.pid, PAUSE, t0)
        assert not stops.release(p.pid, ATTACH)
        time.sleep(0.1)
        assert state(p.pid) == "T" and stops.held(p.pid) == {PAUSE}
        assert stops.release(p.pid, PAUSE)
        wait_for(lambda: state(p.pid) == "S", 10, "the SIGCONT")
        # a stop sent before our SIGCONT was cancelled by it: hold() stops it again
        stops.hold(p.pid, ATTACH, t0)
        wait_for(lambda: state(p.pid) == "T", 10, "the stop again")
        assert stops.release_all() == [p.pid]
        wait_for(lambda: state(p.pid) == "S", 10, "the last SIGCONT")
    finally:
        p.kill()
        p.wait()


def test_pythonmalloc_goes_to_the_command_not_to_memtrack(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    own_environment(["memtrack", "capture", "--", "python3"])
    assert calls == []
    monkeypatch.setenv("PYTHONMALLOC", "malloc")
    own_environment(["/x/bin/memtrack", "capture", "-o", "o", "--", "python3"])
    ((exe, argv, env),) = calls
    assert argv == [sys.executable, "-m", "memtrack.cli", "capture", "-o", "o", "--", "python3"]
    assert "PYTHONMALLOC" not in env and env["MEMTRACK_CMD_PYTHONMALLOC"] == "malloc"
    monkeypatch.setattr(os, "environ", env)
    cmd_env = command_environment()
    assert cmd_env["PYTHONMALLOC"] == "malloc" and "MEMTRACK_CMD_PYTHONMALLOC" not in cmd_env


# ---- the status line ------------------------------------------------------------------

@pytest.mark.bpf
def test_status_line_stays_out_of_the_program_output(tmp_path: Path) -> None:
    """In a real terminal (tmux, 80x11): the program's lines scroll above the status
    line, whole, and the status line is gone at the end, the summary printed below."""
    tmux = shutil.which("tmux")
    assert tmux, "tmux missing: run scripts/setup"
    sock = f"memtrack-test-{os.getpid()}"
    prog = "for i in $(seq 1 14); do echo program line $i; sleep 0.35; done"
    cmd = " ".join([*MEMTRACK, "capture", "-o", str(tmp_path / "s.memtrack"), "--stacks",
                    "off", "--rss", "off", "--modules", "off", "--", "sh", "-c", f"'{prog}'"])
    base = [tmux, "-L", sock, "-f", "/dev/null"]
    subprocess.run([*base, "new-session", "-d", "-x", "80", "-y", "11", "-c", str(ROOT),
                    f"sleep 0.5; {cmd}; echo exit=$?; sleep 60", ";", "set", "status", "off"],
                   check=True, env=os.environ)
    try:
        height = int(subprocess.run([*base, "display", "-p", "#{pane_height}"],
                                    capture_output=True, text=True, check=True).stdout)
        assert height == 11

        def screen() -> list[str]:
            return subprocess.run([*base, "capture-pane", "-p"], capture_output=True,
                                  text=True, check=True).stdout.split("\n")[:height]

        during: list[list[str]] = []
        end = time.monotonic() + 300
        while True:
            rows = screen()
            if any(line.startswith("exit=") for line in rows):
                break
            assert time.monotonic() < end, rows
            if "program line 12" in rows and "program line 14" not in rows:  # it runs
                during.append(rows)
            time.sleep(0.1)
        assert during, "never saw the program scroll"
        for seen in during:
            assert seen[-1].startswith("memtrack: ") and "ev/s" in seen[-1], seen
            shown = [r for r in seen[:-1] if r]
            assert all(re.fullmatch(r"program line \d+", r) for r in shown), seen
            numbers = [int(r.split()[-1]) for r in shown]
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), seen
        final = [r for r in rows if r]
        assert "exit=0" in final and not any("ev/s" in r for r in final), "\n".join(final)
        summary = [r for r in final if r.startswith("memtrack: sh exited with status 0")]
        assert summary, final
        assert final.index(summary[0]) > final.index("program line 14"), final
        assert all(re.fullmatch(r"program line \d+", r) for r in final
                   if r.startswith("program")), final
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True)


@pytest.mark.bpf
def test_killed_capture_gives_the_terminal_back(tmp_path: Path) -> None:
    """kill -9 of capture while its status line is up: the supervisor resets the scroll
    region and clears the line, so what follows scrolls the whole screen again."""
    tmux = shutil.which("tmux")
    assert tmux, "tmux missing: run scripts/setup"
    sock, pidf = f"memtrack-test-{os.getpid()}-kill", tmp_path / "pid"
    cmd = " ".join([*MEMTRACK, "capture", "-o", str(tmp_path / "k.memtrack"), "--stacks",
                    "off", "--rss", "off", "--modules", "off", "--", "sleep", "8"])
    base = [tmux, "-L", sock, "-f", "/dev/null"]
    subprocess.run([*base, "new-session", "-d", "-x", "80", "-y", "11", "-c", str(ROOT),
                    f"{cmd} & echo $! > {pidf}; wait; sleep 1; seq 1 30; sleep 60", ";",
                    "set", "status", "off"], check=True, env=os.environ)
    try:
        def screen() -> list[str]:
            return subprocess.run([*base, "capture-pane", "-p"], capture_output=True,
                                  text=True, check=True).stdout.split("\n")[:11]

        wait_for(lambda: "ev/s" in screen()[-1], 300, "the status line")
        os.kill(int(pidf.read_text()), signal.SIGKILL)
        wait_for(lambda: "30" in screen(), 60, "the shell to go on")
        rows = screen()
        assert rows[-2:] == ["30", ""], rows  # the last row scrolls again
        assert not any("ev/s" in r for r in rows), rows
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True)
