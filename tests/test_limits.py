"""Limits (issue 31): the pytest plugin's memtrack_limit marker, recorded as region labels,
and `memtrack check`, which holds each region to them after `process`.

End to end through the command line (BPF): fixtures/regions/limits.py, five tests of
known allocations, captured with the plugin, processed and checked: exactly the two
tests over a limit are named, with their figures. Without BPF: the plugin's labels and
its one-line refusals against a real control FIFO, sizes, the labels through the stage
into the run database, and check's verdicts on a synthetic run (losses: no verdict; a
label that is no limit: an error)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import FIXTURES, build
from support import synth

from memtrack.capture.control import ControlFifo, run_command
from memtrack.capture.regions import Regions
from memtrack.schema import EVENTS, REGION_LABELS, REGION_NAMES, EventKind
from memtrack.schema.artifact import Artifact, ArtifactWriter
from memtrack.sizes import parse_size

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
sys.path.insert(0, str(FIXTURES / "regions"))
import limits  # noqa: E402  (fixtures/regions/limits.py: its sizes)

ME = threading.get_native_id()


def memtrack(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTRACK, *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


# ------------------------------------------------------------------ end to end (BPF)

@pytest.mark.bpf
def test_check_names_the_tests_over_their_limits(tmp_path: Path) -> None:
    """The suite passes under capture; check exits 1 naming test_peak (3,000,000 B at
    its peak against 2 MB) and test_leak (its ten blocks, 30,045 B, against 0 B), and
    no other: test_within's 1,000 B under 1 KB, test_calls at its limits exactly."""
    work = tmp_path / "suite"
    work.mkdir()
    shutil.copy(FIXTURES / "regions" / "limits.py", work)
    art, db = tmp_path / "l.memtrack", tmp_path / "l.duckdb"
    r = memtrack("capture", "-o", str(art), "--stacks", "off", "--rss", "off", "--modules",
                 "off", "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "limits.py", cwd=work)
    assert r.returncode == 0 and "5 passed" in r.stdout, (r.stdout, r.stderr)
    r = memtrack("process", "-q", str(art), "-o", str(db))
    assert r.returncode == 0, r.stderr

    r = memtrack("check", str(db))
    leaked = sum(limits.LEAK_SIZE + i for i in range(limits.LEAKS))
    assert leaked == 30_045
    assert (r.returncode, r.stderr) == (1, "")
    assert r.stdout.splitlines() == [
        "limits.py::test_peak: peak 2.86 MiB (3,000,000 B) exceeds its limit "
        "2.00 MiB (2,097,152 B)",
        "limits.py::test_leak: leaked 29.34 KiB (30,045 B) exceeds its limit 0 B",
        "2 of 4 limited regions exceeded a limit (9 limits checked)"]

    r = memtrack("check", str(db), "--format", "json")
    assert r.returncode == 1
    got = {reg["name"].split("::")[1]: {lim["metric"]: (lim["measured"], lim["limit"],
                                                         lim["exceeded"])
                                        for lim in reg["limits"]}
           for reg in json.loads(r.stdout)["regions"]}
    assert got == {  # test_unlimited carries no limit: not checked
        "test_within": {"peak": (limits.SMALL, 1024, False), "leaked": (0, 0, False)},
        "test_peak": {"peak": (limits.BIG, 2 << 20, True), "leaked": (0, 0, False)},
        "test_leak": {"peak": (leaked, 1 << 20, False), "leaked": (leaked, 0, True)},
        "test_calls": {"allocated": (10_000, 10_000, False), "calls": (5, 5, False),
                       "leaked": (0, 0, False)}}


@pytest.mark.bpf
def test_check_holds_pytest_memray_markers(tmp_path: Path) -> None:
    """fixtures/regions/memray_limits.py (pytest-memray's markers, stacks on): check
    names test_peak (limit_memory) and test_one_site (6,001 B leaked from one line
    against limit_leaks 4 KB); test_two_sites leaked 3,001 B in all but 1,501 B at most
    from one call stack, within its 2 KB per stack (as pytest-memray judges it)."""
    work = tmp_path / "suite"
    work.mkdir()
    shutil.copy(FIXTURES / "regions" / "memray_limits.py", work)
    art, db = tmp_path / "m.memtrack", tmp_path / "m.duckdb"
    r = memtrack("capture", "-o", str(art), "--rss", "off", "--", sys.executable, "-m",
                 "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers",
                 "memray_limits.py", cwd=work)
    assert r.returncode == 0 and "4 passed" in r.stdout, (r.stdout, r.stderr)
    r = memtrack("process", "-q", str(art), "-o", str(db))
    assert r.returncode == 0, r.stderr

    r = memtrack("check", str(db))
    assert (r.returncode, r.stderr) == (1, "")
    assert r.stdout.splitlines() == [
        "memray_limits.py::test_peak: peak 2.86 MiB (3,000,000 B) exceeds its limit "
        "2.00 MiB (2,097,152 B)",
        "memray_limits.py::test_one_site: leaked_per_stack 5.86 KiB (6,001 B) exceeds "
        "its limit 4.00 KiB (4,096 B)",
        "2 of 4 limited regions exceeded a limit (4 limits checked)"]
    r = memtrack("check", str(db), "--format", "json")
    got = {reg["name"].split("::")[1]: {lim["metric"]: (lim["measured"], lim["limit"])
                                        for lim in reg["limits"]}
           for reg in json.loads(r.stdout)["regions"]}
    assert got == {"test_within": {"peak": (1000, 1024)},
                   "test_peak": {"peak": (3_000_000, 2 << 20)},
                   "test_two_sites": {"leaked_per_stack": (1501, 2048)},
                   "test_one_site": {"leaked_per_stack": (6001, 4096)}}
    r = memtrack("query", str(db), "--format", "csv", "SELECT alive_bytes FROM "
                 "region_metrics WHERE name LIKE '%test_two_sites'")
    assert r.stdout == "alive_bytes\n3001\n", r.stderr


# ------------------------------------------------------- the plugin against a FIFO

SUITE = '''
import pytest

@pytest.mark.memtrack_limit(peak="1.5 KiB", calls=3)
def test_marked():
    pass

@pytest.mark.memtrack_limit(peak="1 GB", leaked="2 kb")
class TestClass:
    @pytest.mark.memtrack_limit(peak="4096", allocated=None)
    def test_closest_wins(self):
        pass

def test_plain():
    pass

@pytest.mark.memtrack_limit(peak="24 XB")
def test_bad_size():
    pass

@pytest.mark.memtrack_limit(rss="1 MB")
def test_bad_key():
    pass

@pytest.mark.memtrack_limit("1 MB")
def test_positional():
    pass

@pytest.mark.memtrack_limit(calls="many")
def test_bad_calls():
    pass
'''


class Kernel:
    """The kernel's side of a region boundary: accepted, not recorded."""

    @staticmethod
    def mark(pid: int, tid: int, region_id: int, begin: bool) -> bool:
        return True


@contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[dict[str, str], Regions, ArtifactWriter]]:
    """A control FIFO served by a thread, as capture serves it (the marks accepted, not
    recorded): its environment, the regions and their artifact writer (closed after)."""
    fifo = ControlFifo(tmp_path, None, None)
    writer = ArtifactWriter(tmp_path / "a.memtrack")
    regs = Regions(Kernel.mark, writer, lambda pid: True)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            fifo.serve(lambda on: None, regs)
            time.sleep(0.0005)

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield fifo.env(), regs, writer
    finally:
        done.set()
        server.join()
        fifo.close()
        regs.flush()
        writer.close()


