"""The regions section of the reports: one row per region (a benchmark, a test), and
`memtrack report --region NAME`: one region's figures and allocation sites.

Every figure comes from the run database's region views (memtrack.schema.ddl:
region_metrics, region_stack_costs, region_heap_timeline). A region's allocations are
those its thread made inside it (nested regions' included); its peak heap is the
highest its thread's heap changes inside it took the heap above where it stood at the
region's begin; alive at its end: the blocks it allocated that were still allocated
when it closed; leaked: those never freed at all; its RSS growth: the highest its
process's RSS went while it ran above that RSS at its begin (the process's RSS itself
is every region's of the process alike).

The reports list the regions that allocated the most bytes first (TOP_ORDER), --top of
them, and count the rest.

`RegionReader.by_name()` is the hook for comparing runs: regions matched by name,
their instances aggregated.
"""

from __future__ import annotations

from typing import Any

from memtrack.report.reader import RunReader, downsampled
from memtrack.report.text import human_bytes, section_lines

# region_metrics column -> the key of a region row (the JSON's), in the rows' order
COLUMNS = {
    "region_id": "region_id", "name": "name", "pid": "pid", "tid": "tid",
    "parent_id": "parent_id", "depth": "depth", "ended": "ended", "calls": "calls",
    "bytes": "allocated_bytes", "avg_size": "average_bytes", "temporary": "temporary",
    "frees": "frees", "freed_bytes": "freed_bytes", "peak_heap_bytes": "peak_heap_bytes",
    "alive_calls": "alive_allocations", "alive_bytes": "alive_bytes",
    "leaked_calls": "leaked_allocations", "leaked_bytes": "leaked_bytes",
    "rss_at_begin_bytes": "rss_at_begin_bytes", "peak_rss_bytes": "peak_rss_bytes",
}  # fmt: skip

# --region's sections: key -> (title, region_stack_costs value column, count column, noun)
SECTIONS: dict[str, tuple[str, str, str, str]] = {
    "calls": ("MOST CALLS TO ALLOCATION FUNCTIONS", "calls", "calls", "calls"),
    "peak": ("PEAK MEMORY CONSUMERS (alive at the region's heap peak)", "peak_bytes",
             "peak_calls", "bytes"),
    "alive": ("ALIVE AT THE REGION'S END", "alive_bytes", "alive_calls", "bytes"),
    "temporary": ("MOST TEMPORARY ALLOCATIONS", "temporary", "temporary", "calls"),
}  # fmt: skip

# the region's RSS growth (a row's rss_growth_bytes): its process's peak RSS while it
# ran above the RSS at its begin
RSS_GROWTH = "peak_rss_bytes - coalesce(rss_at_begin_bytes, 0)"
BEGIN_ORDER = "begin_ts, region_id"
TOP_ORDER = "bytes DESC, peak_heap_bytes DESC, begin_ts, region_id"  # the reports' order

TIMELINE_POINTS = 200  # per region, at most (reader.downsampled)
MAX_TIMELINES = 500  # regions whose heap timeline the HTML page embeds (by peak heap)


