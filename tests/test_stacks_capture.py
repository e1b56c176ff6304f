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

from memtrack.capture.options import CaptureOptions
from memtrack.commands.info import collect_info
from memtrack.process.decode import decode
from memtrack.schema import EventKind
from memtrack.schema.artifact import Artifact

pytestmark = pytest.mark.bpf

# Two Trackers keep the module short: a small budget, and the default (the largest,
# which every other capture test runs too).
CONFIGS = {"8k": 8192, "32k": 32768}


@pytest.fixture(scope="module")
def trackers() -> Iterator[Callable[[str], Any]]:
    """One Tracker per configuration, loaded on first use and shared by the module."""
    from memtrack.capture.tracker import Tracker

    loaded: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        def get(name: str) -> Any:
            if name not in loaded:
                opts = CaptureOptions(stack_budget=CONFIGS[name])
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
    return {k: v for k, v in art.manifest.nonzero_losses().items() if k != "stack_copies_cut"}


def test_two_paths_dedupe_at_a_small_budget(trackers: Callable[[str], Any],
                                            tmp_path: Path) -> None:
    t = trackers("8k")
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
    assert info["records"] == rec.size and info["allocations"] == 2000
    top = {s["hash"]: s["occurrences"] for s in info["top"]}
    assert top[int(a[0])] == 1000 and top[int(b[0])] == 1000


@pytest.mark.parametrize("name", list(CONFIGS))
def test_churn_every_allocation_resolves(trackers: Callable[[str], Any], name: str,
                                         tmp_path: Path) -> None:
    t = trackers(name)
    budget = CONFIGS[name]
    exe = build(["stacks/churn.c"], flags=("-O1", "-pthread"))
    art = capture(t, tmp_path, [str(exe), "300", "4"])
    assert real_losses(art) == {}
    ev = allocations(art)
    hashes = ev.column("stack_hash").to_numpy()
    assert (hashes != 0).all()
    stacks = art.read("stacks").table
    out = decode(art)
    assert out.counters["decode_mismatch"] == 0
    decoded = out.table
    assert set(hashes.tolist()) <= set(decoded.column("stack_hash").to_pylist())
    # records per (thread, depth), not per allocation (test_stacks_bpf says why more)
    assert 4 * 9 <= decoded.num_rows <= ev.num_rows // 4
    assert pc.max(decoded.column("copy_len")).as_py() <= budget
    assert art.manifest.losses["stack_copies_cut"] == 0  # shallow stacks: nothing cut
    assert pc.sum(stacks.column("truncated")).as_py() == 0
    info = collect_info(art.path)["stack_records"]
    assert info["records"] == stacks.num_rows and info["cut"] == 0


def test_operator_new_caller_return_address(trackers: Callable[[str], Any],
                                            tmp_path: Path) -> None:
    t = trackers("32k")
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


@pytest.mark.parametrize("variant", ["O2-fp", "O2-omit-fp"])
def test_a_copy_cut_at_the_budget_ends_there_or_goes_on_with_the_kernel_chain(
        trackers: Callable[[str], Any], variant: str, tmp_path: Path) -> None:
    """rec() 200 deep, about 20 KiB of stack, at an 8 KiB budget: the three counts of
    stacks that do not fit their copy (capture's cut copies, process's stops past the
    copy, and the stacks the kernel's frame-pointer chain continued) say what happened."""
    from support.snaps import VARIANTS, build_fixture

    from memtrack.addrspace.modules import ModuleStore
    from memtrack.process.unwind import unwind

    t = trackers("8k")
    exe = build_fixture(["unwind/cases.c"], VARIANTS[variant], f"cases-{variant}",
                        libs=("-lpthread",))
    art = capture(t, tmp_path, [str(exe), "recursion"])
    big = allocations(art).filter(pc.equal(allocations(art).column("size"), 400))
    assert big.num_rows == 1
    h = big.column("stack_hash")[0].as_py()
    assert art.manifest.losses["stack_copies_cut"] >= 1
    stacks = art.read("stacks").table
    (rec,) = stacks.filter(pc.equal(stacks.column("hash"), pa.scalar(h, pa.uint64()))
                           ).to_pylist()
    assert rec["truncated"] is True and rec["copy_len"] == 8192
    assert rec["fp_chain"] and rec["fp_chain"][0] == rec["regs"][16]  # starts at rip
    decoded = decode(art)
    assert decoded.counters["decode_mismatch"] == 0
    res = unwind(decoded.table, art.read("mappings").table, ModuleStore(art.path))
    (s,) = res.stacks.filter(pc.equal(res.stacks.column("stack_hash"),
                                      pa.scalar(h, pa.uint64()))).to_pylist()
    assert s["stop"] == "truncated" and s["truncated"] and not s["complete"]
    assert res.counters["unwind_stop_truncated"] == 1
    methods = res.stack_frames.filter(pc.equal(res.stack_frames.column("stack_hash"),
                                         pa.scalar(h, pa.uint64()))).column("method")
    kernel = methods.to_pylist().count("fp-kernel")
    if variant == "O2-fp":  # rbp chains: the kernel's walk goes on past the copy
        assert kernel > 10 and res.counters["unwind_stacks_fp_kernel"] == 1
        assert s["depth"] == len(rec["fp_chain"]) + 1, (s, kernel, len(rec["fp_chain"]))
    else:
        assert kernel == 0 and res.counters["unwind_stacks_fp_kernel"] == 0
