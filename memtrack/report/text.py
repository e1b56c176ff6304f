"""`memtrack report`: the heaptrack-style summary of a run database, as text or JSON.

Every figure comes from the run reader (memtrack.report.reader): calls, temporary
allocations and leaks per allocation site, peak heap, peak RSS. Sites are locations
(reader.LOCATION: a function at one source line) with their backtraces merged per
location. The report is a list of sections (SECTIONS), each of which gives its data
(the JSON's `sections[key]`) and its text; the HTML page draws them by kind.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from typing import Any

import duckdb

from memtrack.report.reader import NO_STACK, UNITS, RunReader
from memtrack.schema import loss_lines

# the line a report or diff of the Python view (--python-only) starts with
PYTHON_VIEW_LINE = ("stacks: Python view (--python-only): Python frames, and the native "
                    "ones their innermost called")


@dataclass
class ReportOptions:
    pid: int | None = None
    top: int = 10  # locations per section, regions
    backtraces: int = 3  # backtraces per location
    python_only: bool = False  # the stacks in the Python view (ddl.PYTHON_ONLY)


MAX_PROCESSES = 20  # in the text report, the processes with the most calls
MAX_FRAMES = 16  # frames per backtrace in the text report


@dataclass(frozen=True)
class Section:
    """One section of the report: its data from the reader, its text from that data."""

    key: str  # its name in the JSON's `sections` and on the page
    title: str
    kind: str  # how the page draws it ("sites": a table of sites with backtraces)

    def data(self, run: RunReader, opts: ReportOptions) -> Any:
        raise NotImplementedError

    def text(self, data: Any) -> list[str]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the page needs to draw the section (embedded with the data)."""
        return {"key": self.key, "title": self.title, "kind": self.kind}


@dataclass(frozen=True)
class SitesSection(Section):
    """The top allocation sites by one metric, each with its costliest backtraces."""

    metric: str = "calls"
    kind: str = "sites"

    def data(self, run: RunReader, opts: ReportOptions) -> list[dict[str, Any]]:
        return run.sites(self.metric, opts.top, opts.backtraces)

    def text(self, data: list[dict[str, Any]]) -> list[str]:
        return sites_lines(data, UNITS[self.metric])

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "metric": self.metric, "unit": UNITS[self.metric]}


SECTIONS: list[Section] = [
    SitesSection("calls", "MOST CALLS TO ALLOCATION FUNCTIONS", metric="calls"),
    SitesSection("peak", "PEAK MEMORY CONSUMERS", metric="peak"),
    SitesSection("leaks", "MEMORY LEAKS", metric="leaked"),
    SitesSection("temporary", "MOST TEMPORARY ALLOCATIONS", metric="temporary"),
]


def report_data(con: duckdb.DuckDBPyConnection, opts: ReportOptions | None = None) -> dict:
    """Everything the report shows, as plain data (the --format json output)."""
    from memtrack.report.regions import RegionReader

    opts = opts or ReportOptions()
    run = RunReader(con, opts.pid)
    regions = RegionReader(run)
    return {
        "command": run.command,
        "attached": run.attached,
        "artifact": run.meta.get("artifact"),
        "pid": opts.pid,
        "python_only": opts.python_only,
        "totals": run.totals(),
        "processes": run.processes(),
        "sections": {s.key: s.data(run, opts) for s in SECTIONS},
        "losses": run.losses,
        "probes_refused": run.probes_refused,
        "regions": regions.top(opts.top),  # the most bytes allocated first
        "regions_total": regions.count(),
    }


