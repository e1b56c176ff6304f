"""`memtrack diff`: what changed between two runs, a base and a head, as plain data (the
JSON output) rendered as text or markdown (a pull-request comment).

Both runs are read through the run reader (memtrack.report.reader). The diff is a list
of sections (SECTIONS), each built from the two runs and rendered in text and markdown:
the totals side by side, the processes and the regions matched by name, then per metric
the allocation sites whose cost changed; a further section is one more DiffSection in
that list. The gate (`--fail-above`) judges the totals.

Sites are matched across builds by call path (RunReader.call_paths): a site is its
function and source file name, a backtrace the names and source files of its frames,
never addresses, lines or module paths, which change from one build to the next. A
site found in one run only is listed apart, by the run it is in: code added or
removed, or a frame that could not be matched (an unsymbolized frame is named by its
module and address).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from memtrack.report.reader import METRICS, RunReader
from memtrack.report.regions import RegionReader
from memtrack.report.text import PYTHON_VIEW_LINE, backtrace_lines, human_bytes
from memtrack.schema import is_loss
from memtrack.schema.ddl import connect

Data = dict[str, Any]

# The totals compared: totals key -> (label, unit), in the order shown.
TOTALS = {
    "calls": ("calls to allocation functions", "calls"),
    "temporary": ("temporary memory allocations", "calls"),
    "allocated_bytes": ("bytes allocated in total", "bytes"),
    "peak_heap_bytes": ("peak heap memory consumption", "bytes"),
    "peak_rss_bytes": ("peak RSS", "bytes"),
    "leaked_bytes": ("total memory leaked", "bytes"),
    "leaked_allocations": ("leaked allocations", "calls"),
}  # fmt: skip
# What the gate may judge (--fail-on): name -> totals key; GATED by default.
GATES = {"allocated": "allocated_bytes", "peak": "peak_heap_bytes",
         "leaked": "leaked_bytes", "calls": "calls", "temporary": "temporary",
         "rss": "peak_rss_bytes"}
GATED = ("peak", "allocated", "leaked")
# The site sections, per metric (METRICS): title and unit.
SITE_METRICS = {
    "allocated": ("BYTES ALLOCATED", "bytes"),
    "calls": ("CALLS TO ALLOCATION FUNCTIONS", "calls"),
    "peak": ("PEAK MEMORY CONSUMERS", "bytes"),
    "leaked": ("MEMORY LEAKS", "bytes"),
    "temporary": ("TEMPORARY ALLOCATIONS", "calls"),
}  # fmt: skip
MAX_FRAMES = 16  # frames per backtrace in text; markdown keeps fewer
MD_FRAMES = 10
MD_LIMIT = 60000  # characters: a GitHub comment holds 65536
EXIT_NOT_COMPARABLE = 3  # the gate's status when the runs did not see the same things


@dataclass
class Side:
    """One run of the diff: what the user named it (a file, a dataset run) and its
    reader (for the processes selected)."""

    name: str
    reader: RunReader


@dataclass
class DiffOptions:
    metrics: tuple[str, ...] = tuple(METRICS)  # the site sections, in this order
    top: int = 10  # sites per list
    backtraces: int = 3  # backtraces per site
    fail_above: float | None = None  # the gate: growth in percent
    fail_on: tuple[str, ...] = GATED
    python_only: bool = False  # both runs' stacks in the Python view (ddl.PYTHON_ONLY)


@dataclass(frozen=True)
class DiffSection:
    """A section of the diff: `build` gives its data (None: nothing to show), `text`
    and `markdown` render that data as lines."""

    key: str
    build: Callable[[Side, Side, DiffOptions], Data | None]
    text: Callable[[Data], list[str]]
    markdown: Callable[[Data], list[str]]


def change(base: int | None, head: int | None) -> Data:
    """A figure in both runs, its change and the change relative to the base (None when
    the base is 0 and the head is not: new)."""
    if base is None or head is None:
        return {"base": base, "head": head, "delta": None, "relative": None}
    delta = head - base
    return {"base": base, "head": head, "delta": delta,
            "relative": delta / base if base else (0.0 if delta == 0 else None)}


# ---- values as text -------------------------------------------------------------------
def value(v: int | None, unit: str) -> str:
    if v is None:
        return "not recorded"
    return human_bytes(v) if unit == "bytes" else str(v)


def signed(v: int, unit: str) -> str:
    return ("+" if v > 0 else "-" if v < 0 else "") + value(abs(v), unit)


def relative_text(c: Data) -> str:
    return "new" if c["relative"] is None else f"{c['relative'] * 100:+.1f}%"


def change_text(c: Data, unit: str) -> str:
    """`+1.00K (+25.0%)`, `+64 (new)`, `no change`."""
    if c["delta"] is None:
        return "n/a"
    if c["delta"] == 0:
        return "no change"
    return f"{signed(c['delta'], unit)} ({relative_text(c)})"


def md(text: str) -> str:
    """Text as a markdown code span that a table cell keeps."""
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# ---- totals ---------------------------------------------------------------------------
def build_totals(base: Side, head: Side, opts: DiffOptions) -> Data:
    b, h = base.reader.totals(), head.reader.totals()
    return {"rows": [{"key": k, "label": label, "unit": unit, **change(b[k], h[k])}
                     for k, (label, unit) in TOTALS.items()]}


def text_totals(data: Data) -> list[str]:
    rows = [(r["label"], value(r["base"], r["unit"]), value(r["head"], r["unit"]),
             change_text(r, r["unit"])) for r in data["rows"]]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    out = [f"{'TOTALS':<{w[0]}}  {'base':>{w[1]}}  {'head':>{w[2]}}  change"]
    out += [f"{a:<{w[0]}}  {b:>{w[1]}}  {c:>{w[2]}}  {d}" for a, b, c, d in rows]
    return out


def markdown_totals(data: Data) -> list[str]:
    out = ["| | base | head | change |", "|:--|--:|--:|--:|"]
    out += [f"| {r['label']} | {value(r['base'], r['unit'])} | {value(r['head'], r['unit'])} "
            f"| {change_text(r, r['unit'])} |" for r in data["rows"]]
    return out


# ---- processes, matched by name -------------------------------------------------------
PROCESS_FIGURES = (("processes", "processes", "calls"), ("calls", "calls", "calls"),
                   ("peak_heap_bytes", "largest peak heap", "bytes"),
                   ("leaked_bytes", "leaked", "bytes"))


def _by_name(reader: RunReader) -> dict[str, Data]:
    out: dict[str, Data] = {}
    for p in reader.processes():
        d = out.setdefault(p["name"] or "?", _no_process())
        d["processes"] += 1
        d["calls"] += p["calls"]
        d["peak_heap_bytes"] = max(d["peak_heap_bytes"], p["peak_heap_bytes"])
        d["leaked_bytes"] += p["leaked_bytes"]
    return out


def _no_process() -> Data:
    return {k: 0 for k, _, _ in PROCESS_FIGURES}


def build_processes(base: Side, head: Side, opts: DiffOptions) -> Data | None:
    """Per process name, its processes in each run side by side (shown when a run has
    more than one process)."""
    b, h = _by_name(base.reader), _by_name(head.reader)
    if max(sum(d["processes"] for d in b.values()),
           sum(d["processes"] for d in h.values())) <= 1:
        return None
    rows = []
    for name in dict.fromkeys([*b, *h]):
        bn, hn = b.get(name, _no_process()), h.get(name, _no_process())
        rows.append({"name": name, "in_base": name in b, "in_head": name in h,
                     **{k: change(bn[k], hn[k]) for k, _, _ in PROCESS_FIGURES}})
    return {"rows": rows}


def _cells(r: Data, figures: tuple[tuple[str, str, str], ...]) -> list[str]:
    """`7`, `7 -> 9 (+2, +28.6%)`; a name in one run only: its figures there."""
    out = []
    for k, _, unit in figures:
        c = r[k]
        if not (r["in_base"] and r["in_head"]):
            out.append(value(c["head" if r["in_head"] else "base"], unit))
        elif c["delta"] == 0:
            out.append(value(c["head"], unit))
        else:
            out.append(f"{value(c['base'], unit)} -> {value(c['head'], unit)} "
                       f"({signed(c['delta'], unit)}, {relative_text(c)})")
    return out


def _name(r: Data) -> str:
    return r["name"] + ("" if r["in_base"] and r["in_head"] else
                        " (only in head)" if r["in_head"] else " (only in base)")


def _text_by_name(title: str, figures: tuple[tuple[str, str, str], ...],
                  data: Data) -> list[str]:
    rows = [[title, *(label for _, label, _ in figures)]]
    rows += [[_name(r), *_cells(r, figures)] for r in data["rows"]]
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(n) for c, n in zip(r, w, strict=True)).rstrip() for r in rows]


def _markdown_by_name(title: str, figures: tuple[tuple[str, str, str], ...],
                      data: Data) -> list[str]:
    out = [f"| {title} | " + " | ".join(label for _, label, _ in figures) + " |",
           "|:--|" + "--:|" * len(figures)]
    out += [f"| {md(_name(r))} | " + " | ".join(_cells(r, figures)) + " |"
            for r in data["rows"]]
    return out


def text_processes(data: Data) -> list[str]:
    return _text_by_name("PROCESSES BY NAME", PROCESS_FIGURES, data)


def markdown_processes(data: Data) -> list[str]:
    return _markdown_by_name("process", PROCESS_FIGURES, data)


# ---- regions, matched by name ---------------------------------------------------------
REGION_FIGURES = (("instances", "instances", "calls"), ("calls", "calls", "calls"),
                  ("allocated_bytes", "allocated", "bytes"),
                  ("peak_heap_bytes", "peak heap", "bytes"),
                  ("leaked_bytes", "leaked", "bytes"), ("temporary", "temporary", "calls"))


def build_regions(base: Side, head: Side, opts: DiffOptions) -> Data | None:
    """Per region name (a benchmark, a test), its instances in each run side by side,
    biggest change of allocated bytes first (shown when a run has regions)."""
    b, h = RegionReader(base.reader).by_name(), RegionReader(head.reader).by_name()
    if not b and not h:
        return None
    none = {k: 0 for k, _, _ in REGION_FIGURES}
    rows = []
    for name in dict.fromkeys([*b, *h]):
        bn, hn = b.get(name, none), h.get(name, none)
        rows.append({"name": name, "in_base": name in b, "in_head": name in h,
                     **{k: change(bn[k], hn[k]) for k, _, _ in REGION_FIGURES}})
    rows.sort(key=lambda r: (-abs(r["allocated_bytes"]["delta"] or 0), r["name"]))
    return {"rows": rows}


def text_regions(data: Data) -> list[str]:
    return _text_by_name("REGIONS BY NAME", REGION_FIGURES, data)


def markdown_regions(data: Data) -> list[str]:
    return _markdown_by_name("region", REGION_FIGURES, data)


# ---- sites ----------------------------------------------------------------------------
# The call paths of both runs side by side: one row per path (RunReader.call_paths'
# key), its cost in each run per metric and, per metric, the stack of it that costs the
# most there (then the most calls): the backtraces of one path differ in their lines,
# and a change in peak or leaks is the kept block's line, as the report names it, not
# that of the path's most frequent call.
PATHS_SQL = """
    CREATE TABLE paths AS
    WITH b AS (SELECT path_key, levels, site, site_file, site_symbolized, {stacks}, {sums}
               FROM base GROUP BY ALL),
    h AS (SELECT path_key, levels, site, site_file, site_symbolized, {stacks}, {sums}
          FROM head GROUP BY ALL)
    SELECT coalesce(b.site, h.site) AS site, coalesce(b.site_file, h.site_file) AS site_file,
           coalesce(b.site_symbolized, h.site_symbolized) AS symbolized, {sides}
    FROM b FULL JOIN h ON b.path_key = h.path_key AND b.levels = h.levels"""

# Per metric, the sites (site, file) that changed: in both runs (`matched`) or in one
# only (`head_only`, `base_only`; present: any allocation there), costliest change
# first, each with its most changed paths; `n` counts the sites of that kind.
SITES_SQL = """
    WITH s AS (
        SELECT site, site_file, bool_and(symbolized) AS symbolized,
               sum(base_calls) > 0 AS in_base, sum(head_calls) > 0 AS in_head,
               sum(base_{m})::BIGINT AS base, sum(head_{m})::BIGINT AS head,
               (list({{'base_stack': base_stack_{m}, 'head_stack': head_stack_{m},
                       'base': base_{m}, 'head': head_{m}}}
                     ORDER BY abs(head_{m} - base_{m}) DESC, base_stack_{m}, head_stack_{m})
                FILTER (WHERE head_{m} <> base_{m}))[1:{backtraces}] AS paths
        FROM paths GROUP BY site, site_file),
    c AS (
        SELECT *, CASE WHEN in_base AND in_head THEN 'matched'
                       WHEN in_head THEN 'head_only' ELSE 'base_only' END AS kind
        FROM s WHERE head <> base),
    r AS (
        SELECT *, row_number() OVER (PARTITION BY kind
                                     ORDER BY abs(head - base) DESC, site, site_file) AS k,
               count(*) OVER (PARTITION BY kind) AS n
        FROM c)
    SELECT kind, n, site, site_file, symbolized, base, head, paths FROM r WHERE k <= {top}
    ORDER BY kind, k"""

# The sites each run has and in how many runs: matched sites with the same cost count
# as unchanged.
COUNTS_SQL = """
    SELECT count(*) FILTER (WHERE in_base AND in_head),
           count(*) FILTER (WHERE in_head AND NOT in_base),
           count(*) FILTER (WHERE in_base AND NOT in_head),
           {unchanged}
    FROM (SELECT sum(base_calls) > 0 AS in_base, sum(head_calls) > 0 AS in_head, {sums}
          FROM paths GROUP BY site, site_file)"""

KINDS = ("matched", "head_only", "base_only")


def build_sites(base: Side, head: Side, opts: DiffOptions) -> Data:
    con = connect()
    try:
        con.register("base", base.reader.call_paths())
        con.register("head", head.reader.call_paths())
        names = list(METRICS)
        con.execute(PATHS_SQL.format(
            stacks=", ".join(f"arg_max(stack_id, ({m}, calls)) AS stack_{m}" for m in names),
            sums=", ".join(f"sum({m})::BIGINT AS {m}" for m in names),
            sides=", ".join(f"coalesce(b.{m}, 0) AS base_{m}, coalesce(h.{m}, 0) AS head_{m}, "
                            f"b.stack_{m} AS base_stack_{m}, h.stack_{m} AS head_stack_{m}"
                            for m in names)))
        counts = con.execute(COUNTS_SQL.format(
            sums=", ".join(f"sum(base_{m}) AS b_{m}, sum(head_{m}) AS h_{m}" for m in names),
            unchanged=", ".join(f"count(*) FILTER (WHERE in_base AND in_head AND b_{m} = h_{m}"
                                f" AND b_{m} > 0)" for m in names))).fetchone()
        assert counts is not None
        out: Data = {"matched": counts[0], "head_only": counts[1], "base_only": counts[2],
                     "metrics": {}}
        unchanged = dict(zip(names, counts[3:], strict=True))
        for m in opts.metrics:
            section: Data = {"unchanged": unchanged[m], **{k: {"sites": [], "count": 0}
                                                           for k in KINDS}}
            for kind, n, site, file, symbolized, b, h, paths in con.execute(SITES_SQL.format(
                    m=m, top=int(opts.top), backtraces=int(opts.backtraces))).fetchall():
                section[kind]["count"] = n
                section[kind]["sites"].append({
                    "location": site, "file": file or None, "symbolized": symbolized,
                    **change(b, h),
                    "backtraces": [_path(p, base, head) for p in paths or []]})
            out["metrics"][m] = section
        return out
    finally:
        con.close()


def _path(p: Data, base: Side, head: Side) -> Data:
    """A changed call path: its cost in both runs and its frames (the head's, else the
    base's: their lines are the build's)."""
    frames = head.reader.backtrace(p["head_stack"]) if p["head_stack"] is not None \
        else base.reader.backtrace(p["base_stack"])
    return {**change(p["base"], p["head"]), "frames": frames}


def _where(s: Data) -> str:
    """A site's file, or that it is an address no other build or process shares."""
    return f" ({s['file']})" if s["file"] else "" if s["symbolized"] else \
        " (not symbolized: matched by address only)"


