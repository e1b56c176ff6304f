"""memtrack capture run inside a container, as `docker run --privileged --pid=host`
makes one: a root of its own (the host's system directories and this checkout
bind-mounted read-only, a tmpfs /tmp), its own mount, UTS, IPC and network namespaces,
proc, sysfs and tracefs mounted inside, and the host's pid namespace. It records what a
capture on the host records. In a pid namespace of its own the BPF programs' pids match
no process it follows: capture refuses, saying what to run instead, and writes nothing
(it recorded nothing and said nothing before)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from conftest import build
from support.cli import cli

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1)")]

CHECKOUT = Path(__file__).resolve().parent.parent
# The container: bind-mount, mount the kernel's file systems, enter the new root.
# Arguments: ROOT OUT CMD...; OUT (on the host) is /out inside. The checkout and the
# interpreter's environment are where they are on the host.
CONTAINER = r"""
set -e
R=$1 OUT=$2; shift 2
for d in /usr /lib /lib64 /bin /sbin /etc /root "$CHECKOUT" "$VENV"; do
    [ -e "$d" ] || continue
    mkdir -p "$R$d"
    mount --bind "$d" "$R$d"
    mount -o remount,bind,ro "$R$d"
done
mkdir -p "$R/proc" "$R/sys" "$R/dev" "$R/tmp" "$R/out"
mount --bind /dev "$R/dev"
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t tracefs nodev "$R/sys/kernel/tracing"
mount -t tmpfs tmpfs "$R/tmp"
mount --bind "$OUT" "$R/out"
exec chroot "$R" env XDG_CACHE_HOME=/out/cache ${PYTHONPATH:+PYTHONPATH=$PYTHONPATH} "$@"
"""


def in_container(tmp_path: Path, out: Path, argv: list[str], *,
                 own_pids: bool = False) -> subprocess.CompletedProcess[str]:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    unshare = ["unshare", "--mount", "--uts", "--ipc", "--net", "--fork",
               *(["--pid"] if own_pids else [])]
    return subprocess.run(
        [*unshare, "bash", "-c", CONTAINER, "container", str(root), str(out), *argv],
        capture_output=True, text=True, timeout=600,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "CHECKOUT": str(CHECKOUT),
             "VENV": sys.prefix,
             **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})


def totals(db: Path) -> dict[str, object]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        mine = "a.pid IN (SELECT pid FROM processes WHERE exe LIKE '%/allocs')"
        calls, size = con.execute(f"SELECT count(*), sum(size)::BIGINT FROM allocations a "
                                  f"WHERE {mine}").fetchone()
        sites = con.execute(f"SELECT DISTINCT f.function FROM allocations a "
                            f"JOIN stack_frames s USING (stack_id) JOIN frames f USING (frame_id) "
                            f"WHERE s.depth = 1 AND {mine} ORDER BY 1").fetchall()
    finally:
        con.close()
    return {"calls": calls, "bytes": size, "sites": [s for (s,) in sites]}


def test_capture_inside_a_container_records_what_the_host_does(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    exe = out / "allocs"
    shutil.copy(build(["capture/allocs.c"]), exe)
    r = in_container(tmp_path, out, [sys.executable, "-m", "memtrack.cli", "capture",
                                     "-o", "/out/in.memtrack", "--", "/out/allocs", "misc"])
    assert r.returncode == 0, r.stderr
    assert "exited with status 0" in r.stderr
    cli("capture", "-o", str(tmp_path / "host.memtrack"), "--", str(exe), "misc")
    for name in ("in", "host"):
        src = out / "in.memtrack" if name == "in" else tmp_path / "host.memtrack"
        cli("process", str(src), "-o", str(tmp_path / f"{name}.duckdb"), "-q")
    inside, host = totals(tmp_path / "in.duckdb"), totals(tmp_path / "host.duckdb")
    assert inside == host
    assert inside["calls"] == 5 and inside["sites"] == ["main"]


def test_a_pid_namespace_of_its_own_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    r = in_container(tmp_path, out, [sys.executable, "-m", "memtrack.cli", "capture",
                                     "-o", "/out/x.memtrack", "--", "/bin/true"],
                     own_pids=True)
    assert r.returncode != 0
    assert "not the host's" in r.stderr and "--pid=host" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / "x.memtrack").exists()
