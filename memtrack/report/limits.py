"""`memtrack check`: the regions' limits (labels `limit.KEY`, as the pytest plugin's
`memtrack_limit`, `limit_memory` and `limit_leaks` markers give them) against the
regions' figures in `region_metrics` and `region_stack_costs`.

What each limit holds a region to (one region: one test body, one thread):
- peak: `peak_heap_bytes`, the heap at its highest above where it stood at the
  region's begin (the region's thread's allocations up, its frees down);
- leaked: `alive_bytes`, the bytes the region allocated and had not freed when it
  closed, summed over the region;
- leaked_per_stack: the most of those bytes one call stack allocated (the largest
  `alive_bytes` of the region's `region_stack_costs`: pytest-memray's `limit_leaks`);
- allocated: `bytes`, everything it allocated; calls: `calls`, its allocation calls.
A figure above its limit exceeds it (a limit of 0 allows nothing). A run that lost data
or whose allocator functions the kernel refused to probe cannot be judged: its figures
miss calls (exit status 3, as `diff`'s gate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from memtrack.report.reader import RunReader
from memtrack.report.text import exact_bytes, printable
from memtrack.schema import is_loss

# limit key -> (the figure's column: region_metrics', or s.stack_alive_bytes, unit)
LIMITS = {"peak": ("m.peak_heap_bytes", "bytes"), "leaked": ("m.alive_bytes", "bytes"),
          "leaked_per_stack": ("s.stack_alive_bytes", "bytes"),
          "allocated": ("m.bytes", "bytes"), "calls": ("m.calls", "calls")}
PREFIX = "limit."
MAX_LIMIT = (1 << 63) - 1
EXIT_EXCEEDED = 1  # a limit was exceeded
EXIT_NOT_JUDGED = 3  # the run lost data (or calls were not recorded): no verdict

Data = dict[str, Any]


class LimitError(Exception):
    """A limit label that is not one (an unknown key, a value that is not a count)."""


@dataclass
class Check:
    data: Data = field(default_factory=dict)

    @property
    def exit_status(self) -> int:
        """3 when the run cannot be judged, 1 when a limit was exceeded, else 0."""
        if self.data["problems"]:
            return EXIT_NOT_JUDGED
        return EXIT_EXCEEDED if self.data["exceeded"] else 0


def check_limits(run: RunReader) -> Check:
    """Every limited region of the run (the reader's processes) with its limits and
    figures, as plain data (the --format json output)."""
    columns = ", ".join(f"coalesce({col}, 0)" for col, _ in LIMITS.values())
    rows = run.con.execute(f"""
        WITH limited AS (SELECT DISTINCT region_id FROM region_labels
                         WHERE starts_with(key, '{PREFIX}')),
        s AS (SELECT region_id, max(alive_bytes) AS stack_alive_bytes
              FROM region_stack_costs JOIN limited USING (region_id) GROUP BY region_id)
        SELECT m.region_id, m.name, m.pid, m.tid, m.ended, l.key, l.value, {columns}
        FROM region_labels l JOIN region_metrics m USING (region_id)
        LEFT JOIN s USING (region_id)
        WHERE starts_with(l.key, '{PREFIX}') AND {run.where('m.')}
        ORDER BY m.begin_ts, m.region_id, l.key""").fetchall()
    regions: dict[int, Data] = {}
    for rid, name, pid, tid, ended, key, value, *figures in rows:
        what = key[len(PREFIX):]
        if what not in LIMITS:
            raise LimitError(f"region {name!r}: unknown limit label {key!r} (expected "
                             f"{', '.join(PREFIX + k for k in LIMITS)})")
        if not value.isascii() or not value.isdigit() or int(value) > MAX_LIMIT:
            noun = "byte count" if LIMITS[what][1] == "bytes" else "count"
            raise LimitError(f"region {name!r}: label {key}={value!r} is not a {noun}")
        measured = int(dict(zip(LIMITS, figures, strict=True))[what])
        r = regions.setdefault(rid, {"region_id": rid, "name": name, "pid": pid, "tid": tid,
                                     "ended": ended, "limits": []})
        r["limits"].append({"metric": what, "unit": LIMITS[what][1], "limit": int(value),
                            "measured": measured, "exceeded": measured > int(value)})
    problems = [f"the run lost data: {k} {v}" for k, v in run.losses.items()
                if is_loss(k) and k != "probes_refused"]
    problems += [f"allocator function not probed (its calls are not recorded): "
                 f"{p['function']} in {p['path']}" for p in run.probes_refused]
    out = list(regions.values())
    exceeded = [r for r in out if any(lim["exceeded"] for lim in r["limits"])]
    return Check({"regions": out, "checked": len(out), "exceeded": len(exceeded),
                  "limits": sum(len(r["limits"]) for r in out), "problems": problems})


def _quantity(v: int, unit: str) -> str:
    return exact_bytes(v) if unit == "bytes" else f"{v:,}"


def format_text(check: Check) -> str:
    """One line per limit exceeded (the region's name, the figure, the limit), then the
    verdict."""
    d = check.data
    lines = []
    for r in d["regions"]:
        never = " (never ended)" if not r["ended"] else ""
        for lim in r["limits"]:
            if lim["exceeded"]:
                lines.append(f"{printable(r['name'])}: {lim['metric']} "
                             f"{_quantity(lim['measured'], lim['unit'])} exceeds its limit "
                             f"{_quantity(lim['limit'], lim['unit'])}{never}")
    lines += [f"CANNOT JUDGE: {printable(p)}" for p in d["problems"]]
    if not d["checked"]:
        lines.append("no region has limits (the pytest plugin's memtrack_limit, "
                     "limit_memory or limit_leaks markers, or limit.* labels)")
    else:
        lines.append(f"{d['exceeded']} of {d['checked']} limited regions exceeded a limit "
                     f"({d['limits']} limits checked)")
    return "\n".join(lines) + "\n"


def format_json(check: Check) -> str:
    return json.dumps(check.data, indent=2) + "\n"