class RegionReader:
    """Named queries over the regions of a run (of one process with the run's `pid`)."""

    def __init__(self, run: RunReader) -> None:
        self.run = run
        self.con = run.con

    def rows(self, where: str = "TRUE", params: list[Any] | None = None, *,
             order: str = BEGIN_ORDER, limit: int | None = None) -> list[dict[str, Any]]:
        """The regions (and `where` over region_metrics) in `order` (by begin), at most
        `limit`: times in seconds from the run's start."""
        start = float(self.run.start_ns)
        cols = ", ".join(COLUMNS)
        most = "" if limit is None else f"LIMIT {int(limit)}"
        rows = self.con.execute(f"""
            SELECT {cols}, {RSS_GROWTH}, (begin_ts::DOUBLE - ?) / 1e9, duration_ns / 1e9,
                   (peak_heap_ts::DOUBLE - ?) / 1e9
            FROM region_metrics WHERE {self.run.where()} AND ({where})
            ORDER BY {order} {most}""", [start, start, *(params or [])]).fetchall()
        keys = (*COLUMNS.values(), "rss_growth_bytes", "begin_s", "duration_s",
                "peak_heap_at_s")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def count(self) -> int:
        return int(self.run.one(f"SELECT count(*) FROM regions WHERE {self.run.where()}"))

    def top(self, n: int) -> list[dict[str, Any]]:
        """The `n` regions that allocated the most bytes (TOP_ORDER)."""
        return self.rows(order=TOP_ORDER, limit=n)

    def named(self, name: str) -> list[dict[str, Any]]:
        return self.rows("name = ?", [name])

    def similar(self, name: str, limit: int = 5) -> list[str]:
        """Region names containing `name` (for a one-line error when none is it)."""
        return [r[0] for r in self.con.execute(f"""
            SELECT DISTINCT name FROM regions WHERE {self.run.where()}
            AND contains(lower(name), lower(?)) ORDER BY name LIMIT {int(limit)}""",
                                               [name]).fetchall()]

    def sections(self, region_ids: list[int], top: int, backtraces: int
                 ) -> dict[str, list[dict[str, Any]]]:
        """The allocation sites of these regions' allocations, per SECTIONS metric."""
        ids = ", ".join(str(int(r)) for r in region_ids) or "NULL"
        costs = f"SELECT * FROM region_stack_costs WHERE region_id IN ({ids})"
        return {k: self.run.sites_of(costs, col, counted, top, backtraces)
                for k, (_, col, counted, _) in SECTIONS.items()}

    def timelines(self, region_ids: list[int], points: int = TIMELINE_POINTS
                  ) -> dict[int, list[list[float | int]]]:
        """Per region: its heap above its begin over time, [seconds from the run's
        start, bytes], from 0 at its begin to its value at its end, at most `points`
        changes (downsampled: each bucket's minimum, maximum and last value kept)."""
        if not region_ids:
            return {}
        ids = ", ".join(str(int(r)) for r in region_ids)
        rows = self.con.execute(downsampled(f"""
            SELECT region_id, ts, heap_bytes, event_id FROM region_heap_timeline
            WHERE region_id IN ({ids})""", points)).fetchall()
        spans = dict(((r, (b, e)) for r, b, e in self.con.execute(
            f"SELECT region_id, begin_ts, end_ts FROM regions WHERE region_id IN ({ids})"
        ).fetchall()))
        start = self.run.start_ns
        out: dict[int, list[list[float | int]]] = {}
        for rid, (begin, _) in spans.items():
            out[rid] = [[round((begin - start) / 1e9, 9), 0]]
        for rid, ts, v in rows:
            out[rid].append([round((ts - start) / 1e9, 9), int(v)])
        for rid, (_, end) in spans.items():
            out[rid].append([round((end - start) / 1e9, 9), out[rid][-1][1]])
        return out

    def by_name(self) -> dict[str, dict[str, Any]]:
        """Per region name, its instances together (for comparing runs by name): how
        many, time, calls and bytes summed, peaks at their maximum."""
        rows = self.con.execute(f"""
            SELECT name, count(*), sum(duration_ns) / 1e9, sum(calls)::BIGINT,
                   sum(bytes)::BIGINT, max(peak_heap_bytes), max(peak_rss_bytes),
                   sum(alive_calls)::BIGINT, sum(alive_bytes)::BIGINT,
                   sum(leaked_calls)::BIGINT, sum(leaked_bytes)::BIGINT,
                   sum(temporary)::BIGINT, bool_and(ended)
            FROM region_metrics WHERE {self.run.where()} GROUP BY name ORDER BY name"""
                                ).fetchall()
        keys = ("instances", "duration_s", "calls", "allocated_bytes", "peak_heap_bytes",
                "peak_rss_bytes", "alive_allocations", "alive_bytes", "leaked_allocations",
                "leaked_bytes", "temporary", "ended")
        return {r[0]: dict(zip(keys, r[1:], strict=True)) for r in rows}


def region_data(run: RunReader, name: str, top: int = 10, backtraces: int = 3
                ) -> dict[str, Any] | None:
    """`--region NAME`: every instance of the region with that name, and the allocation
    sites of their allocations together; None when no region has that name."""
    reader = RegionReader(run)
    instances = reader.named(name)
    if not instances:
        return None
    ids = [r["region_id"] for r in instances]
    return {"command": run.command, "artifact": run.meta.get("artifact"), "pid": run.pid,
            "region": name, "instances": instances,
            "timelines": {str(k): v for k, v in reader.timelines(ids).items()},
            "sections": reader.sections(ids, top, backtraces)}


def _s(v: float | None) -> str:
    return f"{v:.3f}s" if v is not None else "?"


def _blocks(n: int, b: int) -> str:
    return f"{n} ({human_bytes(b)})"


def _optional_bytes(n: int | None) -> str:
    return human_bytes(n) if n is not None else "-"


