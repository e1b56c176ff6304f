"""speedscope's file format: one sampled profile per metric, the chosen metric first."""

from __future__ import annotations

import json
from typing import Any

from memtrack.report.reader import Costs, RunReader

EXPORT_METRICS = ("allocated", "calls", "peak", "leaked")


def speedscope(c: Costs, metric: str, name: str = "memtrack") -> dict[str, Any]:
    """speedscope's file format: one sampled profile per metric, `metric` first."""
    frame_index: dict[tuple[str, str | None, int | None], int] = {}
    shared: list[dict[str, Any]] = []

    def idx(key: tuple[str, str | None, int | None]) -> int:
        if key not in frame_index:
            frame_index[key] = len(shared)
            entry: dict[str, Any] = {"name": key[0]}
            if key[1]:
                entry["file"] = key[1]
            if key[2]:
                entry["line"] = key[2]
            shared.append(entry)
        return frame_index[key]

    stacks = []
    for row in c.rows:
        outer_first = [(c.root(row.pid), None, None), *reversed(c.levels(row.backtrace))]
        stacks.append([idx(k) for k in outer_first])
    profiles = []
    for m in (metric, *[x for x in EXPORT_METRICS if x != metric]):
        samples, weights = [], []
        for row, st in zip(c.rows, stacks, strict=True):
            v = row.value(m)
            if v > 0:
                samples.append(st)
                weights.append(v)
        total = sum(weights)
        profiles.append({
            "type": "sampled", "name": f"{name}: {m}",
            "unit": "none" if m == "calls" else "bytes",
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


def render(run: RunReader, metric: str) -> bytes:
    name = " ".join(run.command) or "memtrack"
    return json.dumps(speedscope(run.costs(), metric, name)).encode()
