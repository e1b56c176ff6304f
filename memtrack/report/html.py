"""`memtrack report --html OUT.html`: one self-contained page (no network).

A flame graph of bytes allocated / alive at the heap peak / leaked (switchable), the heap
and RSS timeline of each process, and the report's tables, all from the run reader
(memtrack.report.reader). The data is embedded as JSON;
the page draws it with the small script below (SVG, no library).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import duckdb

from memtrack.report.reader import Costs, RunReader
from memtrack.report.text import ReportOptions, report_data

TIMELINE_POINTS = 1500  # per process and series, at most (max-preserving downsampling)
FLAME_METRICS = ("allocated", "peak", "leaked")


def flame_tree(c: Costs, metric: str) -> list[Any]:
    """Nested [name, value, children] from the root outward (process, main, ..., site)."""
    root: list[Any] = ["all", 0, {}]
    for row in c.rows:
        v = row.value(metric)
        if v <= 0:
            continue
        node = root
        node[1] += v
        for name in [c.root(row.pid), *reversed(c.names(row.backtrace))]:
            child = node[2].get(name)
            if child is None:
                child = node[2][name] = [name, 0, {}]
            child[1] += v
            node = child

    def freeze(n: list[Any]) -> list[Any]:
        kids = sorted(n[2].values(), key=lambda k: -k[1])
        return [n[0], n[1], [freeze(k) for k in kids]]

    return freeze(root)


def page_data(con: duckdb.DuckDBPyConnection, opts: ReportOptions) -> dict[str, Any]:
    run = RunReader(con, opts.pid)
    c = run.costs()
    return {
        "report": report_data(con, opts),
        "flame": {m: flame_tree(c, m) for m in FLAME_METRICS},
        "timelines": run.timelines(TIMELINE_POINTS),
        "hotspots": RunReader(con).hotspots(50),
    }


def render(data: dict[str, Any]) -> str:
    blob = json.dumps(data, default=str, separators=(",", ":")).replace("</", "<\\/")
    title = "memtrack: " + " ".join(data["report"].get("command") or []) or "memtrack"
    return TEMPLATE.replace("__TITLE__", html.escape(title)).replace("__DATA__", blob)


def write_html(con: duckdb.DuckDBPyConnection, out: Path, opts: ReportOptions | None = None,
               ) -> None:
    opts = opts or ReportOptions()
    Path(out).write_text(render(page_data(con, opts)))


TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; } h2 { font-size: 15px; margin: 22px 0 6px; }
table { border-collapse: collapse; margin: 4px 0; }
td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #f6f6f6; }
.btn { border: 1px solid #999; background: #eee; padding: 2px 10px; cursor: pointer; }
.btn.on { background: #345; color: #fff; }
#flame { width: 100%; overflow: hidden; } #flame svg { display: block; }
#flame rect { stroke: #fff; stroke-width: 0.5; cursor: pointer; }
#flame text { font: 11px monospace; pointer-events: none; fill: #111; }
#tip { position: fixed; background: #ffe; border: 1px solid #aa8; padding: 3px 6px;
       display: none; pointer-events: none; max-width: 60em; }
.plot text { font: 11px sans-serif; fill: #444; }
.plot .heap { fill: none; stroke: #c33; stroke-width: 1.5; }
.plot .rss { fill: none; stroke: #36c; stroke-width: 1.5; }
.plot .axis { stroke: #888; } small { color: #666; }
</style></head>
<body data-status="loading">
<h1>__TITLE__</h1>
<div id="totals"></div>
<h2>Flame graph <small>(root at the top; click to zoom, click the root to reset)</small></h2>
<div id="metric"></div>
<div id="flame"></div>
<h2>Heap and RSS over time <small>(<span style="color:#c33">heap</span>,
<span style="color:#36c">RSS</span>)</small></h2>
<div id="timeline"></div>
<div id="tables"></div>
<div id="tip"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
window.addEventListener("error", function (e) {
  document.body.dataset.status = "error";
  document.body.dataset.error = String(e.message);
});
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, parent, text) {
  const n = tag === "svg" || ["rect", "text", "g", "polyline", "line", "title"]
    .includes(tag) ? document.createElementNS(NS, tag) : document.createElement(tag);
  for (const k in attrs || {}) n.setAttribute(k, attrs[k]);
  if (text !== undefined) n.textContent = text;
  if (parent) parent.appendChild(n);
  return n;
}
function bytes(n) {
  const u = ["B", "K", "M", "G", "T"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return i ? n.toFixed(2) + u[i] : n + "B";
}
function table(parent, head, rows, numeric) {
  const t = el("table", {}, parent), tr = el("tr", {}, t);
  head.forEach((h, i) => el("th", numeric[i] ? {class: "n"} : {}, tr, h));
  rows.forEach(r => {
    const row = el("tr", {}, t);
    r.forEach((v, i) => el("td", numeric[i] ? {class: "n"} : {}, row,
                           v === null || v === undefined ? "" : String(v)));
  });
  return t;
}

function totals() {
  const t = D.report.totals, div = document.getElementById("totals");
  const at = s => (s === null || s === undefined) ? "" : " at " + s.toFixed(3) + "s";
  table(div, ["", ""], [
    ["total runtime", t.runtime_s.toFixed(3) + "s"],
    ["calls to allocation functions", t.calls + " (" + t.calls_per_s.toFixed(0) + "/s)"],
    ["temporary allocations", t.temporary + " (" + t.temporary_per_s.toFixed(0) + "/s)"],
    ["bytes allocated", bytes(t.allocated_bytes)],
    ["peak heap", bytes(t.peak_heap_bytes) + at(t.peak_heap_at_s)],
    ["peak RSS", t.peak_rss_bytes === null ? "not recorded"
                 : bytes(t.peak_rss_bytes) + at(t.peak_rss_at_s)],
    ["leaked", bytes(t.leaked_bytes) + " (" + t.leaked_allocations + " allocations)"],
  ], [false, true]);
}

let metric = (location.hash.match(/metric=(allocated|peak|leaked)/) || [0, "allocated"])[1];
let zoom = null;
function color(name) {
  let h = 0; for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
  return "hsl(" + (10 + h % 45) + "," + (55 + h % 30) + "%," + (62 + h % 14) + "%)";
}
function flame() {
  const box = document.getElementById("flame");
  box.textContent = "";
  const root = D.flame[metric];
  const W = Math.max(box.clientWidth || 0, 600), H = 17;
  let depth = 0;
  (function d(n, k) { depth = Math.max(depth, k); n[2].forEach(c => d(c, k + 1)); })(root, 0);
  const svg = el("svg", {width: W, height: (depth + 1) * H + 2, id: "flame-svg"}, box);
  if (!root[1]) { el("text", {x: 4, y: 14}, svg, "no bytes for this view"); return; }
  const base = zoom || root;
  const tip = document.getElementById("tip");
  function draw(n, x, w, k, path) {
    if (w < 0.5) return;
    const g = el("g", {}, svg);
    const r = el("rect", {x: x, y: k * H, width: Math.max(w - 0.5, 0.5), height: H - 1,
                          fill: color(n[0]), class: "fg"}, g);
    const pct = (100 * n[1] / root[1]).toFixed(2);
    el("title", {}, r, n[0] + ": " + bytes(n[1]) + " (" + pct + "%)");
    if (w > 40) {
      const chars = Math.floor((w - 6) / 6.6);
      el("text", {x: x + 3, y: k * H + 12}, g,
         n[0].length > chars ? n[0].slice(0, Math.max(chars - 1, 1)) + "…" : n[0]);
    }
    r.addEventListener("click", () => { zoom = (n === base) ? null : n; flame(); });
    r.addEventListener("mousemove", e => {
      tip.style.display = "block"; tip.style.left = (e.clientX + 12) + "px";
      tip.style.top = (e.clientY + 12) + "px";
      tip.textContent = n[0] + " — " + bytes(n[1]) + " (" + pct + "% of " + metric + ")";
    });
    r.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    let cx = x;
    n[2].forEach(c => { const cw = w * c[1] / n[1]; draw(c, cx, cw, k + 1); cx += cw; });
  }
  draw(base, 0, W, 0);
}
function metricButtons() {
  const div = document.getElementById("metric");
  [["allocated", "bytes allocated"], ["peak", "alive at peak"], ["leaked", "leaked"]]
    .forEach(([m, label]) => {
      const b = el("button", {class: "btn" + (m === metric ? " on" : ""), "data-metric": m},
                   div, label + " (" + bytes(D.flame[m][1]) + ")");
      b.addEventListener("click", () => {
        metric = m; zoom = null;
        div.querySelectorAll("button").forEach(x => x.classList.toggle("on", x === b));
        flame();
      });
    });
}

function timeline() {
  const box = document.getElementById("timeline");
  if (!D.timelines.length) { el("p", {}, box, "no heap or RSS samples"); return; }
  D.timelines.forEach(p => {
    el("div", {}, box, p.name + " (pid " + p.pid + ")");
    const W = 900, H = 180, L = 70, B = 20;
    const svg = el("svg", {width: W, height: H + B, class: "plot"}, box);
    const pts = p.heap.concat(p.rss);
    const t0 = Math.min(...pts.map(q => q[0])), t1 = Math.max(...pts.map(q => q[0]));
    const vmax = Math.max(1, ...pts.map(q => q[1]));
    const X = t => L + (W - L - 10) * (t1 > t0 ? (t - t0) / (t1 - t0) : 0);
    const Y = v => H - (H - 10) * v / vmax;
    el("line", {x1: L, y1: H, x2: W - 10, y2: H, class: "axis"}, svg);
    el("line", {x1: L, y1: 10, x2: L, y2: H, class: "axis"}, svg);
    el("text", {x: 2, y: 16}, svg, bytes(vmax));
    el("text", {x: 2, y: H}, svg, "0");
    el("text", {x: L, y: H + 15}, svg, t0.toFixed(3) + "s");
    el("text", {x: W - 60, y: H + 15}, svg, t1.toFixed(3) + "s");
    [["heap", p.heap], ["rss", p.rss]].forEach(([cls, s]) => {
      if (!s.length) return;
      let d = [], prev = null;  // steps: a value holds until the next sample
      s.forEach(q => { if (prev !== null) d.push(X(q[0]) + "," + Y(prev));
                       d.push(X(q[0]) + "," + Y(q[1])); prev = q[1]; });
      d.push(X(t1) + "," + Y(prev));
      el("polyline", {points: d.join(" "), class: cls}, svg);
    });
  });
}

function tables() {
  const box = document.getElementById("tables"), R = D.report;
  el("h2", {}, box, "Processes");
  table(box, ["pid", "parent", "name", "exit", "calls", "peak heap", "leaked", "peak RSS"],
    R.processes.map(p => [p.pid, p.ppid, p.name,
      p.exit_signal ? "signal " + p.exit_signal : p.exit_code,
      p.calls, bytes(p.peak_heap_bytes), bytes(p.leaked_bytes),
      p.peak_rss_bytes === null ? "" : bytes(p.peak_rss_bytes)]),
    [true, true, false, false, true, true, true, true]);
  el("h2", {}, box, "Hotspots (by allocating function, all processes)");
  table(box, ["function", "calls", "allocated", "at peak", "leaked", "incl. calls",
              "incl. allocated"],
    D.hotspots.map(h => [h.function, h.self_calls, bytes(h.self_bytes),
                         bytes(h.self_peak_bytes), bytes(h.self_leaked_bytes), h.incl_calls,
                         bytes(h.incl_bytes)]),
    [false, true, true, true, true, true, true]);
  const titles = {calls: "Most calls to allocation functions", peak: "Peak memory consumers",
                  leaks: "Memory leaks", temporary: "Most temporary allocations"};
  for (const k in titles) {
    el("h2", {}, box, titles[k]);
    const isBytes = k === "peak" || k === "leaks";
    table(box, ["location", "file:line", isBytes ? "bytes" : "count", "backtraces"],
      R.sections[k].map(e => [e.location, e.file ? e.file + ":" + e.line : "",
        isBytes ? bytes(e.value) : e.value, e.stacks]), [false, false, true, true]);
  }
}

totals(); metricButtons(); flame(); timeline(); tables();
window.addEventListener("resize", flame);
if (document.body.dataset.status === "loading") document.body.dataset.status = "ok";
</script>
</body></html>
"""
