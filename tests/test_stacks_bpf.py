"""Stack capture in the kernel, through a small harness program of our own.

The harness is common.h + stacks.h (as StacksPart builds them, its tracepoints attached)
plus a uprobe on libc's malloc that calls mt_stack_capture and reports (hash, size, tid)
on a ring; for the uretprobe case, an operator-new probe pair maintains the thread's
return slots (common.h mt_thread) the way the allocator probes do.
"""

from __future__ import annotations

import ctypes as ct
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import build

from memtrack.capture.bcc_compat import attach_uprobe
from memtrack.capture.options import CaptureOptions
from memtrack.capture.parts import BPF_DIR
from memtrack.capture.procfs import read_maps
from memtrack.capture.stacks import RING, StacksPart, start_stack
from memtrack.process.decode import decode_table
from memtrack.schema import STACK_COPIES, STACKS

pytestmark = pytest.mark.bpf

HARNESS = r"""
BPF_RINGBUF_OUTPUT(mt_test_out, 256);
struct mt_test_ev { u64 hash; u64 size; u32 tid; u32 pad; };

int mt_test_malloc(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = (u32)id;
    if (!mt_is_tracked(pid))
        return 0;
    struct mt_thread *t = mt_thread_of(pid, tid, 1);
    if (!t)
        return 0;
    struct mt_test_ev ev = {};
    struct mt_frame f = {.sp = PT_REGS_SP(ctx), .ip = PT_REGS_IP(ctx)};
    ev.hash = mt_stack_capture(ctx, pid, tid, &f);
    ev.size = PT_REGS_PARM1(ctx);
    ev.tid = tid;
    mt_test_out.ringbuf_output(&ev, sizeof(ev), 0);
    return 0;
}

int mt_test_push(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = (u32)id;
    if (!mt_is_tracked(pid))
        return 0;
    struct mt_thread *t = mt_thread_of(pid, tid, 1);
    if (!t)
        return 0;
    struct mt_retslots *r = &t->rs;
    u32 d = r->depth;
    if (d < MT_MAX_NEST) {
        u64 sp = PT_REGS_SP(ctx), v = 0;
        bpf_probe_read_user(&v, sizeof(v), (void *)sp);
        r->slot[d & (MT_MAX_NEST - 1)] = sp;
        r->value[d & (MT_MAX_NEST - 1)] = v;
    }
    r->depth = d + 1;
    return 0;
}

int mt_test_pop(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct mt_thread *t = mt_thread_of(id >> 32, (u32)id, 0);
    if (t && t->rs.depth)
        t->rs.depth -= 1;
    return 0;
}
"""

EV = np.dtype([("hash", "<u8"), ("size", "<u8"), ("tid", "<u4"), ("pad", "<u4")])


def _symbol(lib: bytes, name: bytes) -> tuple[str, int]:
    from bcc import BPF

    path, off = BPF._check_path_symbol(lib, name, None, -1, 0)
    return path.decode(), off