def busiest(processes: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `n` processes with the most calls, in their order (by start)."""
    top = sorted(range(len(processes)), key=lambda i: -processes[i]["calls"])[:n]
    return [processes[i] for i in sorted(top)]


def human_bytes(n: float) -> str:
    """Binary units, named as such: 512 B, 1.19 MiB, 1.27 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def exact_bytes(n: int) -> str:
    """A size with its exact byte count where the unit rounds it: 2.02 MiB (2,113,536 B)."""
    short = human_bytes(n)
    return short if short.endswith(" B") else f"{short} ({n:,} B)"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def quantity(v: int, unit: str) -> str:
    return human_bytes(v) if unit == "bytes" else plural(v, unit[:-1])


# Characters a terminal would act on (C0/C1 controls, bidirectional overrides, zero-width
# marks): program text (a command line, a process name, a file name from DWARF) is
# printed with these escaped.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def printable(text: str) -> str:
    """`text` with every control character escaped (\\x1b, \\n, \\u202e)."""
    return _UNPRINTABLE.sub(
        lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def stopped_text(stopped: dict[str, dict[str, float]]) -> str:
    """What of the runtime capture held the program stopped, as the end of its line."""
    what = {"attach": "attach stop", "pause": "ring pause"}
    parts = [f"{plural(v['count'], what.get(r, r))} ({v['seconds']:.3f}s)"
             for r, v in stopped.items()]
    return f" (stopped by memtrack: {', '.join(parts)})" if parts else ""


def refused_lines(refused: list[dict[str, str]]) -> list[str]:
    """Each allocator function the kernel refused to probe: its calls are not in the run."""
    return [f"  not recorded: {r['function']} in {r['path']} (probe refused: {r['why']})"
            for r in refused]


def format_text(data: dict) -> str:
    t = data["totals"]
    lines = []
    if data["command"]:
        lines.append("command: " + " ".join(data["command"]))
    lines += data["attached"]
    if data.get("python_only"):
        lines.append(PYTHON_VIEW_LINE)

    def ts(at: float | None) -> str:
        return f" at {at:.3f}s" if at is not None else ""

    lines += [
        f"total runtime: {t['runtime_s']:.3f}s.{stopped_text(t['stopped'])}",
        f"calls to allocation functions: {t['calls']} ({t['calls_per_s']:.0f}/s)",
        f"temporary memory allocations: {t['temporary']} ({t['temporary_per_s']:.0f}/s)",
        f"bytes allocated in total: {exact_bytes(t['allocated_bytes'])}",
        f"peak heap memory consumption: {exact_bytes(t['peak_heap_bytes'])}"
        f"{ts(t['peak_heap_at_s'])}",
        "peak RSS: " + (exact_bytes(t["peak_rss_bytes"]) + ts(t["peak_rss_at_s"])
                        if t["peak_rss_bytes"] is not None else "not recorded"),
        f"total memory leaked: {exact_bytes(t['leaked_bytes'])} in "
        f"{plural(t['leaked_allocations'], 'allocation')}",
    ]
    if len(data["processes"]) > 1:
        lines += ["", "PROCESSES"]
        procs = busiest(data["processes"], MAX_PROCESSES)
        for p in procs:
            status = (signal_text(p["exit_signal"]) if p["exit_signal"] else
                      f"exit {p['exit_code']}" if p["exit_code"] is not None else "no exit seen")
            inside = (f" (pid {p['ns_pid']} in its namespace)"
                      if p["ns_pid"] is not None and p["ns_pid"] != p["pid"] else "")
            lines.append(
                f"  {p['pid']:>7} {p['name'] or '?':<16} parent {p['ppid']}{inside}, {status}: "
                f"{p['calls']} calls, peak heap {human_bytes(p['peak_heap_bytes'])}, "
                f"leaked {human_bytes(p['leaked_bytes'])}")
        if len(data["processes"]) > len(procs):
            lines.append(f"  ({len(data['processes']) - len(procs)} more with fewer calls: "
                         "--format json lists them all)")
    lines += loss_lines(data["losses"]) + refused_lines(data["probes_refused"])
    if data["regions_total"]:
        from memtrack.report.regions import region_table_lines

        lines += ["", *region_table_lines(data["regions"], data["regions_total"])]
    for section in SECTIONS:
        lines += ["", section.title, *section.text(data["sections"][section.key])]
    return "".join(printable(line) + "\n" for line in lines)


def signal_text(number: int) -> str:
    """A signal as the report names it: "signal 13 (SIGPIPE)"."""
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def section_lines(title: str, entries: list[dict], unit: str) -> list[str]:
    """A titled section of allocation sites (`sites` of the run reader) with backtraces."""
    return ["", title, *sites_lines(entries, unit)]


def sites_lines(entries: list[dict], unit: str) -> list[str]:
    """Allocation sites (`sites` of the run reader), each with its backtraces."""
    lines = [] if entries else ["  (none)"]
    for e in entries:
        where = f" ({e['file']}:{e['line']})" if e["file"] else ""
        lines.append(f"{quantity(e['value'], unit)} from {e['location']}{where}"
                     f" in {plural(e['stacks'], 'backtrace')}")
        for bt in e["backtraces"]:
            lines.append(f"    {quantity(bt['value'], unit)} from:")
            lines += backtrace_lines(bt["frames"], MAX_FRAMES, "      ")
    return lines


def backtrace_lines(frames: list[dict], limit: int, indent: str) -> list[str]:
    """A backtrace's frames (`backtrace` of the run reader), at most `limit` of them."""
    frames = frames or [{"function": NO_STACK, "file": None}]
    out = []
    for f in frames[:limit]:
        loc = f"  {f['file']}:{f['line']}" if f.get("file") else ""
        out.append(f"{indent}{f['function']}{loc}")
    if len(frames) > limit:
        out.append(f"{indent}... {len(frames) - limit} outer frames (--format json has them "
                   "all)")
    return out


def report_json(data: dict) -> str:
    return json.dumps(data, indent=2, default=str)
