"""A process in other mount and pid namespaces (`unshare --mount --pid --fork`, as a
container is) traced from the host, spawned under capture or attached to with --pid:
a library bind-mounted inside the namespace over a host path is another file than the
host's at that path (fixtures/capture/nslib.c, two variants: other function names,
other build ids, the allocator at another offset). The capture probes, copies and
symbolizes the container's file, never the host's, and each process carries its pid on
the host and the one it has inside (1 for the namespace's first process)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from conftest import build

from memtrack.elf import read_build_id
from memtrack.schema import Allocator, EventKind
from memtrack.schema.artifact import Artifact

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1)")]

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
SIZE = 4243  # nsprog's allocations


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The host's library at the path nsprog loads, the container's variant elsewhere."""
    d = tmp_path_factory.mktemp("ns")
    (d / "x").mkdir()
    (d / "c").mkdir()
    host = d / "x" / "libns.so"
    cont = d / "c" / "libns.so"
    shutil.copy(build(["capture/nslib.c"], name="libns_host", shared=True,
                      flags=("-DSIDE=host_side", "-DHOST_PADDING")), host)
    shutil.copy(build(["capture/nslib.c"], name="libns_container", shared=True,
                      flags=("-DSIDE=container_side",)), cont)
    assert read_build_id(host) != read_build_id(cont)
    return {"host": host, "container": cont,
            "prog": build(["capture/nsprog.c"], libs=("-ldl",))}


def in_namespace(files: dict[str, Path], count: int) -> list[str]:
    """nsprog, `count` allocations, as the first process of new mount and pid
    namespaces where the container's library is mounted over the host's."""
    lib = files["host"]
    return ["unshare", "--mount", "--pid", "--fork", "--kill-child", "sh", "-c",
            f"mount --bind {files['container']} {lib} && exec {files['prog']} {lib} {count}"]


def process(art: Path) -> duckdb.DuckDBPyConnection:
    db = art.with_suffix(".duckdb")
    r = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db), "-q"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return duckdb.connect(str(db), read_only=True)


def check_container_library(con: duckdb.DuckDBPyConnection, files: dict[str, Path],
                            pid: int, calls: int | None) -> None:
    """nsprog's allocations went through the container's mi_malloc (probed in its
    file), and their stacks name the container file's functions and build id at the
    path the process mapped it by."""
    got = con.execute("""SELECT allocator, count(*) FROM allocations
                         WHERE pid = ? AND size = ? GROUP BY ALL""", [pid, SIZE]).fetchall()
    assert len(got) == 1 and got[0][0] == "mimalloc", got
    if calls is not None:
        assert got[0][1] == calls
    else:
        assert got[0][1] > 100, got  # about one a millisecond for a second
    frames = con.execute("""
        SELECT DISTINCT sf.depth, f.name, m.build_id, m.path, m.in_artifact
        FROM allocations a JOIN stack_frames sf USING (stack_id)
        JOIN frames f ON f.frame_id = sf.frame_id AND f.inline_depth = 0
        JOIN modules m ON m.module_id = f.module_id
        WHERE a.pid = ? AND a.size = ? AND sf.depth < 3 ORDER BY sf.depth""",
                         [pid, SIZE]).fetchall()
    theirs = read_build_id(files["container"])
    assert frames == [(0, "mi_malloc", theirs, str(files["host"]), True),
                      (1, "container_side", theirs, str(files["host"]), True),
                      (2, "nslib_alloc", theirs, str(files["host"]), True)], frames


