"""`memtrack report --html OUT.html`: one self-contained page (no network).

A flame graph per metric (bytes allocated, calls, alive at the heap peak, leaked,
temporary allocations), the heap and RSS timeline of each process with axes and a
hover readout, the processes, the hotspots and the report's sections (every site
with its backtraces), one search over all of them and, for a run with regions, a
sortable table of them (memtrack.report.regions). Everything comes from the run
reader (memtrack.report.reader) and the report's sections (memtrack.report.text); the
data is embedded as JSON and drawn by the small script below (SVG, no library).
`#metric=peak&q=TEXT` in the address opens a metric and a search.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import duckdb

from memtrack.report import regions
from memtrack.report.reader import METRICS, UNITS, Costs, RunReader
from memtrack.report.text import SECTIONS, ReportOptions, busiest, report_data
from memtrack.schema import is_loss

TIMELINE_POINTS = 1500  # per process and series, at most (reader.downsampled)
PAGE_PROCESSES = 200  # in the table and flame graph: those with the most calls
TIMELINE_PROCESSES = 20  # timelines drawn: of the processes with the most calls
FLAME_METRICS = {"allocated": "bytes allocated", "calls": "calls", "peak": "alive at peak",
                 "leaked": "leaked", "temporary": "temporary allocations"}
assert set(FLAME_METRICS) == set(METRICS)


def flame_tree(c: Costs, metric: str, shown: set[int] | None = None) -> list[list[Any]]:
    """The flame graph's nodes from the root outward ("all", process, main, ..., site), in
    pre-order (a node before its children, these by value, the largest first): [name,
    value, depth]. Flat, so that a stack of any depth is no recursion here or in the
    page. The processes not in `shown` (when given) hang from one node, "other
    processes", so that a run of thousands of them is not thousands of trees."""
    root: list[Any] = ["all", 0, {}]
    for row in c.rows:
        v = row.value(metric)
        if v <= 0:
            continue
        node = root
        node[1] += v
        top = c.root(row.pid) if shown is None or row.pid in shown else "other processes"
        for name in [top, *reversed(c.names(row.backtrace))]:
            child = node[2].get(name)
            if child is None:
                child = node[2][name] = [name, 0, {}]
            child[1] += v
            node = child
    out: list[list[Any]] = []
    todo = [(root, 0)]
    while todo:
        (name, value, kids), depth = todo.pop()
        out.append([name, value, depth])
        todo += [(k, depth + 1)  # popped largest first
                 for k in sorted(kids.values(), key=lambda k: (-k[1], k[0]), reverse=True)]
    return out