class Harness:
    def __init__(self, budget: int, *, retslots: bool = False, copies: bool = False) -> None:
        from bcc import BPF

        from memtrack.capture.ringbuf import RingReader

        opts = CaptureOptions(stack_budget=budget, stack_copies=copies)
        self.part = StacksPart(opts)
        text = "".join((BPF_DIR / f).read_text() for f in ["common.h", *self.part.sources()])
        self.bpf = BPF(text=text + HARNESS, cflags=self.part.cflags())
        self.warnings = self.part.attach(self.bpf)
        attach_uprobe(self.bpf, "mt_test_malloc", *_symbol(b"c", b"malloc"))
        if retslots:
            path, off = _symbol(b"stdc++", b"_Znwm")
            attach_uprobe(self.bpf, "mt_test_push", path, off)
            attach_uprobe(self.bpf, "mt_test_pop", path, off, retprobe=True)
        self.events = RingReader(self.bpf, "mt_test_out")
        self.ring = RingReader(self.bpf, RING)
        self.ev_parts: list[np.ndarray] = []
        self.batches: list[pa.RecordBatch] = []
        self.copies: list[pa.RecordBatch] = []
        self.top: int | None = None  # the last started fixture's initial sp

    def drain(self) -> None:
        self.ev_parts.append(self.events.read_fixed(EV))
        recs = self.ring.read_records()
        if recs:
            stacks, copies = self.part.ingest(recs)
            self.batches.append(stacks)
            if copies is not None:
                self.copies.append(copies)

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start a fixture that waits for a byte on stdin; track it and give it what an
        attach stop would (kept regions, its main stack's end) before it allocates."""
        p = subprocess.Popen(argv, stdin=subprocess.PIPE)
        self.bpf["mt_tracked"][ct.c_uint32(p.pid)] = ct.c_uint8(1)
        time.sleep(0.05)  # past the dynamic loader
        self.part.on_stop(self.bpf, p.pid, read_maps(p.pid) or [])
        self.top = start_stack(p.pid)
        assert p.stdin is not None
        p.stdin.write(b"x")
        p.stdin.flush()
        return p

    def wait(self, p: subprocess.Popen[bytes], timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while p.poll() is None:
            assert time.monotonic() < end, "fixture did not finish"
            self.drain()
            time.sleep(0.003)
        self.drain()
        assert p.returncode == 0

    def result(self) -> tuple[np.ndarray, pa.Table]:
        return np.concatenate(self.ev_parts), pa.Table.from_batches(self.batches, schema=STACKS)

    def close(self) -> None:
        self.events.close()
        self.ring.close()
        self.part.close()
        self.bpf.cleanup()


def harness(budget: int, **kw: bool) -> Iterator[Harness]:
    h = Harness(budget, **kw)
    try:
        yield h
    finally:
        h.close()


@pytest.mark.parametrize("budget", [8192, 32768])
def test_two_call_paths_give_two_stacks_each_recorded_once(budget: int) -> None:
    exe = build(["stacks/two_paths.c"], flags=("-O0",))
    for h in harness(budget):
        p = h.start([str(exe), "1000", "wait"])
        top = h.top
        h.wait(p)
        ev, stacks = h.result()
        losses = h.part.losses(h.bpf)
        stats = h.part.kernel_stats(h.bpf)
        warnings = h.warnings
    assert warnings == []
    assert ev.size == 2000
    a = np.unique(ev["hash"][ev["size"] == 24])
    b = np.unique(ev["hash"][ev["size"] == 40])
    assert a.size == 1 and b.size == 1 and a[0] != b[0] and 0 not in (a[0], b[0])
    # one record per path, however many calls
    assert sorted(stacks.column("hash").to_pylist()) == sorted([int(a[0]), int(b[0])])
    assert stats["stack_captures"] == 2000 and stats["stack_deduped"] == 1998
    assert stats["stack_ends_learned"] == 0  # the main stack's end came from on_stop
    assert not any(losses.values()), losses
    out = decode_table(stacks)
    assert out.counters["decode_mismatch"] == 0
    assert set(out.table.column("stack_hash").to_pylist()) == {int(a[0]), int(b[0])}
    for rec in out.table.to_pylist():
        assert rec["regs"][7] == rec["sp"]  # rsp in DWARF order, kept
        assert rec["regs"][16] != 0  # rip, kept
        # the copy ends at argc's slot: no environment, no cut, no fp chain
        assert top is not None and rec["sp"] + rec["copy_len"] == top + 8
        assert rec["copy_truncated"] is False and rec["fp_chain"] == []


@pytest.mark.parametrize("budget", [8192, 32768])
def test_churning_locals_share_records_and_every_hash_resolves(budget: int) -> None:
    """Frames full of values of the iteration, at nine recursion depths, on four
    threads: records per (thread, depth), not per allocation."""
    exe = build(["stacks/churn.c"], flags=("-O1", "-pthread"))
    threads, iters = 4, 400
    for h in harness(budget):
        h.wait(h.start([str(exe), str(iters), str(threads), "wait"]))
        ev, stacks = h.result()
        losses = h.part.losses(h.bpf)
        stats = h.part.kernel_stats(h.bpf)
        malformed = h.part.malformed
    mine = ev[(ev["size"] >= 16) & (ev["size"] <= 64)]
    assert mine.size >= threads * iters
    assert not any(losses.values()), losses
    assert malformed == 0
    # thread stacks end where clone3 said: no read faulted to find them
    assert stats["stack_ends_learned"] == 0
    out = decode_table(stacks)
    assert out.counters["decode_mismatch"] == 0
    assert out.counters["stack_records"] == stacks.num_rows
    assert 0 not in set(ev["hash"].tolist())
    assert set(ev["hash"].tolist()) <= set(out.table.column("stack_hash").to_pylist())
    # each (thread, depth) has a stack of its own; beyond that only the return addresses
    # that earlier calls (usleep's) left in uninitialised slots tell records apart
    mine_hashes = np.unique(mine["hash"])
    assert threads * 9 <= mine_hashes.size <= mine.size // 5
    lens = out.table.column("copy_len").to_numpy()
    assert lens.max() <= budget


def test_copies_mode_emits_every_capture_with_its_raw_copy() -> None:
    exe = build(["stacks/churn.c"], flags=("-O1", "-pthread"))
    for h in harness(32768, copies=True):
        h.wait(h.start([str(exe), "50", "2", "wait"]))
        ev, stacks = h.result()
        copies = pa.Table.from_batches(h.copies, schema=STACK_COPIES)
        stats = h.part.kernel_stats(h.bpf)
    assert copies.num_rows == stats["stack_captures"] == ev.size
    for tid in np.unique(ev["tid"]).tolist():  # each thread's captures in order
        mine = pa.compute.equal(copies.column("tid"), tid)
        assert copies.filter(mine).column("hash").to_pylist() == \
            ev["hash"][ev["tid"] == tid].tolist()
    assert stacks.num_rows == np.unique(ev["hash"]).size  # each new hash once
    out = decode_table(stacks)
    canon = dict(zip(out.table.column("stack_hash").to_pylist(),
                     out.table.column("stack").to_pylist(), strict=True))
    for c in copies.slice(0, 40).to_pylist():
        raw = np.frombuffer(c["stack"], np.uint64)
        skel = np.frombuffer(canon[c["hash"]], np.uint64)
        assert raw.size == skel.size
        kept = skel != 0
        # the record's kept words are this copy's words at the same places
        assert np.array_equal(raw[kept], skel[kept])


def _maps_range(pid: int, pred: str) -> list[tuple[int, int, int, str]]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        path = parts[5] if len(parts) > 5 else ""
        if re.search(pred, path):
            out.append((lo, hi, int(parts[2], 16), path))
    return out


def test_uretprobe_trampoline_is_replaced_by_the_real_return_address() -> None:
    exe = build(["stacks/new_caller.cc"], flags=("-O1",))
    nm = subprocess.run(["nm", "-S", "-C", str(exe)], capture_output=True, text=True,
                        check=True).stdout
    m = re.search(r"^([0-9a-f]+) ([0-9a-f]+) T make_obj\(\)$", nm, re.M)
    assert m, nm
    sym, size = int(m.group(1), 16), int(m.group(2), 16)
    for h in harness(8192, retslots=True):
        p = h.start([str(exe), "wait"])
        end = time.monotonic() + 30
        while (sum(x.size for x in h.ev_parts) < 10) and time.monotonic() < end:
            h.drain()
            time.sleep(0.01)
        base = min(lo - off for lo, _, off, path in _maps_range(p.pid, re.escape(str(exe))))
        uprobes = _maps_range(p.pid, r"^\[uprobes\]$")
        # the trampoline page is executable: it is kept, so it would show if left
        h.part.on_stop(h.bpf, p.pid, read_maps(p.pid) or [])
        assert p.stdin is not None
        p.stdin.write(b"x")
        p.stdin.flush()
        h.wait(p)
        ev, stacks = h.result()
    assert uprobes, "no [uprobes] mapping: the uretprobe never fired"
    tramp_lo, tramp_hi = uprobes[0][0], uprobes[0][1]
    lo, hi = base + sym, base + sym + size
    big = set(ev["hash"][ev["size"] == 4242].tolist())
    assert len(big) >= 1 and sum(ev["size"] == 4242) == 10
    want = pa.array(sorted(big), pa.uint64())
    rows = stacks.filter(pa.compute.is_in(stacks.column("hash"), want)).to_pylist()
    assert len(rows) == len(big)
    out = decode_table(stacks)
    assert out.counters["decode_mismatch"] == 0
    decoded = out.table.filter(pa.compute.is_in(out.table.column("stack_hash"), want)).to_pylist()
    assert len(decoded) == len(big)
    fixups = {r["hash"]: r["ret_fixups"] for r in rows}
    for rec in decoded:
        fix = fixups[rec["stack_hash"]]
        assert len(fix) == 1 and lo <= fix[0]["value"] < hi  # operator new's caller
        words = np.frombuffer(rec["stack"], dtype="<u8")
        slot = (fix[0]["slot"] - rec["sp"]) // 8
        assert 0 < slot < words.size and lo <= int(words[slot]) < hi
        assert not ((words >= tramp_lo) & (words < tramp_hi)).any()
