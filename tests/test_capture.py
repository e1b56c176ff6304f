"""Capture end to end: real programs under a real Tracker, exact event sequences with
addresses matched against what the programs print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build
from support.capture import A, C, F, M, R, check_no_loss, run

from memtrack.schema import Allocator

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def tracker(tracker_each_attach: Any) -> Any:
    return tracker_each_attach


@pytest.fixture(scope="module")
def allocs() -> Path:
    return build(["capture/allocs.c"])


def test_malloc_free(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "malloc_free"])
    assert r.result.status == 0
    assert r.seq() == [(M, 512), (F, 0)]
    (p,) = r.printed("malloc")
    assert [e["addr"] for e in r.heap()] == [p, p]
    assert all(e["pid"] == r.result.pid and e["allocator"] == 1 for e in r.heap())
    check_no_loss(r)


def test_double_malloc(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "double_malloc"])
    assert r.seq() == [(M, 1024), (M, 2048), (F, 0), (F, 0)]
    a, b = r.printed("malloc")
    assert [e["addr"] for e in r.heap()] == [a, b, a, b]
    check_no_loss(r)


def test_calloc(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "calloc"])
    assert r.seq() == [(C, 1000), (F, 0)]
    (p,) = r.printed("calloc")
    assert [e["addr"] for e in r.heap()] == [p, p]


def test_realloc(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "realloc"])
    assert r.seq() == [(M, 100), (R, 200), (F, 0)]
    (p,) = r.printed("malloc")
    (q,) = r.printed("realloc")
    h = r.heap()
    assert (h[0]["addr"], h[1]["addr"], h[1]["old_addr"], h[2]["addr"]) == (p, q, p, q)


def test_aligned_alloc(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "aligned_alloc"])
    assert r.seq() == [(A, 512), (F, 0)]
    (p,) = r.printed("aligned_alloc")
    assert p % 64 == 0 and [e["addr"] for e in r.heap()] == [p, p]


def test_posix_memalign_out_pointer_and_einval(tracker: Any, allocs: Path,
                                               tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "posix_memalign"])
    assert "rc 0 1" in r.stdout
    assert r.seq() == [(A, 768), (F, 0)]  # the EINVAL call emits nothing
    (p,) = r.printed("posix_memalign")
    assert p % 128 == 0 and [e["addr"] for e in r.heap()] == [p, p]


def test_many_allocs(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "many_allocs"])
    h = r.heap()
    allocs_ = [e for e in h if e["kind"] == M]
    frees = [e for e in h if e["kind"] == F]
    assert len(allocs_) == 101 and len(frees) == 101
    assert [e["size"] for e in allocs_] == [4096] + [16 + i for i in range(100)]
    # each free's address is its allocation's: the loop frees right after allocating
    assert [e["addr"] for e in h[1:-1:2]] == [e["addr"] for e in h[2:-1:2]]
    assert h[-1]["addr"] == h[0]["addr"] == r.printed("malloc")[0]
    check_no_loss(r)


def test_exit_status_and_info(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, ["sh", "-c", f"{allocs} malloc_free; exit 3"])
    assert r.result.status == 3 and r.result.exit_code == 3
    assert r.art.manifest.exit_status.code == 3
    info = subprocess.run([sys.executable, "-m", "memtrack.cli", "info", "--json", str(r.path)],
                          capture_output=True, text=True, check=True)
    kinds = json.loads(info.stdout)["event_kinds"]
    assert (kinds["fork"], kinds["exec"], kinds["exit"]) == (1, 2, 2)
    procs = r.art.read("processes").table.to_pylist()
    (child,) = [p["pid"] for p in procs if p["exe"] == str(allocs)]
    assert r.after_exec(child) == [(M, 512), (F, 0)]
    check_no_loss(r)


def test_rest_of_the_family_and_failed_calls(tracker: Any, allocs: Path, tmp_path: Path) -> None:
    r = run(tracker, tmp_path, [str(allocs), "misc"])
    assert r.result.status == 0
    a, b, c, d, e = (r.printed(n)[0] for n in ("reallocarray", "memalign", "valloc",
                                                  "pvalloc", "malloc"))
    assert [(x["kind"], x["size"], x["addr"], x["old_addr"]) for x in r.heap()] == [
        (R, 300, a, 0), (A, 100, b, 0), (A, 200, c, 0), (A, 300, d, 0), (M, 50, e, 0),
        (F, 0, e, 0),  # realloc(e, 0) freed it
        (F, 0, a, 0), (F, 0, b, 0), (F, 0, c, 0), (F, 0, d, 0)]
    assert b % 32 == 0 and c % 4096 == 0 and d % 4096 == 0
    check_no_loss(r)


def test_function_the_kernel_refuses_to_probe(tracker: Any, tmp_path: Path) -> None:
    """A lock-prefixed first instruction cannot be probed (ENOTSUPP): that function is
    named in a warning and in manifest.probes, every other one of the module is probed,
    and the capture goes on, counting the gap as a loss (probes_refused)."""
    lib = build(["capture/refused.S"], name="librefused", shared=True)
    exe = build(["capture/refused.c"], libs=("-ldl",))
    r = run(tracker, tmp_path, [str(exe), str(lib)])
    assert r.result.status == 0
    assert r.result.nonzero_losses() == {"probes_refused": 1}
    assert r.art.manifest.nonzero_losses() == {"probes_refused": 1}
    ours = [e for e in r.heap() if e["allocator"] == Allocator.OTHER]
    assert [(e["kind"], e["addr"]) for e in ours] == [(F, 0x5000), (F, 0x5010), (F, 0x5020)]
    probes = {p["function"]: p for p in r.art.manifest.probes if p["path"] == str(lib)}
    assert set(probes) == {"malloc", "free"}
    assert probes["malloc"]["probe_offset"] == 0 and probes["malloc"]["refused"]
    assert "refused" not in probes["free"]
    assert [w for w in r.art.manifest.warnings if "librefused" in w] == [
        f"cannot probe malloc in {lib}: {probes['malloc']['refused']}; "
        "its calls are not recorded"]