def page_data(con: duckdb.DuckDBPyConnection, opts: ReportOptions,
              report: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the page embeds: bounded whatever the run (a fork/exec storm is thousands of
    processes): the PAGE_PROCESSES with the most calls in its table and flame graph
    (the others as one "other processes"), the timelines of the TIMELINE_PROCESSES
    first of those, and how many processes there are. `report`: report_data's, when
    the caller has it."""
    run = RunReader(con, opts.pid)
    c = run.costs()
    report = dict(report or report_data(con, opts))
    total = len(report["processes"])
    report["processes"] = busiest(report["processes"], PAGE_PROCESSES)
    pids = [p["pid"] for p in report["processes"]]
    shown = set(pids) if total > PAGE_PROCESSES else None
    timelines = [p["pid"] for p in busiest(report["processes"], TIMELINE_PROCESSES)]
    return {
        "title": run.title,
        "report": report,
        "processes_total": total,
        "timeline_processes": TIMELINE_PROCESSES,
        "sections": [s.describe() for s in SECTIONS],
        "metrics": [{"key": m, "label": label, "unit": UNITS[m]}
                    for m, label in FLAME_METRICS.items()],
        "flame": {m: flame_tree(c, m, shown) for m in FLAME_METRICS},
        "timelines": run.timelines(TIMELINE_POINTS, timelines if total > TIMELINE_PROCESSES
                                   else None),
        "hotspots": RunReader(con).hotspots(50),
        "regions": regions.html_data(run, opts.top),
        "loss_counters": [k for k in run.losses if is_loss(k)],
    }


def render(data: dict[str, Any]) -> str:
    blob = json.dumps(data, default=str, separators=(",", ":")).replace("</", "<\\/")
    title = "memtrack: " + data["title"]
    return TEMPLATE.replace("__PAGE_HEAD__", PAGE_HEAD).replace(
        "__TITLE__", html.escape(title)).replace("__PAGE_SCRIPT__", PAGE_SCRIPT).replace(
        "__REGIONS_SCRIPT__", regions.HTML_SCRIPT).replace("__DATA__", blob)


def write_html(con: duckdb.DuckDBPyConnection, out: Path, opts: ReportOptions | None = None,
               report: dict[str, Any] | None = None) -> None:
    opts = opts or ReportOptions()
    Path(out).write_text(render(page_data(con, opts, report)))


# What every page's head starts with (this one's and history's): the title and the
# header's style.
PAGE_HEAD = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 0 24px 24px; color: #222; }
header { position: sticky; top: 0; background: #fff; padding: 10px 0 6px; z-index: 2;
         border-bottom: 1px solid #ddd; display: flex; gap: 16px; align-items: baseline; }
h1 { font-size: 17px; margin: 0; flex: 1; overflow: hidden; text-overflow: ellipsis;
     white-space: nowrap; }"""

# What every page's script starts with (this one's and history's): errors reported on the
# body (what the Chromium tests read), the embedded data, element and number helpers.
PAGE_SCRIPT = r"""window.addEventListener("error", function (e) {
  document.body.dataset.status = "error";
  document.body.dataset.error = String(e.message);
});
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const SVG_TAGS = ["svg", "rect", "text", "g", "polyline", "line", "title", "circle"];
function el(tag, attrs, parent, text) {
  const n = SVG_TAGS.includes(tag) ? document.createElementNS(NS, tag)
                                   : document.createElement(tag);
  for (const k in attrs || {}) n.setAttribute(k, attrs[k]);
  if (text !== undefined) n.textContent = text;
  if (parent) parent.appendChild(n);
  return n;
}
function bytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return i ? n.toFixed(2) + " " + u[i] : (Number.isInteger(n) ? n : n.toFixed(1)) + " B";
}
function count(n) { return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ","); }
"""

TEMPLATE = r"""__PAGE_HEAD__
h2 { font-size: 15px; margin: 22px 0 6px; }
#search { width: 22em; padding: 3px 6px; } #matched { color: #636; min-width: 12em; }
#command { font: 12px monospace; white-space: pre-wrap; color: #444; margin: 8px 0; }
table { border-collapse: collapse; margin: 4px 0; }
td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
table.plain tr:nth-child(even) td { background: #f6f6f6; }
tr.site td { border-top: 1px solid #e8e8e8; }
tr.site td:first-child { width: 1.2em; }
.toggle { border: 0; background: none; cursor: pointer; font-size: 12px; padding: 0 4px; }
tr.bt > td { padding: 2px 0 8px 2.2em; }
.trace { margin: 2px 0 6px; } .trace b { font-weight: 600; }
.trace ol { margin: 2px 0; padding-left: 2.4em; font: 12px monospace; }
.trace .file { color: #666; } .trace .cut { color: #a33; }
.btn { border: 1px solid #999; background: #eee; padding: 2px 10px; cursor: pointer; }
.btn.on { background: #345; color: #fff; }
#flame { width: 100%; overflow: hidden; } #flame svg { display: block; }
#flame rect { stroke: #fff; stroke-width: 0.5; cursor: pointer; }
#flame rect.match { fill: #c6c !important; }
#flame text { font: 11px monospace; pointer-events: none; fill: #111; }
#tip { position: fixed; background: #ffe; border: 1px solid #aa8; padding: 3px 6px;
       display: none; pointer-events: none; max-width: 60em; z-index: 3; }
.plot { display: block; margin-bottom: 8px; }
.plot text { font: 11px sans-serif; fill: #444; }
.plot .grid { stroke: #e4e4e4; } .plot .axis { stroke: #888; }
.plot .heap { fill: none; stroke: #c33; stroke-width: 1.5; }
.plot .rss { fill: none; stroke: #36c; stroke-width: 1.5; }
.plot .heap-label { fill: #c33; font-weight: 600; }
.plot .rss-label { fill: #36c; font-weight: 600; }
.plot .cursor { stroke: #555; stroke-dasharray: 3 3; }
.plot .readout { font-weight: 600; fill: #222; }
.hidden { display: none; } small { color: #666; }
.loss { color: #b00; margin: 2px 0; }
rect.stop { fill: #999; opacity: 0.25; }
th[data-sorted="asc"]::after { content: " \25B4"; }
th[data-sorted="desc"]::after { content: " \25BE"; }
</style></head>
<body data-status="loading">
<header><h1>__TITLE__</h1>
<input id="search" type="search" placeholder="search functions and files" autocomplete="off">
<span id="matched"></span></header>
<div id="command"></div>
<div id="totals"></div>
<div id="losses"></div>
<div id="regions"></div>
<h2>Flame graph <small>(root at the top; click to zoom, click the root to reset)</small></h2>
<div id="metric"></div>
<div id="flame"></div>
<h2>Heap and RSS over time <small>(<span style="color:#c33">heap</span>,
<span style="color:#36c">RSS</span>, grey: stopped by memtrack; from the program's first
instruction after exec; hover for values)</small></h2>
<div id="timeline"></div>
<div id="tables"></div>
<div id="tip"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
__PAGE_SCRIPT__
function fmt(v, unit) { return unit === "bytes" ? bytes(v) : count(v); }
function table(parent, head, rows, numeric) {
  const t = el("table", {class: "plain"}, parent), tr = el("tr", {}, t);
  head.forEach((h, i) => el("th", numeric[i] ? {class: "n"} : {}, tr, h));
  rows.forEach(r => {
    const row = el("tr", {}, t);
    r.forEach((v, i) => el("td", numeric[i] ? {class: "n"} : {}, row,
                           v === null || v === undefined ? "" : String(v)));
  });
  return t;
}
const tip = document.getElementById("tip");
function showTip(e, text) {
  tip.style.display = "block"; tip.style.left = (e.clientX + 12) + "px";
  tip.style.top = (e.clientY + 12) + "px"; tip.textContent = text;
}
function hideTip() { tip.style.display = "none"; }

const hashArg = k => (location.hash.match(new RegExp("[#&]" + k + "=([^&]*)")) || [])[1];
let metric = D.flame[hashArg("metric")] ? hashArg("metric") : "allocated";
let query = decodeURIComponent(hashArg("q") || "");
const matches = s => query !== "" && String(s || "").toLowerCase().includes(query.toLowerCase());

function totals() {
  const t = D.report.totals;
  document.getElementById("command").textContent =
    [(D.report.command || []).join(" "), ...(D.report.attached || [])].join("\n");
  const at = s => (s === null || s === undefined) ? "" : " at " + s.toFixed(3) + " s";
  const rate = r => " (" + count(r.toFixed(0)) + "/s)";
  table(document.getElementById("totals"), ["", ""], [
    ["total runtime", t.runtime_s.toFixed(3) + " s" + Object.entries(t.stopped).map(
      ([r, v], i) => (i ? ", " : " (stopped by memtrack: ") + count(v.count) + " " + r +
      " (" + v.seconds.toFixed(3) + " s)").join("") + (Object.keys(t.stopped).length ? ")" : "")],
    ["calls to allocation functions", count(t.calls) + rate(t.calls_per_s)],
    ["temporary allocations", count(t.temporary) + rate(t.temporary_per_s)],
    ["bytes allocated", bytes(t.allocated_bytes)],
    ["peak heap", bytes(t.peak_heap_bytes) + at(t.peak_heap_at_s)],
    ["peak RSS", t.peak_rss_bytes === null ? "not recorded"
                 : bytes(t.peak_rss_bytes) + at(t.peak_rss_at_s)],
    ["leaked", bytes(t.leaked_bytes) + " (" + count(t.leaked_allocations) + " allocations)"],
  ], [false, true]);
  const lost = Object.entries(D.report.losses), box = document.getElementById("losses");
  lost.forEach(([k, v]) => el("p", {class: "loss"}, box,
    (D.loss_counters.includes(k) ? "capture lost: " : "capture note: ") + k + " " + count(v)));
  D.report.probes_refused.forEach(r => el("p", {class: "loss"}, box,
    "not recorded: " + r.function + " in " + r.path + " (probe refused: " + r.why + ")"));
}

let zoom = null;
function color(name) {
  let h = 0; for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
  return "hsl(" + (10 + h % 45) + "," + (55 + h % 30) + "%," + (62 + h % 14) + "%)";
}
function unitOf(m) { return D.metrics.find(x => x.key === m).unit; }
function flame() {
  const box = document.getElementById("flame");
  box.textContent = "";
  const nodes = D.flame[metric], root = nodes[0], unit = unitOf(metric);
  const W = Math.max(box.clientWidth || 0, 600), H = 17;
  const svg = el("svg", {width: W, height: H + 2, id: "flame-svg"}, box);
  if (!root[1]) { el("text", {x: 4, y: 14}, svg, "nothing for this metric"); return null; }
  const b = zoom === null ? 0 : zoom, base = nodes[b];
  let matched = 0, depth = 0;
  const next = [0], inMatch = [false];  // per depth: the next child's x, a match above
  for (let i = b; i < nodes.length && (i === b || nodes[i][2] > base[2]); i++) {
    const n = nodes[i], k = n[2] - base[2], w = W * n[1] / base[1], x = next[k];
    next[k] = x + w;
    if (w < 0.5) continue;  // its children are narrower still
    next[k + 1] = x;
    depth = Math.max(depth, k);
    const hit = matches(n[0]), above = k > 0 && inMatch[k - 1];
    if (hit && !above) matched += n[1];
    inMatch[k] = above || hit;
    const g = el("g", {}, svg);
    const r = el("rect", {x: x, y: k * H, width: Math.max(w - 0.5, 0.5), height: H - 1,
                          fill: color(n[0]), class: "fg" + (hit ? " match" : ""),
                          "data-name": n[0], "data-depth": k, "data-value": n[1]}, g);
    const pct = (100 * n[1] / root[1]).toFixed(2);
    const label = n[0] + ": " + fmt(n[1], unit) + " (" + pct + "%)";
    el("title", {}, r, label);
    if (w > 40) {
      const chars = Math.floor((w - 6) / 6.6);
      el("text", {x: x + 3, y: k * H + 12}, g,
         n[0].length > chars ? n[0].slice(0, Math.max(chars - 1, 1)) + "…" : n[0]);
    }
    r.addEventListener("click", () => { zoom = i === b ? null : i; flame(); });
    r.addEventListener("mousemove", e => showTip(e, label));
    r.addEventListener("mouseleave", hideTip);
  }
  svg.setAttribute("height", (depth + 1) * H + 2);
  return query ? 100 * matched / root[1] : null;
}
function metricButtons() {
  const div = document.getElementById("metric");
  D.metrics.forEach(m => {
    const b = el("button", {class: "btn" + (m.key === metric ? " on" : ""),
                            "data-metric": m.key},
                 div, m.label + " (" + fmt(D.flame[m.key][0][1], m.unit) + ")");
    b.addEventListener("click", () => {
      metric = m.key; zoom = null;
      div.querySelectorAll("button").forEach(x => x.classList.toggle("on", x === b));
      refresh();
    });
  });
}

function niceStep(range, ticks) {
  const raw = range / ticks, p = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map(m => m * p).find(s => s >= raw);
}
function byteTicks(vmax) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (vmax >= 1024 && i < u.length - 1) { vmax /= 1024; i++; }
  const step = niceStep(vmax || 1, 4), out = [];
  for (let v = 0; v <= vmax * 1.0001; v += step)
    out.push([v * Math.pow(1024, i), (+v.toFixed(6)) + " " + u[i]]);
  return out;
}
function timeUnit(span) {  // [seconds per unit, name] for times over `span` seconds
  return span >= 2 ? [1, "s"] : span >= 2e-3 ? [1e-3, "ms"] : span >= 2e-6 ? [1e-6, "µs"]
                   : [1e-9, "ns"];
}
function timeTicks(t0, t1) {
  const span = Math.max(t1 - t0, 1e-9), step = niceStep(span, 10), out = [];
  const [per, name] = timeUnit(span);
  for (let k = Math.ceil(t0 / step); k * step <= t1 + step * 1e-6; k++)
    out.push([k * step, +(k * step / per).toFixed(6) + " " + name]);
  return out;
}
function lastAtOrBefore(s, t) {  // index of the last sample at or before t, or -1
  let lo = 0, hi = s.length - 1, ans = -1;
  while (lo <= hi) { const m = (lo + hi) >> 1; if (s[m][0] <= t) { ans = m; lo = m + 1; }
                     else hi = m - 1; }
  return ans;
}
function timeline() {
  const box = document.getElementById("timeline");
  box.textContent = "";
  if (!D.timelines.length) { el("p", {}, box, "no heap or RSS samples"); return; }
  if (D.processes_total > D.timeline_processes)
    el("p", {}, box, "the " + D.timeline_processes + " processes with the most calls of "
       + D.processes_total + " (memtrack report --pid PID --html: one process's)");
  const W = Math.max(box.clientWidth || 0, 600), PH = 110, GAP = 14, L = 78, R = 16, T = 22;
  const t0 = 0, t1 = Math.max(D.report.totals.runtime_s,
    ...D.timelines.map(p => Math.max(...p.heap.concat(p.rss).map(q => q[0]))));
  const X = t => L + (W - L - R) * (t1 > t0 ? (t - t0) / (t1 - t0) : 0);
  const [per, unit] = timeUnit(t1 - t0), when = t => (t / per).toFixed(3) + " " + unit;
  D.timelines.forEach(p => {
    const panels = [["heap", "heap", p.heap], ["rss", "RSS", p.rss]].filter(x => x[2].length);
    const H = T + panels.length * (PH + GAP) + 10;
    const svg = el("svg", {width: W, height: H, class: "plot", "data-pid": p.pid}, box);
    el("text", {x: 0, y: 13}, svg, p.name + " (pid " + p.pid + ")");
    panels.forEach(([cls, name, s], i) => {
      const top = T + i * (PH + GAP), bottom = top + PH - 16;
      const vmax = Math.max(1, ...s.map(q => q[1]));
      const Y = v => bottom - (bottom - top - 4) * v / vmax;
      byteTicks(vmax).forEach(([v, label]) => {
        el("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid"}, svg);
        el("text", {x: L - 6, y: Y(v) + 4, "text-anchor": "end", class: "ytick"},
           svg, label);
      });
      timeTicks(t0, t1).forEach(([t, label]) => {
        el("line", {x1: X(t), x2: X(t), y1: top, y2: bottom, class: "grid"}, svg);
        el("text", {x: X(t), y: bottom + 13, "text-anchor": "middle", class: "xtick"},
           svg, label);
      });
      el("line", {x1: L, y1: bottom, x2: W - R, y2: bottom, class: "axis"}, svg);
      el("line", {x1: L, y1: top, x2: L, y2: bottom, class: "axis"}, svg);
      p.stops.forEach(([b, e, why]) => {
        const r = el("rect", {x: X(b), y: top, width: Math.max(X(e) - X(b), 1),
                              height: bottom - top, class: "stop"}, svg);
        el("title", {}, r, "stopped by memtrack (" + why + "): " + when(b) + " to " + when(e));
      });
      el("text", {x: L + 4, y: top + 10, class: cls + "-label"}, svg, name);
      let d = [], prev = null;  // steps: a value holds until the next sample
      s.forEach(q => { if (prev !== null) d.push(X(q[0]) + "," + Y(prev));
                       d.push(X(q[0]) + "," + Y(q[1])); prev = q[1]; });
      d.push(X(t1) + "," + Y(prev));
      el("polyline", {points: d.join(" "), class: cls}, svg);
    });
    const cursor = el("line", {y1: T, y2: H - 10, class: "cursor hidden"}, svg);
    const readout = el("text", {x: W - R, y: 13, "text-anchor": "end", class: "readout"}, svg);
    svg.addEventListener("mousemove", e => {
      const x = e.clientX - svg.getBoundingClientRect().left;
      if (x < L || x > W - R) return;
      const t = t0 + (t1 - t0) * (x - L) / (W - L - R);
      const hi = lastAtOrBefore(p.heap, t), ri = lastAtOrBefore(p.rss, t);
      cursor.setAttribute("x1", x); cursor.setAttribute("x2", x);
      cursor.classList.remove("hidden");
      readout.textContent = when(t) + "   heap " + (hi < 0 ? "-" : bytes(p.heap[hi][1]))
        + "   RSS " + (ri < 0 ? "-" : bytes(p.rss[ri][1]));
      Object.assign(svg.dataset, {t: t, heap: hi < 0 ? "" : p.heap[hi][1],
                                  rss: ri < 0 ? "" : p.rss[ri][1]});
    });
    svg.addEventListener("mouseleave", () => { cursor.classList.add("hidden"); });
  });
}

function siteText(e) {
  return [e.location, e.file, e.module].concat(
    ...e.backtraces.map(b => b.frames.map(f => f.function + " " + (f.file || ""))))
    .join("\n");
}
function sitesTable(box, section) {
  const entries = D.report.sections[section.key];
  el("h2", {}, box, section.title.charAt(0) + section.title.slice(1).toLowerCase());
  if (!entries.length) { el("p", {}, box, "(none)"); return; }
  const t = el("table", {class: "sites", "data-section": section.key}, box);
  const head = el("tr", {}, t);
  ["", "location", "file:line", section.unit === "bytes" ? "bytes" : section.unit,
   "backtraces"].forEach((h, i) => el("th", i >= 3 ? {class: "n"} : {}, head, h));
  entries.forEach(e => {
    const row = el("tr", {class: "site", "data-search": siteText(e)}, t);
    const btn = el("button", {class: "toggle", title: "backtraces"}, el("td", {}, row), "▸");
    el("td", {}, row, e.location);
    el("td", {}, row, e.file ? e.file + ":" + e.line : (e.module || ""));
    el("td", {class: "n"}, row, fmt(e.value, section.unit));
    el("td", {class: "n"}, row, String(e.stacks));
    const bt = el("tr", {class: "bt hidden"}, t), cell = el("td", {colspan: 5}, bt);
    e.backtraces.forEach(b => {
      const div = el("div", {class: "trace"}, cell);
      el("b", {}, div, fmt(b.value, section.unit) + " from:");
      const ol = el("ol", {}, div);
      (b.frames.length ? b.frames : [{function: "[no stack]"}]).forEach(f => {
        const li = el("li", f.function === "[truncated]" ? {class: "cut"} : {}, ol,
                      f.function);
        if (f.file) el("span", {class: "file"}, li, "  " + f.file + ":" + f.line);
      });
    });
    if (e.stacks > e.backtraces.length)
      el("small", {}, cell, (e.stacks - e.backtraces.length) + " more backtraces "
         + "(memtrack report --format json)");
    btn.addEventListener("click", () => {
      const open = bt.classList.toggle("hidden") === false;
      btn.textContent = open ? "▾" : "▸";
    });
  });
}
function tables() {
  const box = document.getElementById("tables"), R = D.report;
  el("h2", {}, box, "Processes");
  table(box, ["pid", "parent", "name", "exit", "calls", "peak heap", "leaked", "peak RSS"],
    R.processes.map(p => [p.pid, p.ppid, p.name,
      p.exit_signal ? "signal " + p.exit_signal : p.exit_code,
      count(p.calls), bytes(p.peak_heap_bytes), bytes(p.leaked_bytes),
      p.peak_rss_bytes === null ? "" : bytes(p.peak_rss_bytes)]),
    [true, true, false, false, true, true, true, true]);
  if (D.processes_total > R.processes.length)
    el("p", {}, box, (D.processes_total - R.processes.length) + " more processes with "
       + "fewer calls, in the flame graph as \"other processes\" (memtrack report "
       + "--format json lists them all)");
  el("h2", {}, box, "Hotspots (by allocating function, all processes)");
  const ht = table(box, ["function", "calls", "allocated", "at peak", "leaked", "incl. calls",
                         "incl. allocated"],
    D.hotspots.map(h => [h.function, count(h.self_calls), bytes(h.self_bytes),
                         bytes(h.self_peak_bytes), bytes(h.self_leaked_bytes),
                         count(h.incl_calls), bytes(h.incl_bytes)]),
    [false, true, true, true, true, true, true]);
  ht.id = "hotspots";
  ht.querySelectorAll("tr").forEach((tr, i) => {
    if (i) tr.dataset.search = D.hotspots[i - 1].function;
  });
  D.sections.forEach(s => { if (s.kind === "sites") sitesTable(box, s); });
}
function filterRows() {
  document.querySelectorAll("tr[data-search]").forEach(tr => {
    const hide = query !== "" && !matches(tr.dataset.search);
    tr.classList.toggle("hidden", hide);
    const next = tr.nextElementSibling;
    if (hide && next && next.classList.contains("bt")) next.classList.add("hidden");
  });
}
function refresh() {
  const pct = flame();
  filterRows();
  document.getElementById("matched").textContent = pct === null ? ""
    : "matched " + pct.toFixed(1) + "% of " + D.metrics.find(m => m.key === metric).label;
}

__REGIONS_SCRIPT__
totals(); regions(); metricButtons(); timeline(); tables();
const search = document.getElementById("search");
search.value = query;
search.addEventListener("input", () => { query = search.value.trim(); refresh(); });
refresh();
let drawnWidth = document.getElementById("flame").clientWidth;
window.addEventListener("resize", () => {  // redraw for another width only
  const w = document.getElementById("flame").clientWidth;
  if (w !== drawnWidth) { drawnWidth = w; refresh(); timeline(); }
});
if (document.body.dataset.status === "loading") document.body.dataset.status = "ok";
</script>
</body></html>
"""
