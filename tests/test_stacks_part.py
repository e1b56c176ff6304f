"""StacksPart without a kernel: program sizing and what it tells the kernel on a loss."""

from __future__ import annotations

import ctypes as ct
from typing import Any

import numpy as np
import pytest
from support.stackrecords import chain

from memtrack.capture.parts import CaptureOptions
from memtrack.capture.stacks import StacksPart, check_budget
from memtrack.schema.stackrecord import hash_bytes


class FakeTable(dict[int, Any]):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[int] = []

    def __delitem__(self, key: Any) -> None:
        self.deleted.append(key.value if isinstance(key, ct._SimpleCData) else key)


def fake_bpf() -> dict[str, FakeTable]:
    return {"mt_stack_refs": FakeTable(), "mt_stack_seen": FakeTable()}


def test_budget_must_be_whole_chunks_within_limits() -> None:
    assert check_budget(512) == 512 and check_budget(32768) == 32768
    for bad in (0, 511, 1000, 32768 + 512, -512):
        with pytest.raises(ValueError, match="multiple of 512 between 512 and 32768"):
            check_budget(bad)


def test_cflags_size_the_program() -> None:
    flags = StacksPart(CaptureOptions(stack_budget=24576)).cflags()
    assert "-DMT_STACK_BUDGET=24576" in flags
    assert "-DMT_STACK_WORDS=4096" in flags  # next power of two of 3072 words
    assert "-DMT_STACK_DELTA" in flags
    raw = StacksPart(CaptureOptions(stack_compression=False)).cflags()
    assert "-DMT_STACK_DELTA" not in raw and "-DMT_STACK_WORDS=1024" in raw
    with pytest.raises(ValueError, match="power of two"):
        StacksPart(CaptureOptions(stacks_ring_pages=3000))


def test_a_broken_chain_makes_the_kernel_forget_the_thread_and_the_stack() -> None:
    rng = np.random.default_rng(11)
    recs, copies, _ = chain(rng, 6, tid=42)
    other, _, _ = chain(rng, 3, tid=43)
    part = StacksPart(CaptureOptions())
    bpf = fake_bpf()
    part.ingest(bpf, recs[:2] + other[:2])
    part.ingest(bpf, recs[3:4] + other[2:])  # record 2 of thread 42 never arrived
    assert part.chain_breaks == 1
    assert bpf["mt_stack_refs"].deleted == [42]
    assert bpf["mt_stack_seen"].deleted == [hash_bytes(copies[3].tobytes())]
    # the thread's next record (a keyframe after the kernel forgot) is accepted
    again, _, _ = chain(rng, 2, tid=42)
    part.ingest(bpf, again)
    assert part.chain_breaks == 1 and part.records == 8


def test_malformed_records_restart_every_known_chain() -> None:
    rng = np.random.default_rng(12)
    recs, _, _ = chain(rng, 2, tid=5)
    part = StacksPart(CaptureOptions())
    bpf = fake_bpf()
    part.ingest(bpf, recs)
    batch = part.ingest(bpf, [b"\0" * 40])
    assert batch.num_rows == 0 and part.malformed == 1
    assert bpf["mt_stack_refs"].deleted == [5]