def labels_by_region(art: Artifact) -> dict[str, dict[str, str]]:
    named = {row["region_id"]: row["name"] for row in art.read("region_names").table.to_pylist()}
    got: dict[str, dict[str, str]] = {}
    for row in art.read("region_labels").table.to_pylist():
        got.setdefault(named[row["region_id"]], {})[row["key"]] = row["value"]
    return got


def run_suite_served(tmp_path: Path, name: str, suite: str) -> tuple[str, ArtifactWriter]:
    """pytest with the plugin over `suite` (written to `name`) under a control FIFO
    served as capture serves it: what pytest printed, and the artifact writer."""
    (tmp_path / name).write_text(suite)
    with serving(tmp_path) as (env, _, writer):
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
             "memtrack.pytest", "--strict-markers", name], cwd=tmp_path,
            env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    return r.stdout, writer


def test_plugin_sends_limits_as_labels(tmp_path: Path) -> None:
    """Under a control FIFO (as under capture), each marked test's region gets its
    limits as limit.* labels in bytes (the closest marker winning per keyword, None
    taking one away), an unmarked test none, and a bad marker fails its test with one
    line and no traceback."""
    out, writer = run_suite_served(tmp_path, "t_limits.py", SUITE)
    assert "4 failed, 3 passed" in out, out
    assert "Traceback" not in out and "memtrack: some tests" not in out
    for line in [
            "memtrack_limit: peak: expected a size such as '24 MB', '512 KiB' or '0 B', "
            "got '24 XB'",
            "memtrack_limit: unknown limit 'rss' (expected peak, leaked, leaked_per_stack, "
            "allocated, calls)",
            "memtrack_limit: takes keywords only (peak=, leaked=, leaked_per_stack=, "
            "allocated=, calls=), got ('1 MB',)",
            "memtrack_limit: calls: expected a number of calls, got 'many'"]:
        assert line in out, (line, out)
    art = Artifact.open(writer.path)
    # the failing tests never began a region: the marker is read first
    assert sorted(r["name"] for r in art.read("region_names").table.to_pylist()) == [
        "t_limits.py::TestClass::test_closest_wins", "t_limits.py::test_marked",
        "t_limits.py::test_plain"]
    assert labels_by_region(art) == {
        "t_limits.py::test_marked": {"limit.peak": "1536", "limit.calls": "3"},
        "t_limits.py::TestClass::test_closest_wins": {"limit.peak": "4096",
                                                      "limit.leaked": "2048"}}


