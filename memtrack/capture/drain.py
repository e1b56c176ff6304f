"""Moving records out of the BPF rings: a drain thread that only reads, a writer thread
that turns what was read into Arrow batches.

The drain thread waits on nothing but its own timer: every DRAIN_SECONDS it copies
each ring's committed records into memory (`RingReader`: one numpy copy for a ring of
fixed-size records, bytes per record otherwise), advances the ring's consumer position
and queues them on the `Backlog`; then it lets the ring pauses be resumed (stops.Pauses).
Attach requests, control commands and module copies are the session's main thread's;
Arrow conversion, compression and file writes are the writer thread's. The backlog is
bounded: when the writer falls that far behind, the drain leaves the rings alone, they
fill, and the producers pause (or drop, with --on-ring-full drop) instead of memory
growing without end.

A thread, not a process: the drain's work between two reads is a few numpy copies, and
it runs at a higher priority (DRAIN_NICE) so that CPU hogs do not delay its wakeups. It
still shares the GIL with the writer and the main thread: under two CPU hogs on a 2-core
machine its worst gap between two reads was 40-200 ms (the GIL holder preempted), which
a ring of the default size absorbs (its high watermark is ~90 ms of every CPU
allocating flat out, far more under load); bench/bench_lossless.py prints the worst gap,
and the manifest's `drain` section records it for every capture.

`Rings` is the tracker's side of it: a session opens its readers (`Source`s), writes
through the parts, and reaches the attach requests, region marks and ring pauses there.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from memtrack.capture.parts import Ring
from memtrack.capture.ringbuf import Records, RingReader
from memtrack.capture.stops import Pauses, StopRegistry

if TYPE_CHECKING:
    from memtrack.capture.core import CorePart
    from memtrack.schema.artifact import ArtifactWriter

DRAIN_SECONDS = 0.002  # between two drain rounds while records arrive
IDLE_SECONDS = 0.016  # at most, doubling from DRAIN_SECONDS while none do
DRAIN_NICE = -10  # the drain thread's priority (as root): it wakes ahead of CPU hogs
BATCH_ROWS = 65536  # fixed-size records per batch, at most
BATCH_BYTES = 8 << 20  # variable-size record bytes per batch, at most
BATCH_SECONDS = 0.5  # and at least one batch this often while records arrive
HIGH_WATERMARK = 2  # a ring pauses its producers at 1/2 full ...
LOW_WATERMARK = 4  # ... and they resume once every ring is below 1/4
IN_FLIGHT = 2  # records a producer may still write per CPU after its pause


def min_ring_bytes(max_record: int, cpus: int) -> int:
    """The smallest ring whose headroom above the high watermark holds what the
    producers write between crossing it and being stopped."""
    return HIGH_WATERMARK * IN_FLIGHT * max(cpus, 1) * (max_record + 8)


def min_ring_pages(max_record: int, cpus: int) -> int:
    """min_ring_bytes as a ring size the kernel takes: a power of two of pages."""
    need = -(-min_ring_bytes(max_record, cpus) // mmap.PAGESIZE)
    return 1 << (need - 1).bit_length()


@dataclass
class Source:
    """One ring being drained, and the part its records go to."""

    part: Any
    ring: Ring
    reader: RingReader
    records: int = 0  # read so far

    @property
    def high(self) -> int:
        return self.reader.size // HIGH_WATERMARK

    @property
    def low(self) -> int:
        return self.reader.size // LOW_WATERMARK

    def read(self) -> tuple[Any, int, int]:
        """(records, how many, bytes) of everything committed."""
        if not self.reader.pending():
            return (), 0, 0
        if self.ring.dtype is not None:
            arr = self.reader.read_fixed(self.ring.dtype)
            return arr, len(arr), arr.nbytes
        recs = self.reader.read_records()
        return recs, len(recs), recs.nbytes


class Rings:
    """The rings of a tracker's program as its sessions use them: every part's rings
    (each session opens readers of its own for its drain thread; the part writes what
    was read), the attach-request ring the caller's thread waits on, REGION events put
    into the events ring by memtrack itself, and the ring pauses (backpressure)."""

    def __init__(self, bpf: Any, parts: list[Any], core: CorePart) -> None:
        self._bpf = bpf
        self._parts = parts
        self._core = core

    def open(self) -> list[Source]:
        """A reader on every ring of every part, in program order."""
        return [Source(p, r, RingReader(self._bpf, r.map_name))
                for p in self._parts for r in p.rings()]

    def write(self, src: Source, writer: ArtifactWriter, records: Any) -> None:
        """What the drain read from `src`, appended by its part."""
        src.part.write(self._bpf, writer, src.ring, records)

    @property
    def attach_requests(self) -> RingReader:
        """The reader of the attach requests (core.ATTACH_DTYPE records)."""
        reader = self._core.attach_requests
        assert reader is not None, "CorePart.attach was not called"
        return reader

    def mark_region(self, pid: int, tid: int, region_id: int, begin: bool) -> bool:
        """CorePart.mark_region: a thread's REGION event, now."""
        return self._core.mark_region(pid, tid, region_id, begin)

    def pauses(self, stops: StopRegistry) -> Pauses:
        """A session's ring pauses, its stops going through `stops`."""
        return Pauses(self._bpf, stops)


