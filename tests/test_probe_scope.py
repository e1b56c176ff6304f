"""Probes scoped to the traced tree (the default where the kernel has uprobe_multi
links): no process outside the tree carries a breakpoint of the capture, so gdb and
valgrind elsewhere behave as without one; every process of the tree, however it was
made (fork with and without exec, vfork, posix_spawn, clone(CLONE_VM), threads, a
dlopen'd allocator), is counted exactly, valgrind --trace-children the oracle; two
captures at once each get what they get alone. `--probe-scope host` is the fallback
and says so."""

from __future__ import annotations

import collections
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import build
from support.capture import HEAP_KINDS, INT3, probe_bytes, run

from memtrack.schema import ALLOC_KINDS, EventKind
from memtrack.schema.artifact import Artifact

pytestmark = pytest.mark.bpf

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]


def scopetree() -> tuple[Path, Path]:
    lib = build(["capture/myalloc.c"], name="libmyalloc", shared=True)
    return build(["capture/scopetree.c"], libs=("-ldl", "-lpthread")), lib


def outside() -> Path:
    return build(["capture/outside.c"])


def roles(stdout: str) -> dict[str, int]:
    """"ROLE PID" lines -> {role: pid}."""
    return {role: int(pid) for role, pid in re.findall(r"^(\w+) (\d+)$", stdout, re.M)}