MEMRAY_SUITE = '''
import pytest

@pytest.mark.limit_memory("1.5 MB")
@pytest.mark.limit_leaks(location_limit="1 KB", current_thread_only=True)
def test_both():
    pass

@pytest.mark.limit_memory("1 GB")
@pytest.mark.memtrack_limit(peak="2 GB", leaked="2 KB")
class TestSmallestWins:
    @pytest.mark.limit_memory("1 MB")
    def test_method(self):
        pass

@pytest.mark.limit_leaks("1 KB", filter_fn=lambda stack: True)
def test_filter_fn():
    pass

@pytest.mark.limit_memory("1 MB", current_thread_only=False)
def test_all_threads():
    pass

@pytest.mark.limit_leaked_objects()
def test_objects():
    pass

@pytest.mark.limit_memory("24 XB")
def test_bad_size():
    pass

@pytest.mark.limit_memory("1 MB", "2 MB")
def test_two_sizes():
    pass
'''


def test_plugin_reads_pytest_memray_markers(tmp_path: Path) -> None:
    """pytest-memray's markers under a control FIFO: limit_memory a limit.peak,
    limit_leaks a limit.leaked_per_stack (its size positional or by its keyword), every
    one on the test, class or module applying with memtrack_limit's (the smallest
    wins); filter_fn, current_thread_only=False and limit_leaked_objects, which memtrack
    cannot honour, fail their test with one line saying so."""
    out, writer = run_suite_served(tmp_path, "t_memray.py", MEMRAY_SUITE)
    assert "5 failed, 2 passed" in out, out
    assert "Traceback" not in out and "memtrack: some tests" not in out
    for line in [
            "limit_leaks: filter_fn cannot be honoured: `memtrack check` judges the limits "
            "after the run, where no Python function runs (raise the limit instead)",
            "limit_memory: current_thread_only=False cannot be honoured: memtrack counts "
            "the test's own thread only",
            "limit_leaked_objects: memtrack records bytes, not the objects that outlive a "
            "test: no limit it can hold",
            "limit_memory: expected a size such as '24 MB', '512 KiB' or '0 B', got '24 XB'",
            "limit_memory: takes one size (limit_memory(\"24 MB\"), or limit=) and "
            "current_thread_only=True, got ('1 MB', '2 MB') {}"]:
        assert line in out, (line, out)
    assert labels_by_region(Artifact.open(writer.path)) == {
        "t_memray.py::test_both": {"limit.peak": str(3 << 19),
                                   "limit.leaked_per_stack": "1024"},
        "t_memray.py::TestSmallestWins::test_method": {"limit.peak": str(1 << 20),
                                                       "limit.leaked": "2048"}}


