"""StacksPart without a kernel: program sizing, the kept regions and stack ends it sets
at attach stops, and what it tells the kernel about a record it cannot use."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from support.stackrecords import CODE, SP0, regions_kept, regs_of, ring_record, stack_words

from memtrack.capture.options import CaptureError, CaptureOptions
from memtrack.capture.procfs import MapLine
from memtrack.capture.stacks import (
    ENDS,
    MAIN_STACK_MAX,
    StacksPart,
    check_budget,
    record_words,
    start_stack,
)
from memtrack.schema.stackrecord import REGION_BYTES, REGION_SHIFT


class FakeTable(dict[int, Any]):
    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key.value, value.value)


def fake_bpf() -> dict[str, FakeTable]:
    return {ENDS: FakeTable()}


def test_budget_must_be_whole_chunks_within_limits() -> None:
    assert check_budget(512) == 512 and check_budget(32768) == 32768
    for bad in (0, 511, 1000, 32768 + 512, -512):
        with pytest.raises(ValueError, match="multiple of 512 between 512 and 32768"):
            check_budget(bad)


def test_cflags_size_the_program() -> None:
    flags = StacksPart(CaptureOptions(stack_budget=24576)).cflags()
    assert "-DMT_STACK_BUDGET=24576" in flags
    assert "-DMT_STACK_WORDS=4096" in flags  # next power of two of 3072 words
    assert "-DMT_STACK_OUT_WORDS=8192" in flags  # a record with every word kept fits
    assert record_words(32768, False) < 8192 < record_words(32768, True) <= 16384
    assert "-DMT_STACK_COPIES" not in flags
    dbg = StacksPart(CaptureOptions(stack_copies=True)).cflags()
    assert "-DMT_STACK_COPIES" in dbg and "-DMT_STACK_OUT_WORDS=16384" in dbg
    assert StacksPart(CaptureOptions()).budget == 32768  # the default: a copy ends early
    with pytest.raises(CaptureError, match="^--stacks-ring-pages 3000: must be a power of two"):
        CaptureOptions(stacks_ring_pages=3000)


def region(addr: int) -> int:
    return (addr >> REGION_SHIFT) & (REGION_BYTES - 1)


def test_attach_stop_keeps_code_and_the_main_stack_and_sets_the_stack_end() -> None:
    part = StacksPart(CaptureOptions())
    part.regions = np.zeros(REGION_BYTES, dtype=np.uint8)
    bpf = fake_bpf()
    top = 0x7FFF_F000_0000
    maps = [
        MapLine(0x5555_0000_0000, 0x5555_0003_0000, "r-xp", 0, "fd:01", 5, "/bin/prog"),
        MapLine(0x5555_0003_0000, 0x5555_0009_0000, "rw-p", 0, "00:00", 0, "[heap]"),
        MapLine(top - 0x21000, top, "rw-p", 0, "00:00", 0, "[stack]"),
        MapLine(top + 0x1000, top + 0x3000, "r-xp", 0, "00:00", 0, "[vdso]"),
    ]
    part.on_stop(bpf, os.getpid(), maps)
    kept = np.flatnonzero(part.regions)
    want = {region(0x5555_0000_0000 + k * 0x10000) for k in range(3)}
    want |= {region(top - MAIN_STACK_MAX + k * 0x10000) for k in range(MAIN_STACK_MAX >> 16)}
    want |= {region(top + 0x1000)}
    assert set(kept.tolist()) == want  # the heap is not kept
    # our own main thread's end: argc's slot, above which there are no frames
    assert bpf[ENDS][os.getpid()] == start_stack(os.getpid()) + 8  # type: ignore[operator]


def test_start_stack_reads_startstack_with_any_comm() -> None:
    top = start_stack(os.getpid())
    assert top is not None and top % 8 == 0
    with open("/proc/self/maps") as f:
        stack = next(line for line in f if line.rstrip().endswith("[stack]"))
    lo, hi = (int(x, 16) for x in stack.split()[0].split("-"))
    assert lo < top < hi
    assert start_stack(2**22 + 12345) is None  # no such process


def test_records_that_do_not_parse_are_counted_and_dropped() -> None:
    rng = np.random.default_rng(12)
    kept = regions_kept(CODE, SP0)
    words = stack_words(rng, 64, SP0)
    good = ring_record(words, SP0, regs_of(rng, SP0), kept)
    part = StacksPart(CaptureOptions())
    stacks, copies = part.ingest([good, good[:-8], b"\0" * 40])
    assert stacks.num_rows == 1 and copies is None
    assert part.malformed == 2 and part.records == 1