def _site_title(s: Data, unit: str, matched: bool) -> str:
    where = _where(s)
    if matched:
        head = f"{change_text(s, unit)}: {value(s['base'], unit)} -> {value(s['head'], unit)}"
    else:
        head = value(s["head"] or s["base"], unit)
    return f"{head} from {s['location']}{where}"


def _counts_line(sec: Data) -> str:
    return (f"{sec['matched']['count']} changed, {sec['unchanged']} unchanged, "
            f"{sec['head_only']['count']} only in head, {sec['base_only']['count']} only "
            "in base")


def text_sites(data: Data) -> list[str]:
    out = [f"SITES: {data['matched']} matched by call path, {data['head_only']} only in "
           f"head, {data['base_only']} only in base"]
    for m, sec in data["metrics"].items():
        title, unit = SITE_METRICS[m]
        out += ["", f"{title}: {_counts_line(sec)}"]
        for kind, label in zip(KINDS, ("", "only in head:", "only in base:"), strict=True):
            sites = sec[kind]["sites"]
            if not sites:
                continue
            if label:
                out.append(f"  {label}")
            for s in sites:
                out.append(_site_title(s, unit, kind == "matched"))
                for bt in s["backtraces"]:
                    lead = change_text(bt, unit) if kind == "matched" else \
                        value(bt["head"] or bt["base"], unit)
                    out.append(f"    {lead} from:")
                    out += backtrace_lines(bt["frames"], MAX_FRAMES, "      ")
    return out