def region_table_lines(rows: list[dict[str, Any]], total: int) -> list[str]:
    """The text report's REGIONS section: one line per region of `rows` (the top ones of
    `total` regions, TOP_ORDER), then how many more there are."""
    lines = ["REGIONS (most bytes allocated first; peak heap: above the heap at the "
             "region's begin; RSS growth: its process's peak RSS in it above the RSS at its "
             "begin; alive: its blocks still allocated at its end)",
             f"  {'calls':>8} {'allocated':>10} {'average':>9} {'peak heap':>10} "
             f"{'RSS growth':>10} {'process RSS':>11} {'alive at end':>16} {'leaked':>16} "
             f"{'time':>9}  region"]
    for r in rows:
        flag = "" if r["ended"] else "  [never ended: closed at exit]"
        lines.append(
            f"  {r['calls']:>8} {human_bytes(r['allocated_bytes']):>10} "
            f"{_optional_bytes(r['average_bytes']):>9} "
            f"{human_bytes(r['peak_heap_bytes']):>10} "
            f"{_optional_bytes(r['rss_growth_bytes']):>10} "
            f"{_optional_bytes(r['peak_rss_bytes']):>11} "
            f"{_blocks(r['alive_allocations'], r['alive_bytes']):>16} "
            f"{_blocks(r['leaked_allocations'], r['leaked_bytes']):>16} "
            f"{_s(r['duration_s']):>9}  {r['name']}{flag}")
    if total > len(rows):
        lines.append(f"  … and {total - len(rows):,} more region"
                     f"{'' if total - len(rows) == 1 else 's'} (--top N lists more)")
    return lines


def format_region(data: dict[str, Any]) -> str:
    """`--region NAME` as text."""
    lines = []
    if data["command"]:
        lines.append("command: " + " ".join(data["command"]))
    for r in data["instances"]:
        state = "ended" if r["ended"] else "never ended (closed at its thread's exit)"
        rss = (f"{human_bytes(r['rss_growth_bytes'])} above its begin (its process's: "
               f"{human_bytes(r['rss_at_begin_bytes'] or 0)} at its begin, peak "
               f"{human_bytes(r['peak_rss_bytes'])})"
               if r["peak_rss_bytes"] is not None else "not recorded")
        avg = human_bytes(r["average_bytes"]) if r["average_bytes"] is not None else "-"
        lines += [
            f"region {r['name']}: process {r['pid']}, thread {r['tid']}, "
            f"{_s(r['duration_s'])} from {_s(r['begin_s'])}, {state}",
            f"  calls to allocation functions: {r['calls']} ({r['temporary']} temporary)",
            f"  bytes allocated: {human_bytes(r['allocated_bytes'])} (average {avg})",
            f"  peak heap above its begin: {human_bytes(r['peak_heap_bytes'])} at "
            f"{_s(r['peak_heap_at_s'])}",
            f"  RSS growth: {rss}",
            f"  frees: {r['frees']} ({human_bytes(r['freed_bytes'])})",
            f"  alive at its end: {_blocks(r['alive_allocations'], r['alive_bytes'])}",
            f"  leaked (never freed): {_blocks(r['leaked_allocations'], r['leaked_bytes'])}",
        ]
    for key, (title, _, _, noun) in SECTIONS.items():
        lines += section_lines(title, data["sections"][key], noun)
    return "\n".join(lines) + "\n"


def html_data(run: RunReader, top: int) -> dict[str, Any]:
    """What the HTML page's regions table draws: every row (the table shows the `top`
    first in the order chosen, TOP_ORDER's first), and the heap timelines of the
    MAX_TIMELINES regions with the highest peaks."""
    reader = RegionReader(run)
    rows = reader.rows(order=TOP_ORDER)
    peaks = sorted(rows, key=lambda r: -r["peak_heap_bytes"])[:MAX_TIMELINES]
    timelines = reader.timelines([r["region_id"] for r in peaks])
    return {"rows": rows, "top": top, "timelines": {str(k): v for k, v in timelines.items()}}


