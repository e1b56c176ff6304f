"""Allocation stacks end to end: the capture core's allocator probes with StacksPart,
written to an artifact, decoded by memtrack.process.decode."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import build

from memtrack.capture.parts import CaptureOptions
from memtrack.commands.info import collect_info
from memtrack.process.decode import decode
from memtrack.schema import EventKind, StackEncoding
from memtrack.schema.artifact import Artifact
from memtrack.schema.stackrecord import hash_bytes

pytestmark = pytest.mark.bpf

# Two Trackers keep the module short: compression off at the default budget, and on at
# the largest budget (which must load). Delta at 8 KiB, the default, is what every
# other capture test runs; the harness tests of test_stacks_bpf cover all four.
CONFIGS = {"raw-8k": (8192, False), "delta-32k": (32768, True)}


@pytest.fixture(scope="module")
def trackers() -> Iterator[Callable[[str], Any]]:
    """One Tracker per configuration, loaded on first use and shared by the module."""
    from memtrack.capture.tracker import Tracker

    loaded: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        def get(name: str) -> Any:
            if name not in loaded:
                budget, delta = CONFIGS[name]
                opts = CaptureOptions(stack_budget=budget, stack_compression=delta)
                loaded[name] = stack.enter_context(Tracker(opts))
            return loaded[name]

        yield get


def capture(tracker: Any, tmp_path: Path, cmd: list[str]) -> Artifact:
    session = tracker.spawn(cmd, tmp_path / "run.memtrack")
    result = session.wait(timeout=120)
    assert result.status == 0
    return Artifact.open(tmp_path / "run.memtrack")


def allocations(art: Artifact) -> pa.Table:
    ev = art.read("events").table
    kinds = pa.array([int(k) for k in (EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC,
                                       EventKind.ALIGNED_ALLOC)], pa.uint8())
    return ev.filter(pc.is_in(ev.column("kind"), kinds))


def real_losses(art: Artifact) -> dict[str, int]:
    return {k: v for k, v in art.manifest.nonzero_losses().items() if k != "stack_truncated"}


def test_two_paths_dedupe_with_compression_off(trackers: Callable[[str], Any],
                                               tmp_path: Path) -> None:
    t = trackers("raw-8k")
    exe = build(["stacks/two_paths.c"], flags=("-O0",))
    art = capture(t, tmp_path, [str(exe), "1000"])
    assert real_losses(art) == {}
    ev = allocations(art)
    size = ev.column("size").to_numpy()
    h = ev.column("stack_hash").to_numpy()
    a, b = np.unique(h[size == 24]), np.unique(h[size == 40])
    assert (size == 24).sum() == 1000 and (size == 40).sum() == 1000
    assert a.size == 1 and b.size == 1 and a[0] != b[0]
    stacks = art.read("stacks").table
    rec = stacks.column("hash").to_numpy()
    assert (rec == a[0]).sum() == 1 and (rec == b[0]).sum() == 1
    # every allocation resolves; no record was emitted twice
    assert set(h.tolist()) <= set(rec.tolist())
    assert np.unique(rec).size == rec.size
    info = collect_info(art.path)["stack_records"]
    assert info["records"] == rec.size and info["raw"] == rec.size
    top = {s["hash"]: s["occurrences"] for s in info["top"]}
    assert top[int(a[0])] == 1000 and top[int(b[0])] == 1000


@pytest.mark.parametrize("name", list(CONFIGS))
def test_churn_every_allocation_resolves(trackers: Callable[[str], Any], name: str,
                                         tmp_path: Path) -> None:
    t = trackers(name)
    budget, delta = CONFIGS[name]
    exe = build(["stacks/churn.c"], flags=("-O1", "-pthread"))
    art = capture(t, tmp_path, [str(exe), "300", "4"])
    assert real_losses(art) == {}
    ev = allocations(art)
    hashes = ev.column("stack_hash").to_numpy()
    assert (hashes != 0).all()
    stacks = art.read("stacks").table
    want = StackEncoding.DELTA if delta else StackEncoding.RAW
    assert set(stacks.column("encoding").to_pylist()) == {want}
    out = decode(art)
    assert out.counters["decode_mismatch"] == 0
    decoded = out.table
    assert set(hashes.tolist()) <= set(decoded.column("stack_hash").to_pylist())
    assert decoded.num_rows >= 0.9 * 1200
    assert pc.max(decoded.column("copy_len")).as_py() <= budget
    for rec in decoded.slice(0, 200).to_pylist():
        assert hash_bytes(rec["stack"]) == rec["stack_hash"]
    assert art.manifest.losses["stack_truncated"] == \
        pc.sum(stacks.column("truncated")).as_py()
    if delta:
        info = collect_info(art.path)["stack_records"]
        assert info["keyframes"] <= 6 and info["deltas"] == stacks.num_rows - info["keyframes"]


def test_operator_new_caller_return_address(trackers: Callable[[str], Any],
                                            tmp_path: Path) -> None:
    t = trackers("delta-32k")
    exe = build(["stacks/new_caller.cc"], flags=("-O1",))
    nm = subprocess.run(["nm", "-S", "-C", str(exe)], capture_output=True, text=True,
                        check=True).stdout
    m = re.search(r"^([0-9a-f]+) ([0-9a-f]+) T make_obj\(\)$", nm, re.M)
    assert m, nm
    art = capture(t, tmp_path, [str(exe)])
    maps = art.read("mappings").table.to_pylist()
    base = min(r["start"] - r["offset"] for r in maps if r["path"] == str(exe))
    lo = base + int(m.group(1), 16)
    hi = lo + int(m.group(2), 16)
    tramps = [(r["start"], r["end"]) for r in maps if r["path"] == "[uprobes]"]
    ev = allocations(art)
    big = ev.filter(pc.equal(ev.column("size"), 4242))
    assert big.num_rows == 10
    assert set(big.column("allocator").to_pylist()) == {2}  # operator new, not its malloc
    out = decode(art).table
    hashes = pa.array(sorted(set(big.column("stack_hash").to_pylist())), pa.uint64())
    recs = out.filter(pc.is_in(out.column("stack_hash"), hashes)).to_pylist()
    assert len(recs) == len(hashes)
    for rec in recs:
        words = np.frombuffer(rec["stack"], dtype="<u8")
        assert lo <= int(words[0]) < hi  # operator new returns into make_obj
        for t_lo, t_hi in tramps:
            assert not ((words >= t_lo) & (words < t_hi)).any()