def markdown_sites(data: Data) -> list[str]:
    out = [f"Sites: {data['matched']} matched by call path, {data['head_only']} only in "
           f"head, {data['base_only']} only in base."]
    quiet = []  # metrics with nothing to list
    for m, sec in data["metrics"].items():
        title, unit = SITE_METRICS[m]
        rows, details = [], []
        for kind, label in zip(KINDS, ("", "new", "gone"), strict=True):
            for s in sec[kind]["sites"]:
                where = _where(s)
                ch = change_text(s, unit) if kind == "matched" else label
                rows.append(f"| {ch} | {value(s['base'], unit)} | {value(s['head'], unit)} "
                            f"| {md(s['location'])}{where} |")
                if s["backtraces"]:
                    details += [f"{_site_title(s, unit, kind == 'matched')}",
                                *backtrace_lines(s["backtraces"][0]["frames"], MD_FRAMES, "  ")]
        if not rows:
            quiet.append(f"- {title.capitalize()}: {_counts_line(sec)}")
            continue
        out += ["", f"#### {title.capitalize()}", "", _counts_line(sec) + ".", "",
                "| change | base | head | site |", "|--:|--:|--:|:--|", *rows]
        if details:
            out += ["", "<details><summary>backtraces</summary>", "", "```", *details, "```",
                    "", "</details>"]
    if quiet:
        out += ["", *quiet]
    return out


