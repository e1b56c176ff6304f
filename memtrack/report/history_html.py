"""`memtrack history --html OUT.html`: one self-contained page (no network), as the
report's page is made (memtrack.report.html): the history's data (memtrack.report.history)
embedded as JSON and drawn by the small script below (SVG, no library).

A card per series (a benchmark of a process, or a process as a whole) with four small
charts across the runs (peak heap, bytes allocated, calls, average size), the steps
marked; hovering a chart shows the run under the pointer, its labels and value;
clicking it opens that run's diff against its predecessor (`memtrack diff`'s text,
computed when the page was written, for the last MAX_DIFFS runs). The cards can be
filtered by name and sorted by name or by their largest recent change.
`#q=TEXT&sort=change` in the address sets both.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from memtrack.report.history import FIGURES, MAX_DIFFS, RECENT_RUNS, WHOLE_PROCESS, History
from memtrack.report.html import PAGE_HEAD, PAGE_SCRIPT

CHARTS = ("peak_heap_bytes", "allocated_bytes", "calls", "average_bytes")


def render(history: History) -> str:
    data = {**history.data, "charts": [
        {"key": k, "label": FIGURES[k][0], "unit": FIGURES[k][1]} for k in CHARTS],
        "labels": {k: v[0] for k, v in FIGURES.items()}, "whole_process": WHOLE_PROCESS,
        "recent_runs": RECENT_RUNS, "max_diffs": MAX_DIFFS}
    blob = json.dumps(data, default=str, separators=(",", ":")).replace("</", "<\\/")
    title = f"memtrack history: {history.data['dataset']}"
    return TEMPLATE.replace("__PAGE_HEAD__", PAGE_HEAD).replace(
        "__TITLE__", html.escape(title)).replace("__PAGE_SCRIPT__", PAGE_SCRIPT).replace(
        "__DATA__", blob)


def write_html(history: History, out: Path) -> None:
    Path(out).write_text(render(history))


TEMPLATE = r"""__PAGE_HEAD__
#filter { width: 18em; padding: 3px 6px; } #shown { color: #636; min-width: 10em; }
#summary { margin: 8px 0; color: #444; }
.series { border: 1px solid #ddd; border-radius: 4px; margin: 10px 0; padding: 6px 10px; }
.series.stepped { border-color: #c66; }
.series h2 { font-size: 14px; margin: 0 0 4px; } .series h2 small { color: #666; font-weight: 400; }
.charts { display: flex; flex-wrap: wrap; gap: 14px; }
.chart { display: block; cursor: pointer; }
.chart text { font: 11px sans-serif; fill: #444; }
.chart .line { fill: none; stroke: #36c; stroke-width: 1.5; }
.chart .pt { fill: #36c; } .chart .step { fill: #c33; }
.chart .frame { fill: #fafafa; stroke: #e4e4e4; }
.chart .cursor { stroke: #555; stroke-dasharray: 3 3; }
.steps { margin: 4px 0 0; color: #a33; font-size: 12px; }
#tip { position: fixed; background: #ffe; border: 1px solid #aa8; padding: 3px 6px;
       display: none; pointer-events: none; max-width: 50em; z-index: 3; white-space: pre; }
#diff { position: fixed; inset: 40px 60px; background: #fff; border: 1px solid #888;
        box-shadow: 0 4px 24px #0004; z-index: 4; display: none; flex-direction: column; }
#diff.open { display: flex; }
#diff .bar { display: flex; gap: 12px; padding: 8px 12px; border-bottom: 1px solid #ddd; }
#diff .bar b { flex: 1; }
#diff pre { margin: 0; padding: 10px 12px; overflow: auto; font: 12px monospace; flex: 1; }
.btn { border: 1px solid #999; background: #eee; padding: 2px 10px; cursor: pointer; }
</style></head>
<body data-status="loading">
<header><h1>__TITLE__</h1>
<input id="filter" type="search" placeholder="filter by name" autocomplete="off">
<label>sort <select id="sort"><option value="name">by name</option>
<option value="change">by largest recent change</option></select></label>
<span id="shown"></span></header>
<div id="summary"></div>
<div id="series"></div>
<div id="tip"></div>
<div id="diff"><div class="bar"><b id="diff-title"></b>
<button class="btn" id="diff-close">close</button></div><pre id="diff-text"></pre></div>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
__PAGE_SCRIPT__
function fmt(v, unit) {
  return v === null ? "not recorded" : unit === "bytes" ? bytes(v) : count(v);
}
const RUNS = D.runs, BY_RUN = {};
RUNS.forEach((r, i) => { BY_RUN[r.run] = Object.assign({i: i}, r); });
function runText(run) {
  const r = BY_RUN[run], labels = Object.entries(r.labels).map(([k, v]) => k + "=" + v);
  return "run " + run + " (" + (r.i + 1) + " of " + RUNS.length + ")" +
    (labels.length ? "\n" + labels.join("\n") : "") + "\nstarted " + r.start_time +
    (Object.keys(r.lost).length ? "\nLOST DATA: " + Object.entries(r.lost).map(
      ([k, v]) => k + " " + v).join(", ") : "");
}
const tip = document.getElementById("tip");
function showTip(e, text) {
  tip.style.display = "block"; tip.style.left = (e.clientX + 14) + "px";
  tip.style.top = (e.clientY + 14) + "px"; tip.textContent = text;
}
function hideTip() { tip.style.display = "none"; }

function openDiff(run) {
  const i = BY_RUN[run].i, text = D.diffs[run];
  document.getElementById("diff-title").textContent = i === 0 ? "run " + run
    : "memtrack diff: run " + RUNS[i - 1].run + " -> run " + run;
  document.getElementById("diff-text").textContent = text !== undefined ? text
    : i === 0 ? "the first run: no predecessor to compare with"
    : "not embedded (the page holds the last " + D.max_diffs + " runs' diffs): run\n" +
      "memtrack diff --dataset " + D.dataset + " " + RUNS[i - 1].run + " " + run;
  const box = document.getElementById("diff");
  box.classList.add("open"); box.dataset.run = run;
}
document.getElementById("diff-close").onclick = () => {
  const box = document.getElementById("diff"); box.classList.remove("open"); box.dataset.run = "";
};

const W = 280, H = 96, L = 6, R = 6, T = 18, B = 8;
function chart(parent, s, c) {
  const pts = s.points.filter(p => p[c.key] !== null);
  const svg = el("svg", {class: "chart", width: W, height: H, "data-figure": c.key}, parent);
  el("rect", {class: "frame", x: L, y: T, width: W - L - R, height: H - T - B}, svg);
  const last = pts.length ? pts[pts.length - 1][c.key] : null;
  const vs = pts.map(p => p[c.key]), lo = Math.min(...vs), hi = Math.max(...vs);
  el("text", {x: L, y: 12}, svg, c.label + ": " + fmt(last, c.unit) +
     (pts.length && lo !== hi ? " (" + fmt(lo, c.unit) + " to " + fmt(hi, c.unit) + ")" : ""));
  if (!pts.length) return svg;
  const n = Math.max(RUNS.length - 1, 1);
  const x = p => L + 4 + (W - L - R - 8) * (RUNS.length > 1 ? p.position / n : 0.5);
  const y = v => hi === lo ? T + (H - T - B) / 2
                          : H - B - 4 - (H - T - B - 8) * (v - lo) / (hi - lo);
  el("polyline", {class: "line", points: pts.map(p => x(p) + "," + y(p[c.key])).join(" ")}, svg);
  const stepped = new Set(s.steps.filter(t => t.figure === c.key).map(t => t.run));
  pts.forEach(p => el("circle", {class: stepped.has(p.run) ? "step" : "pt", cx: x(p),
                                  cy: y(p[c.key]), r: stepped.has(p.run) ? 3.5 : 1.8,
                                  "data-run": p.run}, svg));
  const cursor = el("line", {class: "cursor", x1: 0, x2: 0, y1: T, y2: H - B,
                             visibility: "hidden"}, svg);
  function nearest(e) {
    const box = svg.getBoundingClientRect(), px = e.clientX - box.left;
    let best = pts[0];
    pts.forEach(p => { if (Math.abs(x(p) - px) < Math.abs(x(best) - px)) best = p; });
    return best;
  }
  svg.addEventListener("mousemove", e => {
    const p = nearest(e), step = s.steps.find(t => t.run === p.run && t.figure === c.key);
    cursor.setAttribute("x1", x(p)); cursor.setAttribute("x2", x(p));
    cursor.setAttribute("visibility", "visible");
    showTip(e, runText(p.run) + "\n" + c.label + ": " + fmt(p[c.key], c.unit) +
            (step ? "\nSTEP since run " + step.previous : "") + "\n(click: its diff)");
  });
  svg.addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden"); hideTip();
  });
  svg.addEventListener("click", e => openDiff(nearest(e).run));
  return svg;
}

function name(s) { return (s.benchmark || D.whole_process) + " [" + s.process + "]"; }
const cards = D.series.map((s, i) => {
  const div = el("div", {class: "series" + (s.steps.length ? " stepped" : "")});
  div.dataset.name = name(s);
  const h = el("h2", {}, div, name(s) + " ");
  el("small", {}, h, s.points.length + " runs, " + s.steps.length + " step" +
     (s.steps.length === 1 ? "" : "s") + ", largest change over the last " + D.recent_runs +
     " runs " + (s.recent_change >= 1e9 ? "from 0" : (100 * s.recent_change).toFixed(1) + "%"));
  const box = el("div", {class: "charts"}, div);
  D.charts.forEach(c => chart(box, s, c));
  if (s.steps.length) {
    const runs = [...new Set(s.steps.map(t => t.run))];
    el("div", {class: "steps"}, div, "stepped at " + runs.map(r => {
      const figs = s.steps.filter(t => t.run === r).map(t => D.labels[t.figure]);
      return "run " + r + " (" + figs.join(", ") + ")";
    }).join("; "));
  }
  return {s: s, div: div, i: i};
});

const hashArg = k => (location.hash.match(new RegExp("[#&]" + k + "=([^&]*)")) || [])[1];
const filter = document.getElementById("filter"), sort = document.getElementById("sort");
filter.value = decodeURIComponent(hashArg("q") || "");
sort.value = hashArg("sort") === "change" ? "change" : "name";
function show() {
  const q = filter.value.toLowerCase(), box = document.getElementById("series");
  const order = cards.slice();
  if (sort.value === "change")
    order.sort((a, b) => b.s.recent_change - a.s.recent_change || a.i - b.i);
  let n = 0;
  order.forEach(c => {
    const hit = q === "" || name(c.s).toLowerCase().includes(q);
    c.div.style.display = hit ? "" : "none"; n += hit;
    box.appendChild(c.div);
  });
  document.getElementById("shown").textContent = n + " of " + cards.length + " series";
}
filter.addEventListener("input", show);
sort.addEventListener("change", show);
const by = D.order_by ? "label " + D.order_by : "start time";
document.getElementById("summary").textContent = RUNS.length + " runs by " + by + ", " +
  D.series.length + " series, " + D.steps.length + " steps (red); latest run " +
  (D.latest.run || "none") + ": " +
  (D.latest.steps.length ? D.latest.steps.length + " steps" : "no step") +
  ". A step: any change of " + D.exact.map(k => D.labels[k]).join(", ") +
  "; of the others beyond " + D.tolerance_pct + "%. Click a chart for that run's diff.";
show();
document.body.dataset.status = "ok";
</script>
</body></html>
"""
