"""Process trees and lifecycles: fork, exec through a shell script, threads, dlopen'd
allocators, SIGKILL and exit codes, the control FIFO, libc left intact, mappings and
module copies."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import CONTROL, FIXTURES, build
from support.capture import F, M, check_no_loss, run

from memtrack.elf import read_build_id
from memtrack.schema import Allocator, EventKind
from memtrack.schema.enums import CLONE_THREAD

pytestmark = pytest.mark.bpf



def kinds(r: Any, kind: int) -> list[dict[str, Any]]:
    return [e for e in r.events if e["kind"] == kind]


def test_fork_parent_and_child(tracker: Any, tmp_path: Path) -> None:
    exe = build(["capture/fork.c"])
    r = run(tracker, tmp_path, [str(exe)])
    assert r.result.status == 0
    (parent, pa), = [(int(p), int(a, 16)) for p, a in re.findall(r"^parent (\d+) (\S+)$",
                                                                  r.stdout, re.M)]
    (child, ca), = [(int(p), int(a, 16)) for p, a in re.findall(r"^child (\d+) (\S+)$",
                                                                 r.stdout, re.M)]
    assert parent == r.result.pid
    assert [(e["kind"], e["size"], e["addr"]) for e in r.heap(parent)] == [
        (M, 1111, pa), (F, 0, pa)]
    assert [(e["kind"], e["size"], e["addr"]) for e in r.heap(child)] == [
        (M, 2222, ca), (F, 0, ca)]
    (fork,) = kinds(r, EventKind.FORK)
    assert (fork["pid"], fork["addr"]) == (parent, child)
    assert not fork["flags"] & CLONE_THREAD
    exits = {e["pid"]: e for e in kinds(r, EventKind.EXIT)}
    assert set(exits) == {parent, child}
    procs = {p["pid"]: p for p in r.art.read("processes").table.to_pylist()}
    assert procs[child]["ppid"] == parent and procs[child]["exe"] == str(exe)
    check_no_loss(r)


def test_exec_through_shell_script(tracker: Any, tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    r = run(tracker, tmp_path, [str(FIXTURES / "capture" / "run_allocs.sh"), str(allocs),
                                "double_malloc"])
    assert r.result.status == 0 and "shell done" in r.stdout
    procs = r.art.read("processes").table.to_pylist()
    (child,) = {p["pid"] for p in procs if p["exe"] == str(allocs)}
    assert child != r.result.pid
    assert r.after_exec(child) == [(M, 1024), (M, 2048), (F, 0), (F, 0)]
    a, b = r.printed("malloc")
    assert [e["addr"] for e in r.heap(child)][-4:] == [a, b, a, b]
    execs = {e["pid"] for e in kinds(r, EventKind.EXEC)}
    assert execs == {r.result.pid, child}
    check_no_loss(r)


def test_four_threads_thousand_allocations(tracker: Any, tmp_path: Path) -> None:
    exe = build(["capture/threads.c"], libs=("-lpthread",))
    r = run(tracker, tmp_path, [str(exe)])
    assert r.result.status == 0
    tids = {int(t): int(tid) for t, tid in re.findall(r"^thread (\d) (\d+)$", r.stdout, re.M)}
    assert len(tids) == 4
    for t, tid in tids.items():
        mine = [e for e in r.heap() if e["tid"] == tid]
        # glibc frees the thread's tcache (allocated internally) as the thread exits
        tail = mine[2000:]
        assert all(e["kind"] == F for e in tail) and len(tail) <= 2
        mine = mine[:2000]
        assert [(e["kind"], e["size"]) for e in mine] == [(M, 1000 + t), (F, 0)] * 1000
        assert all(e["pid"] == r.result.pid for e in mine)
        assert [e["addr"] for e in mine[0::2]] == [e["addr"] for e in mine[1::2]]
    new_threads = [e for e in kinds(r, EventKind.FORK) if e["flags"] & CLONE_THREAD]
    assert {e["addr"] for e in new_threads} == set(tids.values())
    check_no_loss(r)


@pytest.fixture(scope="module")
def myalloc() -> Path:
    return build(["capture/myalloc.c"], shared=True)


@pytest.mark.parametrize("threads", [False, True], ids=["one-thread", "two-threads"])
def test_dlopen_allocator_first_allocation(tracker: Any, tmp_path: Path, myalloc: Path,
                                           threads: bool) -> None:
    exe = build(["capture/dlopen.c"], libs=("-ldl", "-lpthread"))
    r = run(tracker, tmp_path, [str(exe), str(myalloc), *(["threads"] if threads else [])])
    assert r.result.status == 0, r.stdout
    tids = [int(t) for t in re.findall(r"^tid (\d+)$", r.stdout, re.M)]
    assert len(tids) == (2 if threads else 1)
    mi = [e for e in r.heap() if e["allocator"] == Allocator.MIMALLOC]
    for tid in tids:
        mine = [(e["kind"], e["size"]) for e in mi if e["tid"] == tid]
        assert mine == [(M, 4242)] * 100 + [(F, 0)] * 100
    assert len(mi) == 200 * len(tids)
    # the libc malloc inside mi_malloc is not reported a second time
    assert not [e for e in r.heap() if e["size"] == 4242 and e["allocator"] != Allocator.MIMALLOC]
    probes = [p for p in r.art.manifest.probes if p["path"] == str(myalloc)]
    assert {p["function"] for p in probes} == {"mi_malloc", "mi_free"}
    check_no_loss(r)


def test_exit_code_three(tracker: Any, tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    r = run(tracker, tmp_path, [str(allocs), "exit3"])
    assert (r.result.status, r.result.exit_code, r.result.signal) == (3, 3, None)
    m = r.art.manifest
    assert m.complete and (m.exit_status.code, m.exit_status.signal) == (3, None)
    assert r.seq() == [(M, 333)]
    (ex,) = kinds(r, EventKind.EXIT)
    assert (ex["size"], ex["flags"]) == (3 << 8, 1)
    check_no_loss(r)


def test_sigkill(tracker: Any, tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    r = run(tracker, tmp_path, [str(allocs), "sigkill"])
    assert (r.result.status, r.result.exit_code, r.result.signal) == (137, None, 9)
    m = r.art.manifest
    assert m.complete and (m.exit_status.code, m.exit_status.signal) == (None, 9)
    assert r.seq() == [(M, 999)] and r.heap()[0]["addr"] == r.printed("malloc")[0]
    (ex,) = kinds(r, EventKind.EXIT)
    assert (ex["size"], ex["flags"]) == (9, 1)
    check_no_loss(r)


def test_start_disabled_records_only_the_enabled_region(tracker: Any,
                                                         tmp_path: Path) -> None:
    exe = build(["capture/cxx.cc"], name="cxx-libstdc++")
    r = run(tracker, tmp_path, [str(exe)], start_disabled=True)
    assert r.result.status == 0
    assert len(r.heap()) == 6
    r2 = run(tracker, tmp_path, [str(exe)], name="enabled")
    assert len(r2.heap()) > 6  # the C++ runtime's own start-up allocation and more


def test_control_fifo_from_a_runner(tracker: Any, tmp_path: Path) -> None:
    """A runner switches recording on through --control-fifo while CMD runs."""
    from memtrack.control import memtrack_control

    allocs = build(["capture/allocs.c"])
    ctl = tmp_path / "ctl"
    script = f"read _ < /dev/null; sleep 0.3; {allocs} malloc_free; sleep 0.3; {allocs} calloc"
    session = tracker.spawn(["sh", "-c", script], tmp_path / "c.memtrack", control=ctl,
                            start_disabled=True)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        session.poll(0.01)
    # enable from another process (a runner) while the session serves the FIFO
    pid = os.fork()
    if pid == 0:
        try:
            ok = memtrack_control.send(ctl, "enable", ctl.with_name("ctl.ack")) == "ok"
        finally:
            os._exit(0 if ok else 1)
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        session.poll(0.01)
    result = session.wait(timeout=30)
    assert result.status == 0
    from support.capture import Run

    r = Run(tmp_path / "c.memtrack", result, "")
    procs = r.art.read("processes").table.to_pylist()
    last = [p["pid"] for p in procs if p["exe"] == str(allocs)][-1]
    assert r.after_exec(last) == [(EventKind.CALLOC, 1000), (F, 0)]


def test_libc_stays_intact(tracker: Any, tmp_path: Path) -> None:
    """bcc 0.26's garbage ref_ctr_offset would bump a byte of libc's first page in
    memory: the traced process's mapped libc must equal the file."""
    session = tracker.spawn(["sleep", "1"], tmp_path / "s.memtrack")
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        session.poll(0.02)
    maps = Path(f"/proc/{session.pid}/maps").read_text().splitlines()
    (line,) = [m for m in maps if m.split()[-1].endswith("/libc.so.6")
               and int(m.split()[2], 16) == 0]
    start = int(line.split("-")[0], 16)
    path = line.split()[-1]
    fd = os.open(f"/proc/{session.pid}/mem", os.O_RDONLY)
    try:
        mem = os.pread(fd, 4096, start)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert mem == f.read(4096)
    result = session.wait(timeout=10)
    assert result.status == 0
    assert any(p["path"] == path for p in tracker.probes.records)


