"""Regions without BPF: the control protocol and the helpers against a real control FIFO
(a fake kernel side records the marks), the regions stage on hostile and nested event
streams, the run database's region views and the reports on a synthetic run whose
every figure is worked out by hand below."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from conftest import CONTROL, build
from support import synth
from typer.testing import CliRunner

from memtrack.capture.control import ControlFifo, run_command
from memtrack.capture.regions import Regions
from memtrack.cli import app
from memtrack.control import memtrack_control
from memtrack.process.read import sort_events
from memtrack.process.regions import regions
from memtrack.schema import EVENTS, REGION_NAMES, EventKind
from memtrack.schema.artifact import Artifact, ArtifactWriter
from memtrack.schema.ddl import open_run

K = EventKind
ME = threading.get_native_id()


class Kernel:
    """What the session's side of the kernel does with a mark: record it."""

    def __init__(self, full: int = 0) -> None:
        self.marks: list[tuple[int, int, int, bool]] = []
        self.full = full  # the first `full` marks find the ring full
        self.lock = threading.Lock()

    def mark(self, pid: int, tid: int, region_id: int, begin: bool) -> bool:
        with self.lock:
            if self.full:
                self.full -= 1
                return False
            self.marks.append((pid, tid, region_id, begin))
            return True


def session(tmp_path: Path, kernel: Kernel, tracked: bool = True) -> tuple[Regions, Any]:
    writer = ArtifactWriter(tmp_path / "a.memtrack")
    return Regions(kernel.mark, writer, lambda pid: tracked), writer


def names(regs: Regions, writer: Any) -> list[dict[str, Any]]:
    regs.flush()
    writer.close()
    return Artifact.open(writer.path).read("region_names").table.to_pylist()


def test_commands_and_answers(tmp_path: Path) -> None:
    kernel = Kernel(full=2)
    regs, writer = session(tmp_path, kernel)
    switched: list[bool] = []
    pid = os.getpid()

    def cmd(text: str) -> str:
        return run_command(text, switched.append, regs)

    assert [cmd(c) for c in ("enable", "DISABLE 12", "on", "enable x", "enable 1 2")] == [
        "ok", "ok 12", "ok", "error unknown command 'enable x'",
        "error unknown command 'enable 1 2'"]
    assert switched == [True, False, True]
    assert cmd("begin bench") == "error begin needs a thread id: begin TID NAME"
    assert cmd("frobnicate 3") == "error unknown command 'frobnicate 3'"
    assert cmd(f"begin {ME} bench one") == f"ok {ME}"  # two ring-full retries first
    assert cmd(f"begin {ME} inner") == f"ok {ME}"
    assert cmd(f"end {ME} bench one") == (
        f"error {ME} the innermost open region of thread {ME} is 'inner', not 'bench one'")
    assert cmd(f"end {ME}") == f"ok {ME}"
    assert cmd(f"end {ME} bench one") == f"ok {ME}"
    assert cmd(f"end {ME}") == f"error {ME} thread {ME} has no open region"
    assert cmd(f"begin {ME}") == f"error {ME} begin needs a name"
    assert cmd("begin 999999999 x") == "error 999999999 no thread 999999999"
    assert cmd(f"begin {ME} " + "x" * 4001).startswith(f"error {ME} a region name is one line")
    assert run_command(f"begin {ME} x", switched.append, None) == (
        f"error {ME} regions are not recorded by this session")
    assert kernel.marks == [(pid, ME, 1, True), (pid, ME, 2, True), (pid, ME, 2, False),
                            (pid, ME, 1, False)]
    assert regs.open_regions() == 0
    assert names(regs, writer) == [{"region_id": 1, "name": "bench one"},
                             {"region_id": 2, "name": "inner"}]


def test_names_go_out_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import memtrack.capture.regions as mod

    regs, writer = session(tmp_path, Kernel())
    monkeypatch.setattr(mod, "NAMES_FLUSH_S", 3600.0)
    for i in range(3):
        run_command(f"begin {ME} r{i}", lambda on: None, regs)
    regs.flush(force=False)  # the batch is young: kept
    assert writer.tables["region_names"].rows == 0
    monkeypatch.setattr(mod, "NAMES_FLUSH_S", 0.0)
    regs.flush(force=False)
    assert writer.tables["region_names"].rows == 3
    regs.flush(force=False)  # nothing new: nothing written
    assert [r["name"] for r in names(regs, writer)] == ["r0", "r1", "r2"]


