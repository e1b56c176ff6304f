"""A probe the kernel refuses is a gap in what a capture saw, never silent: another
tool holds a uprobe with a reference counter (a USDT semaphore) on the same function of
the same file, so the kernel refuses memtrack's (EINVAL: one uprobe, two counters). The
gap is counted (probes_refused), printed by capture, fails --fail-on-loss, and is in
`info`, in the report's header and page, and makes `diff`'s gate say the runs are not
comparable unless both have the same gap."""

from __future__ import annotations

import ctypes as ct
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build
from support.page import browsing, page_data

from memtrack.capture import links
from memtrack.capture.allocators import probes_for, read_elf
from memtrack.capture.placement import choose_probe_offset
from memtrack.capture.syscalls import perf_event_open
from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]


def hold_uprobe(path: Path, offset: int, ref_ctr_offset: int) -> int:
    """A perf-event uprobe at `path`+`offset` with a reference counter, as a USDT tool
    makes one; returns its fd (the uprobe lives while it is open)."""
    a = links._Attr(128)
    a.put(0, links._pmu_value("type"), ct.c_uint32)
    a.put(4, links.PERF_ATTR_SIZE_VER5, ct.c_uint32)
    a.put(8, ref_ctr_offset << 32)  # config: ref_ctr_offset in bits 32-63
    a.put(16, 1)
    a.ptr(56, ct.create_string_buffer(str(path).encode()))
    a.put(64, offset)
    return links._check(perf_event_open(a.buf, -1, 0, -1, links.PERF_FLAG_FD_CLOEXEC),
                        "perf_event_open")


def memtrack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTRACK, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def test_refused_probe_is_a_loss(tmp_path: Path) -> None:
    lib = tmp_path / "libmyalloc-copy.so"  # a private copy: nobody else maps it
    shutil.copy(build(["capture/myalloc.c"], name="libmyalloc", shared=True), lib)
    exe = build(["capture/dlopen.c"], libs=("-ldl",))
    (p,) = [p for p in probes_for(read_elf(str(lib))) if p.name == "mi_malloc"]
    code = lib.read_bytes()[p.file_offset:p.file_offset + p.size]
    chosen = int(choose_probe_offset(code, p.vaddr, name=p.name, arg_regs=p.arg_regs).offset)
    # where memtrack puts its probe, and the entry it falls back to
    held = [hold_uprobe(lib, p.file_offset + off, 0x100) for off in {0, chosen}]
    try:
        art = tmp_path / "r.memtrack"
        cap = subprocess.run([*MEMTRACK, "capture", "--stacks", "off", "--fail-on-loss",
                              "-o", str(art), "--", str(exe), str(lib)],
                             capture_output=True, text=True, timeout=300)
    finally:
        for fd in held:
            os.close(fd)
    clean = tmp_path / "clean.memtrack"  # the same run with every probe in place
    assert memtrack("capture", "--stacks", "off", "--fail-on-loss", "-o", str(clean), "--",
                    str(exe), str(lib)).returncode == 0
    assert cap.returncode == 1, cap.stderr
    assert "memtrack: LOST probes_refused = 1" in cap.stderr
    assert f"cannot probe mi_malloc in {lib}" in cap.stderr
    info = subprocess.run([*MEMTRACK, "info", str(art)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert info.returncode == 0 and "probes_refused=1" in info.stdout, info.stdout
    db = tmp_path / "r.duckdb"
    proc = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = subprocess.run([*MEMTRACK, "report", str(db)], capture_output=True, text=True,
                         timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "capture losses: probes_refused 1" in rep.stdout
    # the gap: no mi_malloc call is recorded as one (those 100 blocks are seen only as
    # the libc mallocs that mi_malloc makes)
    q = subprocess.run([*MEMTRACK, "query", str(db), "--format", "csv",
                        "select allocator, count(*) from allocations where size = 4242 "
                        "group by all"], capture_output=True, text=True, timeout=120)
    assert q.returncode == 0 and q.stdout.split()[1:] == ["libc,100"], q.stdout
    con = open_run(db)
    (refused,), = con.execute("select value from meta where key = 'probes_refused'").fetchall()
    assert [(r["path"], r["function"]) for r in json.loads(refused)] == [(str(lib), "mi_malloc")]
    (warnings,), = con.execute("select value from meta where key = 'capture_warnings'"
                               ).fetchall()
    assert any("cannot probe mi_malloc" in w for w in json.loads(warnings))

    # the report names the function; so does its page, drawn in Chromium
    assert f"not recorded: mi_malloc in {lib} (probe refused: " in rep.stdout
    page = tmp_path / "r.html"
    assert memtrack("report", str(db), "--html", str(page)).returncode == 0
    assert page_data(page)["report"]["probes_refused"][0]["function"] == "mi_malloc"
    with browsing(page) as b:
        shown = b.eval("document.getElementById('losses').innerText")
    assert "capture lost: probes_refused 1" in shown and "not recorded: mi_malloc in" in shown

    # diff: a gap on one side only makes the gate's comparison untrustworthy (exit 3),
    # whichever side has it; the same gap on both sides is compared (and said)
    clean_db = tmp_path / "clean.duckdb"
    assert memtrack("process", str(clean), "-o", str(clean_db)).returncode == 0
    for base, head, side in ((db, clean_db, "base"), (clean_db, db, "head")):
        d = memtrack("diff", str(base), str(head), "--fail-above", "1000")
        assert d.returncode == 3, d.stdout + d.stderr
        assert (f"NOT COMPARABLE: only {side} has probes refused (calls not recorded): "
                f"mi_malloc in {lib.name}") in d.stdout
        assert "gate: the runs are not comparable" in d.stdout
        assert memtrack("diff", str(base), str(head)).returncode == 0  # no gate asked
    same = memtrack("diff", str(db), str(db), "--fail-above", "0", "--format", "json")
    assert same.returncode == 0, same.stdout
    trust = json.loads(same.stdout)["trust"]
    assert trust == {"trusted": True, "problems": [],
                     "refused_in_both": [f"mi_malloc in {lib.name}"]}