def test_c_header_labels(tmp_path: Path) -> None:
    """memtrack_region_label from C: a label of the open region, 0; a bad key, no key or
    no open region, -1."""
    src = tmp_path / "c.c"
    src.write_text(r"""
#include <stdio.h>
#include "memtrack_control.h"
int main(void) {
    int before = memtrack_region_label("limit.peak", "1");
    memtrack_region_begin("bench one");
    int ok = memtrack_region_label("limit.peak", "1048576")
             | memtrack_region_label("note", "two words");
    int bad = memtrack_region_label("a b", "1"), none = memtrack_region_label("", "1");
    memtrack_region_end();
    printf("%d %d %d %d\n", before, ok, bad, none);
    return 0;
}
""")
    exe = build([src])
    with serving(tmp_path) as (env, _, writer):
        p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **env})
    assert (p.returncode, p.stdout) == (0, "-1 0 -1 -1\n")
    assert labels_by_region(Artifact.open(writer.path)) == {
        "bench one": {"limit.peak": "1048576", "note": "two words"}}


def test_label_command(tmp_path: Path) -> None:
    regs = Regions(Kernel.mark, ArtifactWriter(tmp_path / "a.memtrack"), lambda pid: True)

    def cmd(text: str) -> str:
        return run_command(text, lambda on: None, regs)

    assert cmd("label x=1") == "error label needs a thread id: label TID KEY=VALUE"
    assert cmd(f"label {ME} limit.peak=1") == f"error {ME} thread {ME} has no open region"
    assert cmd(f"begin {ME} r") == f"ok {ME}"
    assert cmd(f"label {ME} limit.peak=1 024") == f"ok {ME}"  # a value may have spaces
    for bad in ("nokey", "=1", "a b=1", "ключ=1", "k" * 101 + "=1"):
        assert cmd(f"label {ME} {bad}") == (
            f"error {ME} label needs KEY=VALUE, the key letters, digits and . _ - "
            "(at most 100)"), bad
    assert cmd(f"label {ME} k=" + "v" * 4000) == (
        f"error {ME} a label is one line of at most 4000 bytes")


def test_sizes() -> None:
    assert [parse_size(s) for s in ("0 B", "4096", " 1 KB ", "1k", "1KiB", "24 MB",
                                    "24mib", "1.5 GB", ".5 K", "2 tb", "1 PB", "3 B")] == [
        0, 4096, 1024, 1024, 1024, 24 << 20, 24 << 20, 3 << 29, 512, 2 << 40, 1 << 50, 3]
    assert parse_size(10) == 10
    for bad in ("", "MB", "-1 MB", "1 XB", "1 MBB", "1e3", "nan", "1,000", "9" * 30):
        with pytest.raises(ValueError, match="expected a size"):
            parse_size(bad)
    for bad_value in (-1, True, 1.5, None):
        with pytest.raises(ValueError, match="expected a size"):
            parse_size(bad_value)  # type: ignore[arg-type]


# ------------------------------------------------------- check on a synthetic run

REGION_ROWS = [  # on top of synth.EVENT_ROWS (pid 100: threads 100 and 101)
    (1150, 100, 100, 1, 1),  # "outer": B C D E of thread 100 (tests/test_regions.py)
    (1650, 100, 100, 0, 1),
    (1240, 100, 101, 1, 2),  # "t101": F, never ended
]
# outer's figures (tests/test_regions.py EXPECTED): peak 6,144, alive 5,096, 8,168
# bytes in 4 calls; t101's: peak 300, alive 0, 300 bytes in 1 call
LABELS = [(1, "limit.peak", "6144"), (1, "limit.leaked", "5095"), (1, "limit.calls", "3"),
          (1, "limit.peak", "6143"), (2, "limit.allocated", "299"), (2, "other", "x"),
          (9, "limit.peak", "0")]  # region 9 does not exist: dropped