SECTIONS: list[DiffSection] = [
    DiffSection("totals", build_totals, text_totals, markdown_totals),
    DiffSection("processes", build_processes, text_processes, markdown_processes),
    DiffSection("regions", build_regions, text_regions, markdown_regions),
    DiffSection("sites", build_sites, text_sites, markdown_sites),
]


# ---- the gate -------------------------------------------------------------------------
def gate(totals: Data, opts: DiffOptions) -> Data | None:
    """Each gated total: failed when it grew by more than `fail_above` percent (from
    0 to anything is more), or was not recorded in a run."""
    if opts.fail_above is None:
        return None
    rows = {r["key"]: r for r in totals["rows"]}
    checks = []
    for name in opts.fail_on:
        r = rows[GATES[name]]
        if r["delta"] is None:
            failed, why = True, "not recorded in " + ("base" if r["base"] is None else "head")
        else:
            pct = None if r["relative"] is None else r["relative"] * 100
            failed = r["delta"] > 0 and (pct is None or pct > opts.fail_above)
            why = change_text(r, r["unit"])
        checks.append({"metric": name, "label": r["label"], "failed": failed, "change": why})
    return {"fail_above_pct": opts.fail_above, "checks": checks,
            "failed": any(c["failed"] for c in checks)}


def gate_line(g: Data) -> str:
    failed = [c for c in g["checks"] if c["failed"]]
    what = ", ".join(c["metric"] for c in g["checks"])
    if not failed:
        return f"gate: passed (none of {what} grew by more than {g['fail_above_pct']:g}%)"
    return (f"gate: FAILED (more than {g['fail_above_pct']:g}%): "
            + "; ".join(f"{c['label']} {c['change']}" for c in failed))


