"""`memtrack report`: the heaptrack-style summary of a run database, as text or JSON.

Every figure comes from the run reader (memtrack.report.reader): calls, temporary
allocations and leaks per allocation site, peak heap, peak RSS. Locations are
allocation sites (`stack_location`: the first frame outside the allocator).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import duckdb

from memtrack.report.reader import NO_STACK, RunReader
from memtrack.schema import loss_lines

# Section key (the JSON's) -> (title, metric, value noun)
SECTIONS: dict[str, tuple[str, str, str]] = {
    "calls": ("MOST CALLS TO ALLOCATION FUNCTIONS", "calls", "calls"),
    "peak": ("PEAK MEMORY CONSUMERS", "peak", "bytes"),
    "leaks": ("MEMORY LEAKS", "leaked", "bytes"),
    "temporary": ("MOST TEMPORARY ALLOCATIONS", "temporary", "calls"),
}  # fmt: skip


@dataclass
class ReportOptions:
    pid: int | None = None
    top: int = 10  # locations per section
    backtraces: int = 3  # backtraces per location


def report_data(con: duckdb.DuckDBPyConnection, opts: ReportOptions | None = None) -> dict:
    """Everything the report shows, as plain data (the --format json output)."""
    from memtrack.report.regions import RegionReader

    opts = opts or ReportOptions()
    run = RunReader(con, opts.pid)
    return {
        "command": run.command,
        "artifact": run.meta.get("artifact"),
        "pid": opts.pid,
        "totals": run.totals(),
        "processes": run.processes(),
        "sections": {k: run.sites(metric, opts.top, opts.backtraces)
                     for k, (_, metric, _) in SECTIONS.items()},
        "losses": {k: v for k, v in json.loads(run.meta.get("losses", "{}")).items() if v},
        "regions": RegionReader(run).rows(),
    }


def human_bytes(n: float) -> str:
    """heaptrack's style: 1.19M, 512B (powers of 1024)."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n}"


def _value(v: int, noun: str) -> str:
    if noun == "bytes":
        return human_bytes(v)
    return f"{v} {noun[:-1] if v == 1 else noun}"


MAX_PROCESSES = 20  # in the text report, the processes with the most calls
MAX_FRAMES = 16  # frames per backtrace in the text report


def format_text(data: dict) -> str:
    t = data["totals"]
    lines = []
    if data["command"]:
        lines.append("command: " + " ".join(data["command"]))

    def ts(at: float | None) -> str:
        return f" at {at:.3f}s" if at is not None else ""

    lines += [
        f"total runtime: {t['runtime_s']:.3f}s.",
        f"calls to allocation functions: {t['calls']} ({t['calls_per_s']:.0f}/s)",
        f"temporary memory allocations: {t['temporary']} ({t['temporary_per_s']:.0f}/s)",
        f"bytes allocated in total: {human_bytes(t['allocated_bytes'])}",
        f"peak heap memory consumption: {human_bytes(t['peak_heap_bytes'])}"
        f"{ts(t['peak_heap_at_s'])}",
        "peak RSS: " + (human_bytes(t["peak_rss_bytes"]) + ts(t["peak_rss_at_s"])
                        if t["peak_rss_bytes"] is not None else "not recorded"),
        f"total memory leaked: {human_bytes(t['leaked_bytes'])} "
        f"({t['leaked_allocations']} allocations)",
    ]
    if len(data["processes"]) > 1:
        lines += ["", "PROCESSES"]
        procs = sorted(data["processes"], key=lambda p: -p["calls"])[:MAX_PROCESSES]
        for p in sorted(procs, key=data["processes"].index):
            status = (f"signal {p['exit_signal']}" if p["exit_signal"] else
                      f"exit {p['exit_code']}" if p["exit_code"] is not None else "no exit seen")
            lines.append(
                f"  {p['pid']:>7} {p['name'] or '?':<16} parent {p['ppid']}, {status}: "
                f"{p['calls']} calls, peak heap {human_bytes(p['peak_heap_bytes'])}, "
                f"leaked {human_bytes(p['leaked_bytes'])}")
        if len(data["processes"]) > len(procs):
            lines.append(f"  ({len(data['processes']) - len(procs)} more with fewer calls: "
                         "--format json lists them all)")
    lines += loss_lines(data["losses"])
    if data.get("regions"):
        from memtrack.report.regions import region_table_lines

        lines += ["", *region_table_lines(data["regions"])]
    for key, (title, _, noun) in SECTIONS.items():
        lines += section_lines(title, data["sections"][key], noun)
    return "\n".join(lines) + "\n"


def section_lines(title: str, entries: list[dict], noun: str) -> list[str]:
    """One section of allocation sites (`sites` of the run reader) with backtraces."""
    lines = ["", title]
    if not entries:
        lines.append("  (none)")
    for e in entries:
        where = f" ({e['file']}:{e['line']})" if e["file"] else ""
        lines.append(f"{_value(e['value'], noun)} from {e['location']}{where}"
                     f" in {e['stacks']} backtrace{'s' if e['stacks'] != 1 else ''}")
        for bt in e["backtraces"]:
            lines.append(f"    {_value(bt['value'], noun)} from:")
            frames = bt["frames"] or [{"function": NO_STACK, "file": None}]
            for f in frames[:MAX_FRAMES]:
                loc = f"  {f['file']}:{f['line']}" if f.get("file") else ""
                lines.append(f"      {f['function']}{loc}")
            if len(frames) > MAX_FRAMES:
                lines.append(f"      ... {len(frames) - MAX_FRAMES} outer frames "
                             "(--format json has them all)")
    return lines


def report_json(data: dict) -> str:
    return json.dumps(data, indent=2, default=str)