class Backlog:
    """Records drained and not written yet, bounded in bytes (the bound is checked by
    the drain before it reads, so it may be passed by at most one round)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.peak = 0
        self._items: collections.deque[tuple[Source, Any, int]] = collections.deque()
        self._cv = threading.Condition()

    def full(self) -> bool:
        return self.bytes >= self.limit

    def put(self, src: Source, data: Any, nbytes: int) -> None:
        with self._cv:
            self._items.append((src, data, nbytes))
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
            self._cv.notify()

    def take(self, timeout: float) -> list[tuple[Source, Any, int]]:
        with self._cv:
            if not self._items:
                self._cv.wait(timeout)
            items = list(self._items)
            self._items.clear()
            return items

    def done(self, nbytes: int) -> None:
        with self._cv:
            self.bytes -= nbytes

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class Drain:
    """The thread that reads the rings. `after_round(saw_high, drained)` runs on it
    after every round (the ring pauses)."""

    def __init__(self, sources: list[Source], backlog: Backlog,
                 after_round: Callable[[bool, bool], None],
                 interval: float = DRAIN_SECONDS) -> None:
        self.sources = sources
        self.backlog = backlog
        self.after_round = after_round
        self.interval = interval
        self.rounds = 0
        self.bytes = 0
        self.worst_gap_ns = 0
        self.cpu_ns = 0
        self.error: BaseException | None = None
        self._last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memtrack-drain", daemon=True)

    def start(self) -> None:
        self._last = time.monotonic_ns()
        self._thread.start()

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DRAIN_NICE)
        except OSError:  # not root: the default priority
            pass
        cpu0 = time.thread_time_ns()
        try:
            wait = self.interval
            while not self._stop.is_set():
                wait = self.interval if self.round() else min(2 * wait, IDLE_SECONDS)
                self._stop.wait(wait)
        except BaseException as e:  # noqa: BLE001 - reported by the session
            self.error = e
        self.cpu_ns = time.thread_time_ns() - cpu0

    def round(self) -> int:
        """Read every ring once; returns the records read."""
        now = time.monotonic_ns()
        self.worst_gap_ns = max(self.worst_gap_ns, now - self._last)
        self._last = now
        self.rounds += 1
        n = 0
        saw_high = False
        for src in self.sources:
            if src.reader.pending() >= src.high:
                saw_high = True
            if self.backlog.full():
                continue
            data, count, nbytes = src.read()
            if count:
                src.records += count
                n += count
                self.bytes += nbytes
                self.backlog.put(src, data, nbytes)
        drained = not self.backlog.full() and all(
            s.reader.pending() < s.low for s in self.sources)
        self.after_round(saw_high, drained)
        return n

    def stop(self) -> None:
        """Stop the thread, then read until the rings are empty (the end of a session:
        nothing produces any more)."""
        self._stop.set()
        self._thread.join()
        try:
            while self.error is None:  # a failed drain reads no more (the session says why)
                self._last = time.monotonic_ns()  # the final reads are not gaps
                while self.backlog.full():
                    time.sleep(0.005)
                if not self.round():
                    break
        except Exception as e:  # noqa: BLE001 - reported by the session
            self.error = e


class BatchWriter:
    """The thread that writes: takes what the drain read, in ring order, coalesces it
    into batches (BATCH_ROWS / BATCH_BYTES / BATCH_SECONDS) and hands each batch to
    `write(source, records)`. After an error it keeps taking and discarding, so that
    the drain is never held up; `error` says what happened."""

    def __init__(self, backlog: Backlog, write: Callable[[Source, Any], None], *,
                 idle: Callable[[], None] | None = None) -> None:
        self.backlog = backlog
        self.write = write
        self.idle = idle
        self.error: BaseException | None = None
        self.cpu_ns = 0  # the thread's CPU time, once it has stopped
        self._pending: dict[int, tuple[Source, list[Any], int, int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memtrack-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        cpu0 = time.thread_time_ns()
        try:
            self._loop()
        finally:
            self.cpu_ns = time.thread_time_ns() - cpu0

    def _loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            # once stopping, the drain has stopped: what is left is taken without waiting
            for src, data, nbytes in self.backlog.take(0 if stopping else BATCH_SECONDS / 2):
                self._add(src, data, nbytes)
            self._flush(everything=stopping)
            if self.idle is not None and self.error is None:
                try:
                    self.idle()
                except BaseException as e:  # noqa: BLE001 - reported by the session
                    self.error = e
            if stopping:
                return

    def _add(self, src: Source, data: Any, nbytes: int) -> None:
        key = id(src)
        _, parts, count, size, since = self._pending.get(key, (src, [], 0, 0, time.monotonic()))
        parts.append(data)
        self._pending[key] = (src, parts, count + len(data), size + nbytes, since)

    def _flush(self, everything: bool) -> None:
        now = time.monotonic()
        for key, (src, parts, count, size, since) in list(self._pending.items()):
            due = (count >= BATCH_ROWS if src.ring.dtype is not None else size >= BATCH_BYTES)
            if not (everything or due or now - since >= BATCH_SECONDS):
                continue
            del self._pending[key]
            if src.ring.dtype is not None:
                records: Any = np.concatenate(parts) if len(parts) > 1 else parts[0]
            else:
                records = Records.concat(parts)
            try:
                if self.error is None:
                    self.write(src, records)
            except BaseException as e:  # noqa: BLE001 - reported by the session
                self.error = e
            finally:
                self.backlog.done(size)

    def stop(self) -> None:
        """Write everything taken so far and what is still in the backlog, then stop."""
        self._stop.set()
        self.backlog.wake()
        self._thread.join()
