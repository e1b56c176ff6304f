"""speedscope's file format: one sampled profile per metric, the chosen metric first.

A speedscope frame is a function (its name and file): the inline levels and source
lines of one function are one frame, so that a function is one block per caller in
the flame chart and one row in the sandwich view; the frame's `line` is the lowest
line of the function the run's stacks hold (the closest to its start). A stack's root
is its process, by name (with its pid: `pids`)."""

from __future__ import annotations

import json
from typing import Any

from memtrack.report.reader import METRICS, UNITS, Costs, RunReader


def speedscope(c: Costs, metric: str, name: str = "memtrack", pids: bool = False
               ) -> dict[str, Any]:
    """speedscope's file format: one sampled profile per metric, `metric` first."""
    frame_index: dict[tuple[str, str | None], int] = {}
    shared: list[dict[str, Any]] = []

    def idx(name: str, file: str | None, line: int | None) -> int:
        key = (name, file)
        if key not in frame_index:
            frame_index[key] = len(shared)
            entry: dict[str, Any] = {"name": name}
            if file:
                entry["file"] = file
            shared.append(entry)
        entry = shared[frame_index[key]]
        if line and line < entry.get("line", line + 1):
            entry["line"] = line
        return frame_index[key]

    stacks = []
    for row in c.rows:
        outer_first = [(c.root(row.pid, pids), None, None),
                       *((lv.name, lv.file, lv.line) for lv in reversed(c.levels(row.backtrace)))]
        stacks.append([idx(*k) for k in outer_first])
    profiles = []
    for m in (metric, *[x for x in METRICS if x != metric]):
        samples, weights = [], []
        for row, st in zip(c.rows, stacks, strict=True):
            v = row.value(m)
            if v > 0:
                samples.append(st)
                weights.append(v)
        total = sum(weights)
        profiles.append({
            "type": "sampled", "name": f"{name}: {m}",
            "unit": "bytes" if UNITS[m] == "bytes" else "none",
            "startValue": 0, "endValue": total, "samples": samples, "weights": weights,
        })
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": shared},
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": "memtrack",
    }


def render(run: RunReader, metric: str, pids: bool = False) -> bytes:
    return json.dumps(speedscope(run.costs(), metric, run.title, pids)).encode()