# ---- trust: did both runs see the same things? ---------------------------------------
def _refused(side: Side) -> set[tuple[str, str]]:
    """(function, module file name) of each refused probe: the module's directory may
    differ between machines and runs."""
    return {(r["function"], PurePath(r["path"]).name) for r in side.reader.probes_refused}


def data_lost(counters: Any) -> dict[str, int]:
    """The loss counters among a run's `losses` that are not zero: the data it lost (not
    the fidelity notes, nor refused probes: runs compare by which functions were
    refused, `trust`)."""
    if not isinstance(counters, dict):
        return {}
    return {k: v for k, v in counters.items()
            if isinstance(v, int) and v and is_loss(k) and k != "probes_refused"}


def trust(base: Side, head: Side) -> Data:
    """Whether the figures of the two runs can be compared: neither lost data, and the
    kernel refused the same allocator functions in both (the same gap on both sides
    leaves the comparison fair; a gap in one only changes its figures by itself)."""
    problems = []
    for key, side in (("base", base), ("head", head)):
        lost = data_lost(side.reader.losses)
        if lost:
            problems.append(f"{key} lost data: " + ", ".join(f"{k} {v}" for k, v in lost.items()))
    refused = _refused(base), _refused(head)
    for key, mine, other in (("base", *refused), ("head", *reversed(refused))):
        if mine - other:
            problems.append(f"only {key} has probes refused (calls not recorded): " +
                            ", ".join(f"{f} in {m}" for f, m in sorted(mine - other)))
    return {"trusted": not problems, "problems": problems,
            "refused_in_both": [f"{f} in {m}" for f, m in sorted(refused[0] & refused[1])]}