@contextlib.contextmanager
def capture_beside(tmp_path: Path, *options: str) -> Iterator[int]:
    """`memtrack capture` of a shell that forks and allocates until stopped, running
    (its probes attached) while the block runs: yields its root pid; the artifact is
    read after it ends (SIGINT, as Ctrl-C)."""
    art = tmp_path / "beside.memtrack"
    cap = subprocess.Popen([*MEMTRACK, "capture", "--stacks", "off", "--rss", "off",
                            *options, "-o", str(art), "--",
                            "sh", "-c", "while :; do sleep 0.05; done"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield _ready(art, cap)
    finally:
        cap.send_signal(signal.SIGINT)
        _, err = cap.communicate(timeout=60)
    assert cap.returncode == 130, err


def _ready(art: Path, cap: subprocess.Popen[str]) -> int:
    """The root pid once the capture has probed libc for it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert cap.poll() is None, cap.stderr.read() if cap.stderr else ""
        try:
            m = json.loads((art / "manifest.json").read_text())
        except (OSError, ValueError):
            m = {}
        if m.get("root_pid") and any("libc.so" in p["path"] for p in m.get("probes", [])):
            return int(m["root_pid"])
        time.sleep(0.05)
    raise AssertionError("the capture did not start")


@pytest.mark.parametrize("scope", ["auto", "host"])
def test_no_breakpoint_outside_the_tree(tmp_path: Path, scope: str) -> None:
    """The traced tree's libc has the capture's breakpoints in memory; a process that
    runs beside it, started before the capture or during it, has none (with --probe-scope
    host it has them too: the check can fail)."""
    exe = outside()
    before = subprocess.Popen([str(exe), "wait"], stdin=subprocess.PIPE)
    during = None
    try:
        with capture_beside(tmp_path, "--probe-scope", scope) as root:
            during = subprocess.Popen([str(exe), "wait"], stdin=subprocess.PIPE)
            time.sleep(0.3)  # its libc mapped
            art = tmp_path / "beside.memtrack"
            assert set(probe_bytes(root, art).values()) == {INT3}
            for p in (before, during):
                values = set(probe_bytes(p.pid, art).values())
                if scope == "host":
                    assert values == {INT3}
                else:
                    assert INT3 not in values, values
    finally:
        for p in (before, during):
            if p is not None:
                p.communicate(b"x", timeout=30)
    m = Artifact.open(tmp_path / "beside.memtrack").manifest
    assert m.probe_scope == ("host" if scope == "host" else "process")
    host_note = [w for w in m.warnings if "host-wide" in w]
    assert bool(host_note) == (scope == "host")


def gdb_malloc_hits(exe: Path, tmp_path: Path) -> int:
    """gdb's count of hits of a breakpoint on libc's malloc in `exe mallocs 120`."""
    assert shutil.which("gdb"), "gdb missing: run scripts/setup"
    script = tmp_path / "count.gdb"
    script.write_text("set pagination off\nstart\nset $n = 0\nbreak *malloc\ncommands\n"
                      "silent\nset $n = $n + 1\ncontinue\nend\ncontinue\n"
                      'printf "hits %d\\n", $n\n')
    r = subprocess.run(["gdb", "-nx", "-batch", "-x", str(script), "--args", str(exe),
                        "mallocs", "120"], capture_output=True, text=True, timeout=120)
    (hits,) = re.findall(r"^hits (\d+)$", r.stdout, re.M)
    return int(hits)


def test_gdb_and_valgrind_beside_a_capture(tmp_path: Path) -> None:
    """gdb's malloc breakpoint in an unrelated process fires as often, and a valgrind'd
    program calling reallocarray runs as it does, with a capture running beside them."""
    exe = outside()
    assert shutil.which("valgrind"), "valgrind missing: run scripts/setup"
    alone = gdb_malloc_hits(exe, tmp_path)
    assert alone == 120
    vg = ["valgrind", "-q", "--error-exitcode=9", str(exe), "reallocarray", "200"]
    assert subprocess.run(vg, capture_output=True, timeout=120).returncode == 0
    with capture_beside(tmp_path):
        assert gdb_malloc_hits(exe, tmp_path) == alone
        r = subprocess.run(vg, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stderr)


def allocations(art: Artifact, pids: dict[str, int]) -> dict[str, collections.Counter]:
    """Per role, (kind, size) of its allocation events (after its exec, for a leaf)."""
    events = art.read("events").table.to_pylist()
    execs = {e["pid"]: e["ts"] for e in events if e["kind"] == EventKind.EXEC}
    out = {}
    for role, pid in pids.items():
        out[role] = collections.Counter(
            (e["kind"], e["size"]) for e in events
            if e["pid"] == pid and e["kind"] in ALLOC_KINDS and e["ts"] > execs.get(pid, 0))
    return out


def test_tree_counted_like_valgrind(tracker: Any, tmp_path: Path) -> None:
    """Each process of scopetree's tree made as many allocation calls as valgrind
    counts for it (valgrind's count of a child forked without exec starts from its
    parent's at the fork, as its memory does), and its own sizes as the fixture makes
    them."""
    assert shutil.which("valgrind"), "valgrind missing: run scripts/setup"
    exe, lib = scopetree()
    r = run(tracker, tmp_path, [str(exe), str(lib)])
    assert r.result.status == 0 and r.result.nonzero_losses() == {}
    assert r.art.manifest.probe_scope == "process"
    pids = roles(r.stdout)
    assert set(pids) == {"main", "child", "grandchild", "leaf300", "vfork", "leaf400"}
    got = allocations(r.art, pids)
    own = {"main": [(100, 10), (500, 100)], "child": [(200, 20), (4242, 11)],
           "grandchild": [(250, 25)], "leaf300": [(300, 30)], "vfork": [(70, 7)],
           "leaf400": [(400, 40)]}
    for role, sizes in own.items():
        for size, n in sizes:
            assert got[role][(EventKind.MALLOC, size)] == n, (role, size)
    # valgrind's totals, per process
    vg = subprocess.run(["valgrind", "--trace-children=yes", f"--log-file={tmp_path}/vg.%p",
                         str(exe), str(lib)], capture_output=True, text=True, timeout=300)
    assert vg.returncode == 0, vg.stderr
    vg_pids = roles(vg.stdout)
    totals = {}
    for role, pid in vg_pids.items():
        text = (tmp_path / f"vg.{pid}").read_text()
        (allocs,) = re.findall(r"total heap usage: ([\d,]+) allocs", text)
        totals[role] = int(allocs.replace(",", ""))
    events = r.art.read("events").table.to_pylist()
    forked_at = {e["addr"]: (e["pid"], e["ts"]) for e in events if e["kind"] == EventKind.FORK}

    def cumulative(pid: int, until: int) -> int:
        """Allocation calls of `pid` before `until`, counted as valgrind counts them:
        from its exec, or else from its parent's count at the fork."""
        mine = [e for e in events if e["pid"] == pid and e["ts"] < until]
        execs = [e["ts"] for e in mine if e["kind"] == EventKind.EXEC]
        n = sum(1 for e in mine if e["kind"] in ALLOC_KINDS and e["ts"] > max(execs, default=0))
        if not execs and pid in forked_at:
            parent, ts = forked_at[pid]
            n += cumulative(parent, ts)
        return n

    end = max(e["ts"] for e in events) + 1
    assert {role: cumulative(pid, end) for role, pid in pids.items()} == totals


def test_clone_vm_process_counted(tracker: Any, tmp_path: Path) -> None:
    """A clone(CLONE_VM) child without CLONE_THREAD is a process of its own on its
    parent's memory: it gets links of its own, and its allocations are its."""
    exe, lib = scopetree()
    r = run(tracker, tmp_path, [str(exe), str(lib), "clonevm"])
    assert r.result.status == 0
    pids = roles(r.stdout)
    got = allocations(r.art, pids)
    assert got["clonevm"] == {(EventKind.MALLOC, 90): 9}
    assert got["main"][(EventKind.MALLOC, 90)] == 0
    frees = [e for e in r.heap(pids["clonevm"]) if e["kind"] == EventKind.FREE]
    assert len(frees) == 9


def test_exec_from_another_thread(tracker: Any, tmp_path: Path) -> None:
    """A thread other than the leader execs: it leads the process from then on, and the
    new image's allocations are counted once each (the links that held the old leader
    are closed before the new ones are made)."""
    exe, _ = scopetree()
    r = run(tracker, tmp_path, [str(exe), "threadexec"])
    assert r.result.status == 0
    pids = roles(r.stdout)
    assert pids["leaf600"] == pids["main"]
    (ex,) = [e for e in r.events if e["kind"] == EventKind.EXEC and e["ts"] > min(
        e["ts"] for e in r.events if e["kind"] == EventKind.MALLOC)]
    assert ex["addr"] != ex["pid"]  # the old tid: not the leader's
    got = allocations(r.art, {"leaf": pids["main"]})["leaf"]
    assert got[(EventKind.MALLOC, 600)] == 60
    assert sum(1 for e in r.after_exec(pids["main"]) if e == (EventKind.FREE, 0)) >= 59


def heap_table(art: Path, pid: int | None = None) -> pa.Table:
    """The calls of an artifact's heap events (of `pid`) per (kind, size), in that
    order, counted by Arrow: the loops below make millions."""
    t = Artifact.open(art).read("events").table
    keep = pc.is_in(t["kind"], pa.array(sorted(int(k) for k in HEAP_KINDS), t["kind"].type))
    if pid is not None:
        keep = pc.and_(keep, pc.equal(t["pid"], pid))
    return t.filter(keep).group_by(["kind", "size"]).aggregate([("pid", "count")]).sort_by(
        [("kind", "ascending"), ("size", "ascending")])


def heap_counts(art: Path, pid: int | None = None) -> collections.Counter:
    """heap_table as (kind, size) -> calls."""
    g = heap_table(art, pid)
    return collections.Counter({(k, s): n for k, s, n in zip(
        g["kind"].to_pylist(), g["size"].to_pylist(), g["pid_count"].to_pylist(),
        strict=True)})


def heap_by_role(art: Path, stdout: str) -> dict[str, collections.Counter]:
    return {role: heap_counts(art, pid) for role, pid in roles(stdout).items()}


def test_two_captures_at_once(tmp_path: Path) -> None:
    """Two captures of two programs at the same time: each records its own tree as it
    does alone, nothing of the other's, and loses nothing."""
    exe, lib = scopetree()
    loop = build(["capture/outside.c"])
    # long enough (seconds) that the loop's capture is still running once its manifest
    # lists its probes (rewritten every second) and the tree's capture has started
    mallocs = "2000000"

    def start(name: str, cmd: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen([*MEMTRACK, "capture", "--stacks", "off", "--fail-on-loss",
                                 "-o", str(tmp_path / f"{name}.memtrack"), "--", *cmd],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    outs = {}
    for name, cmd in (("tree", [str(exe), str(lib)]), ("loop", [str(loop), "mallocs", mallocs])):
        p = start(f"{name}-alone", cmd)
        outs[name], err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    tree_alone = heap_by_role(tmp_path / "tree-alone.memtrack", outs["tree"])
    # the loop's 2 M sizes compared as tables (as Python counters: 10 s of this test)
    loop_alone = heap_table(tmp_path / "loop-alone.memtrack")
    assert pc.sum(loop_alone["pid_count"]).as_py() >= 2 * int(mallocs)
    loop_p = start("loop", [str(loop), "mallocs", mallocs])
    _ready(tmp_path / "loop.memtrack", loop_p)
    tree_p = start("tree", [str(exe), str(lib)])
    tree_out, tree_err = tree_p.communicate(timeout=300)
    loop_out, loop_err = loop_p.communicate(timeout=300)
    assert tree_p.returncode == 0, tree_err
    assert loop_p.returncode == 0, loop_err
    assert heap_by_role(tmp_path / "tree.memtrack", tree_out) == tree_alone
    loop = heap_table(tmp_path / "loop.memtrack")
    assert loop.equals(loop_alone), (loop.num_rows, loop_alone.num_rows,
                                     pc.sum(loop["pid_count"]), pc.sum(loop_alone["pid_count"]))
    pids = Artifact.open(tmp_path / "loop.memtrack").read("events").table["pid"]
    assert len(pc.unique(pids)) == 1