def test_mappings_and_modules(tracker: Any, tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    r = run(tracker, tmp_path, [str(allocs), "malloc_free"])
    maps = r.art.read("mappings").table.to_pylist()
    libc = [m for m in maps if m["path"].endswith("/libc.so.6")]
    assert libc and all(m["pid"] == r.result.pid for m in libc)
    bid = read_build_id(libc[0]["path"])
    assert {m["build_id"] for m in libc} == {bid}
    assert [m for m in maps if m["path"] == "[vdso]" and m["build_id"]]
    mods = {m["path"]: m for m in r.art.modules()}
    assert mods[libc[0]["path"]]["build_id"] == bid
    assert mods[str(allocs)]["build_id"] == read_build_id(allocs)
    assert "[vdso]" in mods
    copied = r.path / "modules" / bid / mods[libc[0]["path"]]["file"]
    assert copied.read_bytes() == Path(libc[0]["path"]).read_bytes()


def test_sigint_stops_the_command_and_writes_the_artifact(tracker: Any,
                                                          tmp_path: Path) -> None:
    session = tracker.spawn(["sleep", "30"], tmp_path / "i.memtrack")
    for _ in range(10):
        session.poll(0.02)
    session.kill(signal.SIGINT)
    result = session.wait(timeout=10)
    assert result.signal == signal.SIGINT and result.status == 130
    assert (tmp_path / "i.memtrack" / "manifest.json").exists()


def test_misuse_fails_with_a_message(tracker: Any, tmp_path: Path) -> None:
    from memtrack.capture.tracker import CaptureError

    session = tracker.spawn(["sleep", "0.2"], tmp_path / "a.memtrack")
    with pytest.raises(CaptureError, match="still live"):
        tracker.spawn(["true"], tmp_path / "b.memtrack")
    with pytest.raises(CaptureError, match="finish\\(\\) while the session"):
        tracker.finish()
    assert session.wait(timeout=10).status == 0
    with pytest.raises(CaptureError, match="cannot run /nonexistent: No such file"):
        tracker.spawn(["/nonexistent"], tmp_path / "c.memtrack")
    assert not (tmp_path / "c.memtrack").exists()
    with pytest.raises(CaptureError, match="cannot start true: .*No such file"):
        tracker.spawn(["true"], tmp_path / "d.memtrack", cwd="/nonexistent")
    assert tracker.spawn(["true"], tmp_path / "e.memtrack").wait(timeout=10).status == 0


def test_runs_as_the_given_user_with_live_line(tracker: Any, tmp_path: Path) -> None:
    import io
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="memtrack-test-"))  # reachable by nobody
    os.chmod(shared, 0o777)
    out = shared / "id.txt"
    live = io.StringIO()
    session = tracker.spawn(["sh", "-c", f"id -u > {out}; id -g >> {out}"],
                            tmp_path / "u.memtrack", user=(65534, 65534), live=live)
    assert session.wait(timeout=20).status == 0
    assert out.read_text().split() == ["65534", "65534"]
    out.unlink()
    shared.rmdir()
    assert "events" in live.getvalue() and "ev/s" in live.getvalue()
    art = tmp_path / "u.memtrack"
    from memtrack.schema.artifact import Artifact

    ev = Artifact.open(art).read("events").table.to_pylist()
    assert any(e["kind"] == EventKind.MALLOC for e in ev)  # the unprivileged tree is traced