def trust_lines(t: Data) -> list[str]:
    lines = [f"NOT COMPARABLE: {p}" for p in t["problems"]]
    if t["refused_in_both"]:
        lines.append("probes refused in both runs (calls not recorded in either): "
                     + ", ".join(t["refused_in_both"]))
    return lines


# ---- the diff -------------------------------------------------------------------------
def describe(side: Side) -> Data:
    r = side.reader
    pids = None if r.pid is None else [r.pid] if isinstance(r.pid, int) else list(r.pid)
    return {"name": side.name, "command": r.command, "labels": r.labels,
            "artifact": r.meta.get("artifact"), "pids": pids, "attached": r.attached}


@dataclass
class Diff:
    data: Data = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.data.get("gate") and self.data["gate"]["failed"])

    @property
    def exit_status(self) -> int:
        """With a gate: 3 when the runs cannot be compared (trust), 1 when it failed."""
        if not self.data.get("gate"):
            return 0
        return EXIT_NOT_COMPARABLE if not self.data["trust"]["trusted"] else int(self.failed)


def diff_data(base: Side, head: Side, opts: DiffOptions | None = None) -> Diff:
    """Everything the diff shows, as plain data (the --format json output)."""
    opts = opts or DiffOptions()
    sections: Data = {}
    for s in SECTIONS:
        built = s.build(base, head, opts)
        if built is not None:
            sections[s.key] = built
    return Diff({"base": describe(base), "head": describe(head), "trust": trust(base, head),
                 "python_only": opts.python_only, "sections": sections,
                 "gate": gate(sections["totals"], opts)})