def test_refusals_of_the_kernel_side(tmp_path: Path) -> None:
    regs, _ = session(tmp_path, Kernel(), tracked=False)
    assert run_command(f"begin {ME} x", lambda on: None, regs) == (
        f"error {ME} thread {ME} (process {os.getpid()}) is not traced")

    def unavailable(*_: object) -> bool:
        raise OSError("BPF_PROG_TEST_RUN: Invalid argument")

    regs = Regions(unavailable, ArtifactWriter(tmp_path / "b.memtrack"), lambda pid: True)
    assert run_command(f"begin {ME} x", lambda on: None, regs) == (
        f"error {ME} regions are unavailable: BPF_PROG_TEST_RUN: Invalid argument")


def serve_until(fifo: ControlFifo, regs: Regions, done: threading.Event) -> None:
    while not done.is_set():
        fifo.serve(lambda on: None, regs)
        time.sleep(0.0005)


@pytest.fixture
def fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    f = ControlFifo(tmp_path, None, None)
    for k, v in f.env().items():
        monkeypatch.setenv(k, v)
    yield f
    f.close()


def test_python_helper_threads_share_the_fifo(tmp_path: Path, fifo: ControlFifo) -> None:
    """Eight threads begin and end regions at once through one FIFO pair: each gets its
    own answers (flock + tags), nothing is lost or crossed."""
    kernel = Kernel()
    regs, writer = session(tmp_path, kernel)
    done = threading.Event()
    server = threading.Thread(target=serve_until, args=(fifo, regs, done))
    server.start()
    results: dict[int, list[bool]] = {}

    def worker(i: int) -> None:
        tid = threading.get_native_id()
        out = results.setdefault(tid, [])
        for j in range(25):
            with memtrack_control.region(f"t{i} r{j}") as on:
                out.append(on)
                out.append(memtrack_control.enable())
            out.append(not memtrack_control.end())  # nothing open: refused
        out.append(memtrack_control.last_error == f"thread {tid} has no open region")

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    server.join()
    assert len(results) == 8 and all(all(v) and len(v) == 76 for v in results.values())
    for tid in results:
        mine = [(rid, begin) for _, t, rid, begin in kernel.marks if t == tid]
        assert len(mine) == 50
        assert all(a[0] == b[0] and a[1] and not b[1] for a, b in zip(mine[::2], mine[1::2],
                                                                     strict=True))
    assert len(names(regs, writer)) == 200


def test_c_header_against_the_fifo(tmp_path: Path, fifo: ControlFifo) -> None:
    """memtrack_control.h from two threads: begin/nested begin/end/end each, ok; a
    refused end is -1; the marks carry each thread's own id."""
    src = tmp_path / "c.c"
    src.write_text(r"""
#include <pthread.h>
#include <stdio.h>
#include "memtrack_control.h"
static void *run(void *name) {
    int rc = memtrack_region_begin((const char *)name) | memtrack_region_begin("nested")
             | memtrack_region_end() | memtrack_region_end();
    printf("%ld %d %d\n", (long)syscall(SYS_gettid), rc, memtrack_region_end());
    return NULL;
}
int main(void) {
    pthread_t a, b;
    pthread_create(&a, NULL, run, "alpha");
    pthread_create(&b, NULL, run, "beta");
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    return memtrack_enable();
}
""")
    exe = build([src], libs=("-lpthread",))
    kernel = Kernel()
    regs, writer = session(tmp_path, kernel)
    done = threading.Event()
    server = threading.Thread(target=serve_until, args=(fifo, regs, done))
    server.start()
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    done.set()
    server.join()
    assert p.returncode == 0
    lines = [ln.split() for ln in p.stdout.splitlines()]
    assert sorted(rc for _, rc, _ in lines) == ["0", "0"]
    assert [last for _, _, last in lines] == ["-1", "-1"]
    tids = {int(t) for t, _, _ in lines}
    assert {t for _, t, _, _ in kernel.marks} == tids and len(kernel.marks) == 8
    assert sorted(r["name"] for r in names(regs, writer)) == [
        "alpha", "beta", "nested", "nested"]