# The page's regions table (memtrack.report.html puts it in its script): the `top` rows
# (most bytes allocated first) and a line counting the others (a click shows them all),
# sortable by any column (click its header; #sort=KEY[:desc] in the address), a click
# on a row (#region=ID) draws that region's heap timeline.
HTML_SCRIPT = r"""
function regions() {
  const R = D.regions, box = document.getElementById("regions");
  if (!R || !R.rows.length) return;
  el("h2", {}, box, "Regions (" + R.rows.length + ")");
  el("small", {}, box, "Click a column to sort, a row to see its heap over time. Peak heap: "
     + "above the heap at the region's begin; RSS growth: its process's peak RSS in it "
     + "above the RSS at its begin; alive: its blocks still allocated at its end.");
  const secs = v => v === null ? "" : v.toFixed(3) + "s";
  const n = v => v === null || v === undefined ? "" : String(v);
  const b = v => v === null || v === undefined ? "" : bytes(v);
  const cols = [
    ["region", "name",
     r => "\u00a0".repeat(2 * r.depth) + r.name + (r.ended ? "" : " [never ended]")],
    ["begin", "begin_s", r => secs(r.begin_s)], ["time", "duration_s", r => secs(r.duration_s)],
    ["calls", "calls", r => n(r.calls)],
    ["allocated", "allocated_bytes", r => b(r.allocated_bytes)],
    ["average", "average_bytes",
     r => b(r.average_bytes === null ? null : Math.round(r.average_bytes))],
    ["peak heap", "peak_heap_bytes", r => b(r.peak_heap_bytes)],
    ["RSS growth", "rss_growth_bytes", r => b(r.rss_growth_bytes)],
    ["process RSS", "peak_rss_bytes", r => b(r.peak_rss_bytes)],
    ["alive at end", "alive_bytes", r => r.alive_allocations + " (" + bytes(r.alive_bytes) + ")"],
    ["leaked", "leaked_bytes", r => r.leaked_allocations + " (" + bytes(r.leaked_bytes) + ")"],
    ["temporary", "temporary", r => n(r.temporary)],
  ];
  const t = el("table", {id: "regions-table"}, box), head = el("tr", {}, t);
  let key = "allocated_bytes", asc = false, shown = R.top;
  const body = el("tbody", {}, t), plot = el("div", {id: "region-plot"}, box);
  cols.forEach(([label, k], i) => {
    const th = el("th", i ? {class: "n", "data-key": k} : {"data-key": k}, head, label);
    th.style.cursor = "pointer";
    th.addEventListener("click", () => { asc = key === k ? !asc : k === "name"; key = k; draw(); });
  });
  function draw() {
    const rows = R.rows.slice().sort((x, y) => {
      const a = x[key], c = y[key];
      const d = a === c ? 0 : a === null ? 1 : c === null ? -1 : a < c ? -1 : 1;
      return (asc ? d : -d) || x.region_id - y.region_id;
    });
    body.textContent = "";
    rows.slice(0, shown).forEach(r => {
      const tr = el("tr", {"data-region": r.region_id}, body);
      tr.style.cursor = "pointer";
      cols.forEach(([, , f], i) => el("td", i ? {class: "n"} : {}, tr, f(r)));
      tr.addEventListener("click", () => regionPlot(r));
    });
    if (rows.length > shown) {
      const more = el("td", {colspan: cols.length, class: "more"}, el("tr", {}, body),
                      "… and " + count(rows.length - shown) + " more region"
                      + (rows.length - shown === 1 ? "" : "s") + " (show all)");
      more.style.cursor = "pointer";
      more.addEventListener("click", () => { shown = rows.length; draw(); });
    }
    head.querySelectorAll("th").forEach(th => th.dataset.sorted =
      th.dataset.key === key ? (asc ? "asc" : "desc") : "");
  }
  function regionPlot(r) {
    plot.textContent = "";
    const s = R.timelines[String(r.region_id)];
    el("div", {}, plot, r.name + ": heap above its begin over time" +
       (s ? "" : " (not embedded: only the " + Object.keys(R.timelines).length +
        " regions with the highest peaks are)"));
    if (!s) return;
    const W = 900, H = 160, L = 70, B = 20;
    const svg = el("svg", {width: W, height: H + B, class: "plot"}, plot);
    const t0 = s[0][0], t1 = s[s.length - 1][0], vmax = Math.max(1, ...s.map(q => q[1]));
    const X = q => L + (W - L - 10) * (t1 > t0 ? (q - t0) / (t1 - t0) : 0);
    const Y = v => H - (H - 10) * Math.max(v, 0) / vmax;
    el("line", {x1: L, y1: H, x2: W - 10, y2: H, class: "axis"}, svg);
    el("text", {x: 2, y: 16}, svg, bytes(vmax));
    el("text", {x: L, y: H + 15}, svg, t0.toFixed(3) + "s");
    el("text", {x: W - 60, y: H + 15}, svg, t1.toFixed(3) + "s");
    let d = [], prev = null;
    s.forEach(q => { if (prev !== null) d.push(X(q[0]) + "," + Y(prev));
                     d.push(X(q[0]) + "," + Y(q[1])); prev = q[1]; });
    el("polyline", {points: d.join(" "), class: "heap"}, svg);
  }
  // #sort=KEY[:desc] and #region=ID in the page's address: a sorted table, a plot shown
  const sort = location.hash.match(/sort=(\w+)(:desc)?/);
  if (sort && cols.some(c => c[1] === sort[1])) { key = sort[1]; asc = !sort[2]; }
  draw();
  const pick = location.hash.match(/region=(\d+)/);
  const chosen = pick && R.rows.find(r => r.region_id === Number(pick[1]));
  if (chosen) regionPlot(chosen);
}
"""