def test_spawned_under_unshare(tmp_path: Path, files: dict[str, Path]) -> None:
    art = tmp_path / "run.memtrack"
    r = subprocess.run([*MEMTRACK, "capture", "-o", str(art), "--", *in_namespace(files, 30)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "ready 1\n" in r.stdout  # nsprog sees itself as pid 1
    a = Artifact.open(art)
    rows = a.read("processes").table.to_pylist()
    (prog,) = {row["pid"] for row in rows if row["exe"] == str(files["prog"])}
    (mount,) = {row["pid"] for row in rows if row["exe"].endswith("/mount")}
    root = a.manifest.root_pid
    # unshare's child: a copy of unshare, then sh, then nsprog; sh forked mount before
    # its exec, so mount's first row (its fork) is sh as it was then, never nsprog
    history = {pid: [row["exe"] for row in sorted(rows, key=lambda r: r["ts"])
                     if row["pid"] == pid] for pid in (prog, mount)}
    assert history[prog][1:] == [history[mount][0], str(files["prog"])], history
    assert history[mount][-1].endswith("/mount"), history
    # the host pid and the one inside, at every row that was read from the process (a
    # fork's row is written when the writer sees the fork: null if the child is gone)
    ns = {pid: [row["ns_pid"] for row in sorted(rows, key=lambda r: r["ts"])
                if row["pid"] == pid] for pid in (root, prog, mount)}
    assert ns[root] == [root], ns
    assert set(ns[prog]) - {None} == {1} and ns[prog][-1] == 1, ns  # at its exec
    assert set(ns[mount]) - {None} == {2} and ns[mount][-1] == 2, ns
    assert len({root, prog, mount}) == 3
    # the container's file was copied, not the host's
    copied = {m["build_id"] for m in a.modules() if m["path"] == str(files["host"])}
    assert copied == {read_build_id(files["container"])}
    events = a.read("events").table.to_pylist()
    mine = [(e["kind"], e["allocator"]) for e in events
            if e["pid"] == prog and (e["size"] == SIZE or e["kind"] == EventKind.FREE)
            and e["allocator"] == Allocator.MIMALLOC]
    assert mine == [(EventKind.MALLOC, Allocator.MIMALLOC),
                    (EventKind.FREE, Allocator.MIMALLOC)] * 30
    con = process(art)
    assert con.execute("SELECT pid, ns_pid FROM processes ORDER BY start_ts").fetchall() == [
        (root, root), (prog, 1), (mount, 2)]
    check_container_library(con, files, prog, 30)
    report = subprocess.run([*MEMTRACK, "report", str(art.with_suffix(".duckdb"))],
                            capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr
    lines = {line.split()[0]: line for line in report.stdout.splitlines()
             if line.strip().split(" ")[0].isdigit()}
    assert f"parent {root} (pid 1 in its namespace), exit 0" in lines[str(prog)]
    assert f"parent {prog} (pid 2 in its namespace), exit 0" in lines[str(mount)]
    assert "namespace" not in lines[str(root)]


@contextlib.contextmanager
def running_in_namespace(files: dict[str, Path]) -> Iterator[int]:
    """nsprog allocating until killed, in its namespaces: its pid on the host."""
    p = subprocess.Popen(in_namespace(files, 0), stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready 1\n"
        child = int(Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text())
        yield child
    finally:
        # the namespace's first process takes only SIGKILL (and SIGSTOP) from outside;
        # unshare --kill-child kills it if the test dies first
        with contextlib.suppress(ProcessLookupError):
            os.kill(child or p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def test_attached_in_its_namespace(tmp_path: Path, files: dict[str, Path]) -> None:
    """--modules off: the host's files stand in for the modules, but for the container's
    library, which the host does not have at its path: that one is copied."""
    art = tmp_path / "run.memtrack"
    with running_in_namespace(files) as pid:
        r = subprocess.run([*MEMTRACK, "capture", "-o", str(art), "--pid", str(pid),
                            "--duration", "1", "--modules", "off"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        assert Path(f"/proc/{pid}").exists()  # it runs on
    a = Artifact.open(art)
    assert [(m["path"], m["build_id"]) for m in a.modules()] == [
        (str(files["host"]), read_build_id(files["container"]))]
    assert {(row["pid"], row["ns_pid"]) for row in a.read("processes").table.to_pylist()} \
        == {(pid, 1)}
    con = process(art)
    assert con.execute("SELECT pid, ns_pid FROM processes").fetchall() == [(pid, 1)]
    check_container_library(con, files, pid, None)
    # the program's own frames come from the host's file (the same one: not copied)
    assert con.execute("""
        SELECT count(*) FROM allocations a JOIN stack_frames sf USING (stack_id)
        JOIN frames f ON f.frame_id = sf.frame_id WHERE a.pid = ? AND a.size = ?
        AND f.name = 'main'""", [pid, SIZE]).fetchone()[0] > 0