def test_mmap_events_tell_anonymous_from_file_backed(tracker: Any,
                                                     tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    r = run(tracker, tmp_path, [str(allocs), "malloc_free"])
    mm = kinds(r, EventKind.MMAP)
    anon = [e for e in mm if e["old_addr"] == 2**64 - 1]
    files = [e for e in mm if e["old_addr"] != 2**64 - 1]
    assert anon and files
    prot_exec = [e for e in files if (e["flags"] >> 32) & 4]
    maps = r.art.read("mappings").table.to_pylist()
    libc_x = [m for m in maps if m["path"].endswith("/libc.so.6") and "x" in m["perms"]]
    assert {m["start"] for m in libc_x} <= {e["addr"] for e in prot_exec}


def test_python_program_switches_recording(tracker: Any, tmp_path: Path) -> None:
    import sys

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import memtrack_control as m\n"
            "a = bytearray(7777777)\n"
            "assert m.enable()\n"
            "b = bytearray(8888888)\n"
            "assert m.disable()\n"
            "c = bytearray(9999999)\n")
    r = run(tracker, tmp_path, [sys.executable, "-c", code, str(CONTROL)],
            start_disabled=True)
    assert r.result.status == 0
    sizes = [e["size"] for e in r.heap()]
    assert any(8888888 <= s < 8888888 + 4096 for s in sizes)
    assert not any(7777777 <= s < 7777777 + 4096 or 9999999 <= s < 9999999 + 4096
                   for s in sizes)
