"""Regions: the control FIFO's `begin TID NAME` / `end TID [NAME]` / `label TID KEY=VALUE`.

A region is a named span of one thread's life (a benchmark, a test): every allocation
that thread makes between its begin and its end belongs to it. Regions nest, per
thread: `end` closes the innermost open region of the thread (`end TID NAME` checks
that it is the one named). Threads are independent: each has its own innermost region.

Each begin and end is written, as a REGION event, into the events ring by memtrack
itself (CorePart.mark_region) while the sending thread waits for the answer: the
event's time, on the events' clock, is after every event the thread made before it
asked and before every event it makes after the answer, so attribution is exact per
thread with no per-allocation cost in the kernel. The names go to region_names.arrow,
one row per region, in batches (`flush`: the session's loop calls it every
NAMES_FLUSH_S; a batch write costs ~0.3 ms, more than the rest of a boundary). A region
never ended is closed by `process` at its thread's exit (flagged: `regions.ended` is
false). `label` says KEY=VALUE of the thread's innermost open region (the pytest
plugin's limits: memtrack check reads them); labels go to region_labels.arrow with the
names' batches.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memtrack.capture.procfs import thread_identity, thread_start
from memtrack.schema.artifact import ArtifactWriter

MAX_NAME = 4000  # bytes: a command line stays within PIPE_BUF (4096), written at once
RING_FULL_WAIT_S = 5.0  # how long a boundary waits for the drain to make room
NAMES_FLUSH_S = 0.25  # region names wait at most this long for their batch
# a label's key: a word of letters, digits and . _ - (limit.peak); the whole label one
# line within MAX_NAME bytes
LABEL_KEY = re.compile(r"[A-Za-z0-9_.-]{1,100}")


class RegionError(Exception):
    """A begin or end that cannot be done; the message goes back to the sender."""


@dataclass
class _Thread:
    pid: int
    start: int  # its start time: a later thread with the same tid is another one
    open: list[tuple[int, str]] = field(default_factory=list)  # (id, name), innermost last


class Regions:
    """The open regions of every thread of one session, and their REGION events."""

    def __init__(self, mark: Callable[[int, int, int, bool], bool], writer: ArtifactWriter,
                 tracked: Callable[[int], bool]) -> None:
        """`mark(pid, tid, region_id, begin)` writes the event (False: the ring is full);
        `tracked(pid)`: whether the session traces that process."""
        self._mark = mark
        self._writer = writer
        self._tracked = tracked
        self._threads: dict[int, _Thread] = {}
        self.begun = 0  # region ids handed out so far (the last one)
        self._ids: list[int] = []  # names not written yet
        self._names: list[str] = []
        self._labels: dict[str, list[object]] = {"region_id": [], "key": [], "value": []}
        self._flushed = time.monotonic()

    def begin(self, tid: int, name: str) -> None:
        if not name:
            raise RegionError("begin needs a name")
        if "\n" in name or len(name.encode()) > MAX_NAME:
            raise RegionError(f"a region name is one line of at most {MAX_NAME} bytes")
        t = self._thread(tid)
        self.begun += 1  # an id is never handed out twice, even when the begin fails
        region_id = self.begun
        self._ids.append(region_id)
        self._names.append(name)
        self._emit(t.pid, tid, region_id, True)
        t.open.append((region_id, name))

    def end(self, tid: int, name: str | None) -> None:
        t = self._thread(tid)
        if not t.open:
            raise RegionError(f"thread {tid} has no open region")
        region_id, innermost = t.open[-1]
        if name and name != innermost:
            raise RegionError(f"the innermost open region of thread {tid} is {innermost!r}, "
                              f"not {name!r}")
        self._emit(t.pid, tid, region_id, False)
        t.open.pop()

    def label(self, tid: int, label: str) -> None:
        """KEY=VALUE said of the innermost open region of thread `tid`."""
        key, eq, value = label.partition("=")
        if not eq or not LABEL_KEY.fullmatch(key):
            raise RegionError("label needs KEY=VALUE, the key letters, digits and . _ - "
                              "(at most 100)")
        if "\n" in label or len(label.encode()) > MAX_NAME:
            raise RegionError(f"a label is one line of at most {MAX_NAME} bytes")
        t = self._thread(tid)
        if not t.open:
            raise RegionError(f"thread {tid} has no open region")
        for column, v in (("region_id", t.open[-1][0]), ("key", key), ("value", value)):
            self._labels[column].append(v)

    def open_regions(self) -> int:
        return sum(len(t.open) for t in self._threads.values())

    def flush(self, force: bool = True) -> None:
        """Write the names and labels not written yet (unless not `force`d and the batch
        is younger than NAMES_FLUSH_S)."""
        now = time.monotonic()
        labels = self._labels["key"]
        if not (self._ids or labels) or (not force and now - self._flushed < NAMES_FLUSH_S):
            return
        if self._ids:
            self._writer.write("region_names", {"region_id": self._ids, "name": self._names})
        if labels:
            self._writer.write("region_labels", self._labels)
        self._ids, self._names, self._flushed = [], [], now
        self._labels = {k: [] for k in self._labels}

    def _thread(self, tid: int) -> _Thread:
        t = self._threads.get(tid)
        if t is not None and thread_start(t.pid, tid) == t.start:
            return t  # the thread we know (one cheap read)
        ident = thread_identity(tid)
        if ident is None:
            raise RegionError(f"no thread {tid}")
        pid, start = ident
        if not self._tracked(pid):
            raise RegionError(f"thread {tid} (process {pid}) is not traced")
        t = self._threads[tid] = _Thread(pid, start)
        return t

    def _emit(self, pid: int, tid: int, region_id: int, begin: bool) -> None:
        deadline = time.monotonic() + RING_FULL_WAIT_S
        try:
            while not self._mark(pid, tid, region_id, begin):
                if time.monotonic() > deadline:
                    raise RegionError("the events ring stayed full")
                time.sleep(0.002)  # the drain thread empties it meanwhile
        except OSError as e:
            raise RegionError(f"regions are unavailable: {e.strerror or e}") from None

