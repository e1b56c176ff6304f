"""Why each traced process is stopped, and resuming it only when no reason remains.

Two things stop a traced process, both with SIGSTOP sent from BPF: an attach request
(it mapped an executable file or exec'd: userspace probes the file, then continues
it) and a ring pause (a ring crossed its high watermark under --on-ring-full pause:
the drain continues it once the rings are low again). One process can be stopped for
both at once, by two threads; `StopRegistry` keeps the reasons of every pid and sends
SIGCONT only when the last one is released.

SIGCONT discards a stop signal still pending, so a BPF stop that raced with our
SIGCONT may have been cancelled: a reason whose stop was sent before our last SIGCONT
to that pid makes the registry stop the process again itself.

`Pauses` is the ring-pause side: it reads bpf/common.h's mt_paused (pid -> time BPF
stopped it) after each drain round, holds new entries and, once every ring is below
its low watermark, deletes them and releases their pause.
"""

from __future__ import annotations

import ctypes as ct
import os
import signal
import threading
import time
from typing import Any

from memtrack.capture.tables import percpu_counts
from memtrack.schema.enums import StopReason

ATTACH = StopReason.ATTACH
PAUSE = StopReason.PAUSE
SCAN_SECONDS = 0.25  # mt_paused is read at least this often (and after any high ring)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class StopRegistry:
    """pid -> the reasons it is stopped for; SIGCONT when none is left. Each reason's
    stop, from its time to its release, is logged (stops.arrow: `take_log`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: dict[int, set[StopReason]] = {}
        self._since: dict[tuple[int, StopReason], int] = {}
        self._log: list[tuple[int, StopReason, int, int]] = []
        self._continued: dict[int, int] = {}  # pid -> monotonic ns after our last SIGCONT

    def hold(self, pid: int, reason: StopReason, since_ns: int) -> None:
        """`pid` was stopped at `since_ns` (CLOCK_MONOTONIC, as BPF's bpf_ktime_get_ns)
        for `reason`."""
        with self._lock:
            self._reasons.setdefault(pid, set()).add(reason)
            self._since.setdefault((pid, reason), since_ns)
            if self._continued.get(pid, 0) >= since_ns:
                _signal(pid, signal.SIGSTOP)

    def release(self, pid: int, reason: StopReason) -> bool:
        """Drop one reason; continue the process when it was the last. True when a
        SIGCONT was sent."""
        with self._lock:
            self._logged(pid, reason, time.monotonic_ns())
            left = self._reasons.get(pid)
            if left is not None:
                left.discard(reason)
                if left:
                    return False
                del self._reasons[pid]
            sent = _signal(pid, signal.SIGCONT)
            self._continued[pid] = time.monotonic_ns()
            return sent

    def held(self, pid: int) -> set[StopReason]:
        with self._lock:
            return set(self._reasons.get(pid, ()))

    def release_all(self) -> list[int]:
        """Continue every process held for any reason (the end of a session)."""
        with self._lock:
            pids = list(self._reasons)
            now = time.monotonic_ns()
            for pid, reasons in self._reasons.items():
                for reason in reasons:
                    self._logged(pid, reason, now)
            self._reasons.clear()
            for pid in pids:
                _signal(pid, signal.SIGCONT)
                self._continued[pid] = time.monotonic_ns()
        return pids

    def take_log(self) -> list[tuple[int, StopReason, int, int]]:
        """The stops released since the last call: (pid, reason, begin ns, end ns)."""
        with self._lock:
            out, self._log = self._log, []
        return out

    def _logged(self, pid: int, reason: StopReason, now: int) -> None:
        since = self._since.pop((pid, reason), None)
        if since is not None:
            self._log.append((pid, reason, since, max(since, now)))


class Pauses:
    """Ring pauses of one session: configures the watermarks in BPF, then after each
    drain round resumes the processes BPF stopped once the rings have room again."""

    def __init__(self, bpf: Any, stops: StopRegistry) -> None:
        self.bpf = bpf
        self.stops = stops
        self.table = bpf["mt_paused"]
        self.held: dict[int, int] = {}  # pid -> when BPF stopped it
        self.paused_ns = 0  # summed over the pauses resumed
        self.enabled = False
        self._last_scan = 0
        self._lock = threading.Lock()  # the drain thread, and the session's at the end

    def configure(self, rings: list[tuple[int, int, int]], pause: bool) -> None:
        """`rings`: (ring id, map fd, high watermark bytes) of every ring drained;
        pause=False (--on-ring-full drop) puts 0 in place of every watermark."""
        slots, at = self.bpf["mt_rings"], self.bpf["mt_pause_at"]
        for ring_id, _, high in rings:
            at[ct.c_int(ring_id)] = ct.c_uint64(high if pause else 0)
        # Each update of an array of maps returns only after an RCU grace period (the
        # kernel waits for the programs that may still see the old map): 5-10 ms each
        # here, one after the other. Side by side, the waits overlap.
        errors: list[BaseException] = []

        def put(ring_id: int, fd: int) -> None:
            try:
                slots[ct.c_int(ring_id)] = ct.c_int(fd)
            except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=put, args=(ring_id, fd)) for ring_id, fd, _ in rings]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.enabled = pause

    def disable(self) -> None:
        """No more pauses from here on (the end of a session)."""
        at = self.bpf["mt_pause_at"]
        for i in range(at.max_entries):
            at[ct.c_int(i)] = ct.c_uint64(0)
        self.enabled = False

    def after_round(self, saw_high: bool, drained: bool) -> None:
        """After a drain round: `saw_high` = some ring was at its high watermark when
        read (a pause may have happened since the last round), `drained` = every ring
        is below its low watermark and the writer has room."""
        now = time.monotonic_ns()
        if not (saw_high or self.held or now - self._last_scan > SCAN_SECONDS * 1e9):
            return
        with self._lock:
            self._last_scan = now
            self._scan()
            if drained:
                self._resume_all()

    def finish(self) -> None:
        """No more pauses; every process paused goes on (the end of a session, or a
        failed one)."""
        with self._lock:
            self.disable()
            self._scan()
            self._resume_all()

    def _scan(self) -> None:
        for k, v in self.table.items():
            pid, ts = int(k.value), int(v.value)
            if pid not in self.held:
                self.held[pid] = ts
                self.stops.hold(pid, PAUSE, ts)

    def _resume_all(self) -> None:
        now = time.monotonic_ns()
        for pid, ts in self.held.items():
            try:
                del self.table[self.table.Key(pid)]
            except KeyError:
                pass
            self.stops.release(pid, PAUSE)
            self.paused_ns += max(0, now - ts)
        self.held.clear()

    def counts(self) -> dict[str, int]:
        """Pauses per ring (bpf mt_pauses, summed over CPUs), by RING_NAMES."""
        from memtrack.capture.parts import RING_NAMES

        return percpu_counts(self.bpf["mt_pauses"], RING_NAMES)
