"""The tracked tree as the kernel holds it: which processes the BPF programs record
(bpf/common.h `mt_tracked`), the spawned command armed to be tracked from its exec on
(lifecycle.c `mt_pending`), and the state of the threads they run (common.h
`mt_threads`, its spill hash `mt_threads_spill`, and the generation in `mt_config`).

BPF adds every child at its fork and removes a process at its exit; userspace adds
the roots (a spawned command, the processes attached to), takes back an attach that
failed midway, and clears everything at a session's end.
"""

from __future__ import annotations

from typing import Any

from memtrack.capture.parts import CONFIG_GENERATION


class TrackedProcesses:
    """The kernel's tracking state of one loaded program, by pid."""

    def __init__(self, bpf: Any) -> None:
        self._tracked = bpf["mt_tracked"]
        self._pending = bpf["mt_pending"]
        self._spill = bpf["mt_threads_spill"]
        self._config = bpf["mt_config"]

    @property
    def map_fd(self) -> int:
        """The tracked-pid map's fd (for the supervisor, which continues its pids)."""
        return int(self._tracked.map_fd)

    def __contains__(self, pid: int) -> bool:
        return self._tracked.Key(pid) in self._tracked

    def track(self, pid: int) -> None:
        """Record `pid` (a running process attached to) from now on."""
        self._tracked[self._tracked.Key(pid)] = self._tracked.Leaf(1)

    def track_from_exec(self, pid: int) -> None:
        """Record `pid` (a spawned command, stopped before its exec) from its exec on."""
        self._pending[self._pending.Key(pid)] = self._pending.Leaf(1)

    def untrack(self, pid: int) -> None:
        """Stop recording `pid` (gone already: nothing to do)."""
        try:
            del self._tracked[self._tracked.Key(pid)]
        except KeyError:
            pass

    def clear(self) -> list[int]:
        """The end of a session: forget every process and every thread's state; returns
        the pids that were tracked (to be continued).

        In this order: a thread gets state only while its process is tracked, so once
        `mt_tracked` is empty no spill entry is made; a thread holding state skips the
        tracked check, so the spill is emptied and the generation bumped after, which
        frees every `mt_threads` slot at once for the next session's threads."""
        pids = [k.value for k in self._tracked.keys()]
        for table in (self._tracked, self._pending, self._spill):
            for k in list(table.keys()):
                try:
                    del table[k]
                except KeyError:
                    pass
        key = self._config.Key(CONFIG_GENERATION)
        self._config[key] = self._config.Leaf(self._config[key].value + 1)
        return pids
