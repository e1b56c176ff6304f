"""The capture core with its default parts (stacks and RSS): every allocation carries
the hash of the stack record taken at its outer entry."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from conftest import build
from support.capture import F, M, run

from memtrack.capture.options import CaptureOptions, Tuning
from memtrack.process.decode import decode

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def full_tracker() -> Any:
    from memtrack.capture.tracker import Tracker

    with Tracker(CaptureOptions()) as t:
        assert [p.name for p in t.parts] == ["stacks", "pyframes", "core", "rss"]
        yield t


def test_allocations_carry_their_stack_hash(full_tracker: Any, tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    r = run(full_tracker, tmp_path, [str(allocs), "many_allocs"])
    assert r.result.nonzero_losses() == {}
    stacks = r.art.read("stacks").table
    hashes = set(stacks.column("hash").to_pylist())
    h = r.heap()
    mallocs = [e for e in h if e["kind"] == M]
    assert len(mallocs) == 101
    assert all(e["stack_hash"] != 0 and e["stack_hash"] in hashes for e in mallocs)
    assert all(e["stack_hash"] == 0 for e in h if e["kind"] == F)
    tids = set(stacks.column("tid").to_pylist())
    assert tids == {r.result.pid}
    assert r.art.read("rss").table.num_rows > 0


def test_outer_call_stack_starts_at_its_return_slot(full_tracker: Any, tmp_path: Path) -> None:
    """A probed malloc called from the program: its uretprobe hijacked the return slot
    at sp, and the record restores it (one fixup, the real return address)."""
    allocs = build(["capture/allocs.c"])
    r = run(full_tracker, tmp_path, [str(allocs), "many_allocs"])
    stacks = {s["hash"]: s for s in r.art.read("stacks").table.to_pylist()}
    copies = {d["stack_hash"]: d["stack"] for d in decode(r.art).table.to_pylist()}
    text = _text_ranges(r, allocs)
    mallocs = [e for e in r.heap() if e["kind"] == M]
    assert len(mallocs) == 101
    for e in mallocs:
        rec = stacks[e["stack_hash"]]
        assert [f["slot"] for f in rec["ret_fixups"]] == [rec["sp"]]
        ret = rec["ret_fixups"][0]["value"]
        assert any(lo <= ret < hi for lo, hi in text), hex(ret)
        assert int.from_bytes(copies[e["stack_hash"]][:8], "little") == ret


def test_operator_new_stack_starts_at_the_wrapper(full_tracker: Any, tmp_path: Path) -> None:
    """libstdc++'s operator new is not probed (memtrack.capture.wrappers): the malloc it
    calls records the stack as at operator new's entry, whose return slot no uretprobe
    touched: no fixup, and the copy's first word returns into the program's code."""
    exe = build(["capture/cxx.cc"], name="cxx-libstdc++")
    r = run(full_tracker, tmp_path, [str(exe)], start_disabled=True)
    h = r.heap()
    assert [(e["kind"], e["size"]) for e in h][:3] == [(M, 44444), (M, 8), (M, 88888)]
    stacks = {s["hash"]: s for s in r.art.read("stacks").table.to_pylist()}
    copies = {d["stack_hash"]: d["stack"] for d in decode(r.art).table.to_pylist()}
    text = _text_ranges(r, exe)
    for e in h[:3]:
        rec = stacks[e["stack_hash"]]
        assert rec["ret_fixups"] == []
        ret = int.from_bytes(copies[e["stack_hash"]][:8], "little")
        # main, or std::vector's allocate
        assert any(lo <= ret < hi for lo, hi in text), hex(ret)


def _text_ranges(r: Any, exe: Path) -> list[tuple[int, int]]:
    text = [(m["start"], m["end"]) for m in r.art.read("mappings").table.to_pylist()
            if m["path"] == str(exe) and "x" in m["perms"]]
    assert text
    return text


def test_threads_beyond_their_slots_spill(tmp_path: Path) -> None:
    """Six threads and two per-thread slots (bpf/common.h mt_threads): the threads whose
    slot another one holds keep their state in the spill hash, and every allocation is
    paired and carries its own thread's stack and return slot as with a slot each."""
    from memtrack.capture.tracker import Tracker

    exe = build(["stacks/churn.c"], libs=("-lpthread",), flags=("-O1",))
    iters, threads = 300, 6
    with Tracker(CaptureOptions(rss=False, tuning=Tuning(thread_slots=2))) as t:
        r = run(t, tmp_path, [str(exe), str(iters), str(threads)])
    assert r.result.nonzero_losses() == {}
    stacks = {s["hash"]: s for s in r.art.read("stacks").table.to_pylist()}
    workers = {e["tid"] for e in r.heap() if e["tid"] != r.result.pid}
    assert len(workers) == threads
    for tid in workers:
        mine = [e for e in r.heap() if e["tid"] == tid]
        mallocs = [e for e in mine if e["kind"] == M]
        # thread k's sizes: 16 + ((i + k * 1000003) % 7) * 8, i < iters
        sizes = sorted(e["size"] for e in mallocs)
        assert any(sizes == sorted(16 + ((i + k * 1000003) % 7) * 8 for i in range(iters))
                   for k in range(threads))
        # each malloc's block is freed next (thread exit frees blocks of its own too)
        for a, b in itertools.pairwise(mine):
            if a["kind"] == M:
                assert (b["kind"], b["addr"]) == (F, a["addr"])
        for e in mallocs:
            rec = stacks[e["stack_hash"]]
            assert rec["tid"] == tid
            assert [f["slot"] for f in rec["ret_fixups"]] == [rec["sp"]]