def region_run(path: Path, labels: list[tuple[int, str, str]],
               losses: dict[str, int] | None = None) -> Path:
    base = synth.events_table().to_pylist()
    extra = [{"ts": ts, "pid": pid, "tid": tid, "kind": int(EventKind.REGION),
              "allocator": 0, "flags": flags, "addr": rid, "old_addr": 0, "size": 0,
              "stack_hash": 0} for ts, pid, tid, flags, rid in REGION_ROWS]
    events = pa.Table.from_pylist(base + extra, schema=EVENTS)
    names = pa.table({"region_id": [1, 2], "name": ["outer", "t101"]}, schema=REGION_NAMES)
    labels_t = pa.table({k: [row[i] for row in labels]
                         for i, k in enumerate(("region_id", "key", "value"))},
                        schema=REGION_LABELS)
    return synth.write_run(path, events, region_names=names, region_labels=labels_t,
                           command=("p",), losses=losses)


def run_check(db: Path, *args: str) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from memtrack.cli import app

    r = CliRunner().invoke(app, ["check", str(db), *args])
    return r.exit_code, r.stdout, r.stderr


def test_check_verdicts(tmp_path: Path) -> None:
    db = region_run(tmp_path / "run.duckdb", LABELS)
    from memtrack.schema.ddl import open_run

    # the last label of a key wins; labels of no region are dropped
    assert open_run(db).execute("SELECT * FROM region_labels").fetchall() == [
        (1, "limit.calls", "3"), (1, "limit.leaked", "5095"), (1, "limit.peak", "6143"),
        (2, "limit.allocated", "299"), (2, "other", "x")]
    assert run_check(db) == (1, "\n".join([
        "outer: calls 4 exceeds its limit 3",
        "outer: leaked 4.98 KiB (5,096 B) exceeds its limit 4.98 KiB (5,095 B)",
        "outer: peak 6.00 KiB (6,144 B) exceeds its limit 6.00 KiB (6,143 B)",
        "t101: allocated 300 B exceeds its limit 299 B (never ended)",
        "2 of 2 limited regions exceeded a limit (4 limits checked)"]) + "\n", "")
    assert run_check(db, "--pid", "999")[0] == 2  # no such process
    status, out, _ = run_check(db, "--format", "json", "--pid", "100")
    data = json.loads(out)
    assert status == 1 and (data["checked"], data["exceeded"], data["limits"]) == (2, 2, 4)

    within = region_run(tmp_path / "within.duckdb", [(1, "limit.peak", "6144"),
                                                     (1, "limit.leaked", "5096")])
    assert run_check(within) == (
        0, "0 of 1 limited regions exceeded a limit (2 limits checked)\n", "")
    none = region_run(tmp_path / "none.duckdb", [(1, "other", "1")])
    assert run_check(none) == (0, "no region has limits (the pytest plugin's memtrack_limit, "
                                  "limit_memory or limit_leaks markers, or limit.* labels)\n",
                               "")
    lost = region_run(tmp_path / "lost.duckdb", [(1, "limit.peak", "6144")],
                      losses={"events_ring_full": 12})
    assert run_check(lost) == (3, "CANNOT JUDGE: the run lost data: events_ring_full 12\n"
                                  "0 of 1 limited regions exceeded a limit (1 limits checked)"
                                  "\n", "")
    for labels, said in (([(1, "limit.rss", "1")], "unknown limit label 'limit.rss'"),
                         ([(1, "limit.peak", "1 MB")], "label limit.peak='1 MB' is not a "
                                                      "byte count"),
                         ([(1, "limit.calls", "-1")], "label limit.calls='-1' is not a count")):
        bad = region_run(tmp_path / "bad.duckdb", labels)
        status, out, err = run_check(bad)
        assert (status, out) == (2, "") and said in err, err
        bad.unlink()


def test_labels_of_a_hostile_artifact_are_bounded() -> None:
    """Rows whose key is not one capture takes, or whose value is longer than a line
    capture takes, are skipped by the reader (counted as bad rows)."""
    from memtrack.process.read import checked

    t = pa.table({"region_id": [1, 1, 1, None], "key": ["limit.peak", "a b", "k", "k"],
                  "value": ["1", "1", "v" * 5000, "1"]}, schema=REGION_LABELS)
    kept, bad = checked("region_labels", t)
    assert (kept.to_pylist(), bad) == ([{"region_id": 1, "key": "limit.peak", "value": "1"}],
                                       3)