def test_helpers_outside_memtrack_do_nothing(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("MEMTRACK_CONTROL", "MEMTRACK_CONTROL_ACK"):
        monkeypatch.delenv(k, raising=False)
    assert not memtrack_control.active()
    assert memtrack_control.begin("x") is False and memtrack_control.last_error == ""
    with memtrack_control.region("x") as on:
        assert on is False
    with pytest.raises(ValueError, match="one line"):
        memtrack_control.begin("two\nlines")
    src = tmp_path / "t.c"
    src.write_text('#include "memtrack_control.h"\nint main(void) { return '
                   'memtrack_region_begin("x") == -1 && memtrack_region_end() == -1 && '
                   'memtrack_enable() == -1 ? 0 : 1; }\n')
    assert subprocess.run([str(build([src]))]).returncode == 0
    # the module is where `python -m memtrack.control` says, and needs nothing else
    where = subprocess.run([sys.executable, "-m", "memtrack.control"], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert Path(where) == CONTROL
    code = ("import sys; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if "
            "'site-packages' not in p]; import memtrack_control as m; "
            "assert not m.enable(); print(sorted(set(sys.modules) & {'memtrack', 'duckdb', "
            "'pyarrow', 'numpy'}))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(CONTROL)],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ the regions stage

def ev(ts: int, pid: int, tid: int, kind: int, flags: int = 0, addr: int = 0) -> dict:
    return {"ts": ts, "pid": pid, "tid": tid, "kind": int(kind), "allocator": 0,
            "flags": flags, "addr": addr, "old_addr": 0, "size": 0, "stack_hash": 0}


def spans(rows: list[dict], named: dict[int, str] | None = None, end: int = 10_000
          ) -> tuple[list[dict], dict[str, int]]:
    events = sort_events(pa.Table.from_pylist(rows, schema=EVENTS))
    n = named if named is not None else {r["addr"]: f"r{r['addr']}" for r in rows
                                         if r["kind"] == K.REGION}
    names_t = pa.table({"region_id": list(n), "name": list(n.values())}, schema=REGION_NAMES)
    out = regions(events, names_t, end)
    return out.regions.to_pylist(), out.counters


def test_stage_nesting_and_closing() -> None:
    B, E = 1, 0
    got, counters = spans([
        ev(100, 7, 7, K.REGION, B, 1),
        ev(110, 7, 7, K.REGION, B, 2),
        ev(120, 7, 8, K.REGION, B, 3),  # another thread
        ev(130, 7, 7, K.REGION, B, 4),
        ev(140, 7, 7, K.REGION, E, 2),  # ends 2: 4 inside it closes too, not ended
        ev(150, 7, 7, K.REGION, E, 9),  # no such region open: counted
        ev(160, 7, 7, K.REGION, B, 2),  # a second begin of id 2: counted, ignored
        ev(165, 7, 7, K.REGION, B, 0),  # id 0 is no region: counted, ignored
        ev(170, 7, 8, K.EXIT),  # thread 8 exits: 3 closes
        ev(180, 7, 7, K.REGION, B, 5),
        ev(190, 7, 9, K.REGION, B, 6),
        ev(200, 7, 7, K.EXEC),  # the process execs: 1, 5 and 6 (another thread) close
        ev(210, 7, 7, K.REGION, B, 7),  # open at the capture's end
        ev(220, 5, 5, K.EXIT, 1),  # another process's exit: nothing of ours
    ], end=5000)
    by = {r["region_id"]: r for r in got}
    assert sorted(by) == [1, 2, 3, 4, 5, 6, 7]
    assert [(by[i]["parent_id"], by[i]["depth"]) for i in range(1, 8)] == [
        (None, 0), (1, 1), (None, 0), (2, 2), (1, 1), (None, 0), (None, 0)]
    assert [(by[i]["begin_ts"], by[i]["end_ts"], by[i]["ended"]) for i in range(1, 8)] == [
        (100, 200, False), (110, 140, True), (120, 170, False), (130, 140, False),
        (180, 200, False), (190, 200, False), (210, 5000, False)]
    assert by[7]["end_event_id"] is None and by[2]["end_event_id"] == by[4]["end_event_id"]
    assert counters == {"region_ends_unmatched": 1, "regions_duplicate_id": 2,
                        "regions_unnamed": 0}
    got, counters = spans([ev(1, 3, 3, K.REGION, B, 1)], named={})
    assert got[0]["name"] == "[region 1]" and counters["regions_unnamed"] == 1
    assert spans([ev(1, 3, 3, K.MALLOC)])[0] == []


# ------------------------------------------------------------- the run database, reports

REGION_ROWS = [  # on top of synth.EVENT_ROWS (pid 100: threads 100 and 101)
    (1150, 100, 100, K.REGION, 1, 1),  # outer: B C D E of thread 100
    (1240, 100, 101, K.REGION, 1, 3),  # t101: F, never ended (capture end)
    (1350, 100, 100, K.REGION, 1, 2),  # inner (in outer): D, which frees B
    (1450, 100, 100, K.REGION, 0, 2),
    (1650, 100, 100, K.REGION, 0, 1),
]
NAMES = {1: "outer", 2: "inner", 3: "t101"}
# by hand, from synth's events (sizes: B 1024, C 2048, D 4096 realloc of B, E 1000, F 300)
EXPECTED = {
    "outer": {"calls": 4, "bytes": 8168, "frees": 2, "freed_bytes": 3072,
              "peak_heap_bytes": 6144, "peak_heap_ts": 1400, "alive_calls": 2,
              "alive_bytes": 5096, "leaked_calls": 2, "leaked_bytes": 5096, "temporary": 0,
              "rss_at_begin_bytes": 4096, "peak_rss_bytes": 73728, "ended": True,
              "duration_ns": 500, "depth": 0},
    "inner": {"calls": 1, "bytes": 4096, "frees": 1, "freed_bytes": 1024,
              "peak_heap_bytes": 3072, "peak_heap_ts": 1400, "alive_calls": 1,
              "alive_bytes": 4096, "leaked_calls": 1, "leaked_bytes": 4096,
              "rss_at_begin_bytes": 4096, "peak_rss_bytes": 65536, "ended": True, "depth": 1},
    "t101": {"calls": 1, "bytes": 300, "frees": 0, "peak_heap_bytes": 300, "alive_calls": 0,
             "leaked_calls": 0, "ended": False, "end_ts": synth.END_NS,
             "peak_rss_bytes": 73728},
}


def write_region_run(path: Path, names: dict[int, str]) -> Path:
    """synth's run with REGION_ROWS, the regions named by `names`."""
    base = synth.events_table().to_pylist()
    extra = [ev(ts, pid, tid, kind, flags, rid) for ts, pid, tid, kind, flags, rid
             in REGION_ROWS]
    events = pa.Table.from_pylist(base + extra, schema=EVENTS)
    names_t = pa.table({"region_id": list(names), "name": list(names.values())},
                       schema=REGION_NAMES)
    synth.write_run(path, events, region_names=names_t, allocators=[])
    return path


@pytest.fixture(scope="module")
def region_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_region_run(tmp_path_factory.mktemp("regions") / "run.duckdb", NAMES)


def test_region_views(region_run: Path) -> None:
    con = open_run(region_run)
    cur = con.execute("SELECT * FROM region_metrics")
    cols = [d[0] for d in cur.description]
    m = {r[1]: dict(zip(cols, r, strict=True)) for r in cur.fetchall()}
    for name, want in EXPECTED.items():
        assert {k: m[name][k] for k in want} == want, name
    assert m["outer"]["avg_size"] == 8168 / 4 and m["inner"]["parent_id"] == 1
    tl = con.execute("""SELECT region_id, ts, delta, heap_bytes FROM region_heap_timeline
                        ORDER BY region_id, event_id""").fetchall()
    assert tl == [(1, 1200, 1024, 1024), (1, 1300, 2048, 3072), (1, 1400, 3072, 6144),
                  (1, 1500, -2048, 4096), (1, 1600, 1000, 5096), (2, 1400, 3072, 3072),
                  (3, 1250, 300, 300)]
    # attribution: every enclosing region; F (thread 101) never in thread 100's regions
    sizes = dict(con.execute("""
        SELECT region_id, list(a.size ORDER BY a.event_id) FROM region_allocations
        JOIN allocations a USING (alloc_id) GROUP BY 1""").fetchall())
    assert sizes == {1: [1024, 2048, 4096, 1000], 2: [4096], 3: [300]}
    costs = con.execute("""SELECT region_id, sum(peak_bytes), sum(alive_bytes)
                           FROM region_stack_costs GROUP BY 1 ORDER BY 1""").fetchall()
    assert costs == [(1, 2048 + 4096, 5096), (2, 4096, 4096), (3, 300, 0)]


def invoke(*args: str) -> Any:
    r = CliRunner().invoke(app, list(args))
    return r


def test_reports(region_run: Path, tmp_path: Path) -> None:
    r = invoke("report", str(region_run), "--format", "json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["regions"]
    assert [x["name"] for x in rows] == ["outer", "inner", "t101"]  # most bytes first
    assert rows[0]["begin_s"] == pytest.approx((1150 - 900) / 1e9)
    assert rows[0]["peak_heap_at_s"] == pytest.approx((1400 - 900) / 1e9)
    assert (rows[0]["alive_allocations"], rows[0]["leaked_bytes"]) == (2, 5096)
    text = invoke("report", str(region_run)).output
    section = text.split("REGIONS")[1].split("\n\n")[0].splitlines()
    assert " ".join(section[2].split()) == ("4 7.98 KiB 1.99 KiB 6.00 KiB 68.00 KiB "
                                            "72.00 KiB 2 (4.98 KiB) 2 (4.98 KiB) 0.000s outer")
    assert section[3].endswith("  inner") and "[never ended" in section[4]

    r = invoke("report", str(region_run), "--region", "outer", "--format", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert [i["region_id"] for i in data["instances"]] == [1]
    peak = {e["location"]: e["value"] for e in data["sections"]["peak"]}
    assert peak == {"grow": 4096, "make_big": 2048}
    alive = {e["location"]: e["value"] for e in data["sections"]["alive"]}
    assert alive == {"grow": 4096, "make_small": 1000}
    assert data["timelines"]["1"] == [[2.5e-7, 0], [3e-7, 1024], [4e-7, 3072], [5e-7, 6144],
                                      [6e-7, 4096], [7e-7, 5096], [7.5e-7, 5096]]
    text = invoke("report", str(region_run), "--region", "inner").output
    assert "region inner: process 100, thread 100" in text
    assert "peak heap above its begin: 3.00 KiB" in text
    assert "alive at its end: 1 (4.00 KiB)" in text
    assert "ALIVE AT THE REGION'S END\n4.00 KiB from grow (grow.c:" in text
    r = invoke("report", str(region_run), "--region", "out")
    assert r.exit_code == 2
    assert r.output.strip().endswith(
        "no region named 'out' in this run (regions named like it: outer)")
    r = invoke("report", str(region_run), "--region", "outer", "--pid", "200")
    assert "no region named 'outer' in process 200" in r.output

    from memtrack.report.reader import RunReader
    from memtrack.report.regions import RegionReader

    hook = RegionReader(RunReader(open_run(region_run))).by_name()
    assert hook["outer"]["peak_heap_bytes"] == 6144 and hook["t101"]["ended"] is False


def test_run_without_regions(tmp_path: Path) -> None:
    run = synth.write_run(tmp_path / "plain.duckdb")
    data = json.loads(invoke("report", str(run), "--format", "json").output)
    assert data["regions"] == []
    assert "REGIONS" not in invoke("report", str(run)).output


def test_diff_matches_regions_by_name(region_run: Path, tmp_path: Path) -> None:
    """`memtrack diff`: regions matched by name; a renamed one is in one run only; a run
    against itself changes nothing; runs without regions have no regions section."""
    head = write_region_run(tmp_path / "head.duckdb", {**NAMES, 2: "inner2"})
    r = invoke("diff", str(region_run), str(head), "--format", "json")
    assert r.exit_code == 0, r.output
    rows = {x["name"]: x for x in json.loads(r.output)["sections"]["regions"]["rows"]}
    assert set(rows) == {"outer", "t101", "inner", "inner2"}
    assert rows["outer"]["in_base"] and rows["outer"]["in_head"]
    assert rows["outer"]["allocated_bytes"] == {"base": 8168, "head": 8168, "delta": 0,
                                                "relative": 0.0}
    assert rows["outer"]["peak_heap_bytes"]["head"] == 6144
    assert (rows["inner"]["in_head"], rows["inner2"]["in_base"]) == (False, False)
    assert rows["inner"]["allocated_bytes"] == {"base": 4096, "head": 0, "delta": -4096,
                                                "relative": -1.0}
    assert rows["inner2"]["allocated_bytes"]["delta"] == 4096
    assert [x["name"] for x in json.loads(r.output)["sections"]["regions"]["rows"]][2:] == [
        "outer", "t101"]  # biggest change first
    text = invoke("diff", str(region_run), str(head)).output
    section = text.split("REGIONS BY NAME")[1].split("\n\n")[0].splitlines()
    assert section[1].split()[:4] == ["inner", "(only", "in", "base)"]
    assert "| region |" in invoke("diff", str(region_run), str(head), "--format",
                                  "markdown").output
    same = json.loads(invoke("diff", str(region_run), str(region_run), "--format",
                             "json").output)["sections"]["regions"]["rows"]
    assert all(x[k]["delta"] == 0 for x in same for k in ("calls", "allocated_bytes",
                                                          "peak_heap_bytes", "leaked_bytes"))
    plain = synth.write_run(tmp_path / "plain.duckdb")
    assert "regions" not in json.loads(invoke("diff", str(plain), str(plain), "--format",
                                              "json").output)["sections"]