def _side_line(key: str, d: Data) -> str:
    labels = " ".join(f"{k}={v}" for k, v in d["labels"].items())
    pids = f" (pid {', '.join(map(str, d['pids']))})" if d["pids"] else ""
    cmd = " ".join(d["command"])
    return f"{key}: {d['name']}{pids}" + (f"  [{labels}]" if labels else "") + \
        (f"  $ {cmd}" if cmd else "") + "".join(f"\n  {a}" for a in d["attached"])


def format_text(diff: Diff) -> str:
    d = diff.data
    lines = [_side_line("base", d["base"]), _side_line("head", d["head"]),
             *([PYTHON_VIEW_LINE] if d["python_only"] else []), *trust_lines(d["trust"])]
    for s in SECTIONS:
        if s.key in d["sections"]:
            lines += ["", *s.text(d["sections"][s.key])]
    if d["gate"]:
        lines += ["", gate_line(d["gate"])]
        if not d["trust"]["trusted"]:
            lines.append("gate: the runs are not comparable (see NOT COMPARABLE above)")
    return "\n".join(lines) + "\n"


def format_markdown(diff: Diff) -> str:
    d = diff.data
    lines = ["### memtrack diff", ""]
    for key in ("base", "head"):
        side = d[key]
        labels = ", ".join(f"{k}={v}" for k, v in side["labels"].items())
        lines.append(f"**{key}** {md(side['name'])}" + (f" ({labels})" if labels else "") +
                     (f" {md(' '.join(side['command']))}" if side["command"] else "") + "  ")
        lines += [f"{md(a)}  " for a in side["attached"]]
    if d["python_only"]:
        lines.append(f"{md(PYTHON_VIEW_LINE)}  ")
    if d["trust"]["problems"] or d["trust"]["refused_in_both"]:
        lines += ["", *(f":warning: {md(line)}  " for line in trust_lines(d["trust"]))]
    if d["gate"]:
        mark = ":x:" if d["gate"]["failed"] else ":white_check_mark:"
        lines += ["", f"{mark} {gate_line(d['gate'])}"]
    for s in SECTIONS:
        if s.key in d["sections"]:
            lines += ["", *s.markdown(d["sections"][s.key])]
    text = "\n".join(lines) + "\n"
    if len(text) > MD_LIMIT:
        text = text[:text.rfind("\n", 0, MD_LIMIT)]
        if text.count("```") % 2:  # cut inside a backtrace block
            text += "\n```"
        if text.count("<details>") > text.count("</details>"):
            text += "\n\n</details>"
        text += "\n\n(cut to fit a comment: --format text has it all)\n"
    return text


def format_json(diff: Diff) -> str:
    return json.dumps(diff.data, indent=2, default=str) + "\n"
