"""`memtrack history --dataset DIR`: every benchmark across the runs of a dataset, as
plain data (the JSON output) rendered as text or markdown, with the steps found.

A series is one benchmark (a region name) of one process name, or a process name as a
whole (benchmark None): per run, its figures (FIGURES) as the reports give them,
computed for every run at once over the dataset's tables (FIGURES_SQL: the run
database's views, keyed by run). The processes of one name and the instances of one
region name are taken together as `diff` takes them: calls, bytes and leaks summed,
peaks at their maximum. The runs are ordered by a label (`order_by`: numerically when
every value is a number, else as text) or by their start, then by run id.

A step: a figure of a series that changed from the series' previous point (the run
before it that has the series): any change of an exact figure (calls, bytes allocated,
their average, leaked: a deterministic benchmark repeats them exactly), a change
beyond `tolerance` percent of a noisy one (peak heap, peak RSS: they follow the
threads' interleaving, the allocator's and the kernel's choices). Each step is named by
the run that introduced it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from memtrack.report.diff import MD_LIMIT, data_lost, md, signed, value
from memtrack.schema.ddl import LEAKED, connect, sql_literal

Data = dict[str, Any]

# A series' figures: key -> (label, unit, exact). Exact figures step on any change,
# the others beyond the tolerance.
FIGURES = {
    "calls": ("calls", "calls", True),
    "allocated_bytes": ("bytes allocated", "bytes", True),
    "average_bytes": ("average size", "bytes", True),
    "leaked_bytes": ("leaked", "bytes", True),
    "peak_heap_bytes": ("peak heap", "bytes", False),
    "peak_rss_bytes": ("peak RSS", "bytes", False),
}  # fmt: skip
DEFAULT_TOLERANCE = 5.0  # percent, for the noisy figures
EXIT_STEPPED = 1  # --fail-on-step: the latest run stepped
EXIT_NOT_COMPARABLE = 3  # --fail-on-step: the latest run or the one before lost data
RECENT_RUNS = 5  # "largest recent change": over the last runs of the history
WHOLE_PROCESS = "(whole process)"  # a process name's series without a benchmark
RUNS_PER_SESSION = 50  # runs whose figures one session computes (it holds their rss rows)
MAX_DIFFS = 200  # the page embeds the diffs of the last runs (each against its predecessor)

# The tables the figures come from (a session over the dataset's runs: open_dataset).
TABLES = ("meta", "processes", "allocations", "heap_peak", "rss", "regions",
          "region_allocations", "region_peak")

# Every run's series in one pass over the dataset's tables, each figure as the run
# database's views give it (memtrack.schema.ddl: stack_costs, heap_peak, rss_timeline,
# region_metrics), keyed by run too: per process name, its processes together; per
# (process name, region name), the instances together. `rss_rows`: the rss table in its
# files' order (rss_timeline orders one time's updates by it).
FIGURES_SQL = """
    CREATE TABLE figures AS
    WITH RECURSIVE ancestors(run, region_id, ancestor_id) AS (
        SELECT run, region_id, region_id FROM regions
        UNION ALL
        SELECT a.run, a.region_id, r.parent_id FROM ancestors a
        JOIN regions r ON r.run = a.run AND r.region_id = a.ancestor_id
        WHERE r.parent_id IS NOT NULL),
    bounds AS (
        SELECT run, pid, tid, begin_event_id AS event_id, begin_ts AS ts, region_id
        FROM regions
        UNION ALL
        SELECT run, pid, tid, end_event_id, min(end_ts), arg_min(coalesce(parent_id, 0), depth)
        FROM regions WHERE end_event_id IS NOT NULL GROUP BY run, pid, tid, end_event_id),
    recorded AS (  -- RunReader.rss_recorded: not with capture --rss off
        SELECT run, coalesce(json_extract_string(value, '$.rss') <> 'false', TRUE) AS rss
        FROM meta WHERE key = 'options'),
    w AS (
        SELECT run, pid, ts, rowid AS r,
            last_value(CASE WHEN member = 'file' THEN bytes END IGNORE NULLS)
                OVER (PARTITION BY run, pid ORDER BY ts, rowid ROWS UNBOUNDED PRECEDING) AS file,
            last_value(CASE WHEN member = 'anon' THEN bytes END IGNORE NULLS)
                OVER (PARTITION BY run, pid ORDER BY ts, rowid ROWS UNBOUNDED PRECEDING) AS anon,
            last_value(CASE WHEN member = 'shmem' THEN bytes END IGNORE NULLS)
                OVER (PARTITION BY run, pid ORDER BY ts, rowid ROWS UNBOUNDED PRECEDING) AS shmem
        FROM rss_rows),
    t AS MATERIALIZED (
        SELECT run, pid, ts, coalesce(file, 0) + coalesce(anon, 0) + coalesce(shmem, 0) AS rss
        FROM w QUALIFY row_number() OVER (PARTITION BY run, pid, ts ORDER BY r DESC) = 1),
    p AS (SELECT run, pid, coalesce(name, '?') AS process FROM processes),
    c AS (
        SELECT run, pid, count(*) FILTER (WHERE inherited_from IS NULL) AS calls,
               coalesce(sum(size) FILTER (WHERE inherited_from IS NULL), 0) AS bytes,
               coalesce(sum(size) FILTER (WHERE {leaked}), 0) AS leaked
        FROM allocations GROUP BY run, pid),
    pr AS (SELECT run, pid, max(rss) AS rss FROM t GROUP BY run, pid),
    rc AS (
        SELECT ra.run, ra.region_id, count(*) AS calls, sum(a.size) AS bytes,
               coalesce(sum(a.size) FILTER (WHERE {leaked}), 0) AS leaked
        FROM region_allocations ra JOIN allocations a
            ON a.run = ra.run AND a.alloc_id = ra.alloc_id
        GROUP BY ra.run, ra.region_id),
    rss_begin AS (
        SELECT r.run, r.region_id, t.rss FROM regions r ASOF JOIN t
        ON t.run = r.run AND t.pid = r.pid AND t.ts <= r.begin_ts),
    seen AS (
        SELECT th.tid, t.* FROM (SELECT DISTINCT run, pid, tid FROM regions) th
        JOIN t USING (run, pid)),
    rss_inner AS (
        SELECT b.run, b.region_id, max(s.rss) AS rss FROM seen s ASOF JOIN bounds b
        ON s.run = b.run AND s.pid = b.pid AND s.tid = b.tid AND s.ts > b.ts
        WHERE b.region_id <> 0 GROUP BY 1, 2),
    rss_in AS (
        SELECT a.run, a.ancestor_id AS region_id, max(i.rss) AS rss
        FROM rss_inner i JOIN ancestors a USING (run, region_id) GROUP BY 1, 2),
    rm AS (
        SELECT r.run, r.pid, r.name, coalesce(rc.calls, 0) AS calls,
               coalesce(rc.bytes, 0) AS bytes, coalesce(rc.leaked, 0) AS leaked,
               coalesce(k.peak_bytes, 0) AS peak,
               CASE WHEN b.rss IS NOT NULL OR i.rss IS NOT NULL
                    THEN greatest(coalesce(b.rss, 0), coalesce(i.rss, 0)) END AS rss
        FROM regions r LEFT JOIN rc USING (run, region_id)
        LEFT JOIN region_peak k USING (run, region_id)
        LEFT JOIN rss_begin b USING (run, region_id) LEFT JOIN rss_in i USING (run, region_id)),
    s AS (
        SELECT p.run, p.process, NULL::VARCHAR AS benchmark, count(*) AS instances,
               coalesce(sum(c.calls), 0) AS calls, coalesce(sum(c.bytes), 0) AS bytes,
               coalesce(sum(c.leaked), 0) AS leaked, coalesce(max(h.peak_bytes), 0) AS peak,
               max(pr.rss) AS rss
        FROM p LEFT JOIN c USING (run, pid) LEFT JOIN heap_peak h USING (run, pid)
        LEFT JOIN pr USING (run, pid) GROUP BY p.run, p.process
        UNION ALL
        SELECT p.run, p.process, rm.name, count(*), sum(rm.calls), sum(rm.bytes),
               sum(rm.leaked), max(rm.peak), max(rm.rss)
        FROM rm JOIN p USING (run, pid) GROUP BY p.run, p.process, rm.name)
    SELECT s.run, process, benchmark, instances::BIGINT AS instances, calls::BIGINT AS calls,
           bytes::BIGINT AS allocated_bytes,
           CASE WHEN calls > 0 THEN bytes / calls ELSE 0 END::DOUBLE AS average_bytes,
           leaked::BIGINT AS leaked_bytes, peak::BIGINT AS peak_heap_bytes,
           CASE WHEN coalesce(recorded.rss, TRUE) THEN s.rss END::BIGINT AS peak_rss_bytes
    FROM s LEFT JOIN recorded USING (run)
    WHERE s.run IN (SELECT run FROM run_order)""".replace("{leaked}", LEAKED)

# The runs in order: by the label (numerically if every run's value is a number), then
# by start and id. `position` counts from 0.
ORDER_SQL = """
    WITH r AS (SELECT run, labels, start_time, {key} AS key FROM runs),
    n AS (SELECT *, bool_and(try_cast(key AS DOUBLE) IS NOT NULL) OVER () AS numeric FROM r)
    SELECT run, labels, start_time, key,
           (row_number() OVER (ORDER BY CASE WHEN numeric THEN try_cast(key AS DOUBLE) END,
                                        key, start_time, run) - 1)::INTEGER AS position
    FROM n ORDER BY position"""

# Each figure of each series against the series' previous point, with whether it
# stepped; `change` the relative change (NULL from 0 to anything).
STEPS_SQL = """
    CREATE TABLE points AS
    WITH long AS (
        UNPIVOT (SELECT process, benchmark, run, o.position, {doubles}
                 FROM figures f JOIN run_order o USING (run))
        ON {figures} INTO NAME figure VALUE value),
    l AS (
        SELECT process, benchmark, figure, run, position, value,
               lag(run) OVER w AS previous, lag(value) OVER w AS before
        FROM long WINDOW w AS (PARTITION BY process, benchmark, figure ORDER BY position))
    SELECT l.*, CASE WHEN before <> 0 THEN (value - before) / abs(before)
                     WHEN value = before THEN 0.0 END AS change,
           before IS NOT NULL AND CASE WHEN figure IN ({exact}) THEN value <> before
                ELSE abs(value - before) > {tolerance} / 100.0 * abs(before) END AS stepped
    FROM l"""


class HistoryError(Exception):
    """A history that cannot be made (one line)."""


@dataclass
class HistoryOptions:
    order_by: str | None = None  # a label; None: the runs' start
    tolerance: float = DEFAULT_TOLERANCE  # percent, for the noisy figures
    last: int | None = None  # only the last runs in order
    diffs: bool = False  # the diff of each run against its predecessor (the HTML page)


@dataclass
class History:
    data: Data = field(default_factory=dict)

    @property
    def stepped(self) -> bool:
        return bool(self.data["latest"]["steps"])

    @property
    def comparable(self) -> bool:
        """Whether the latest run and the one before it lost no data (as `diff` asks)."""
        return not any(r["lost"] for r in self.data["runs"][-2:])


def run_order(con: Any, order_by: str | None) -> list[Data]:
    """The runs of a dataset session (`runs`) in order (ORDER_SQL)."""
    key = "NULL::VARCHAR" if order_by is None else f"labels[{sql_literal(order_by)}]"
    rows = con.execute(ORDER_SQL.format(key=key)).fetchall()
    out = [{"run": r, "labels": dict(labels or {}), "start_time": start, "order": k,
            "position": pos} for r, labels, start, k, pos in rows]
    if order_by is not None:
        missing = [r["run"] for r in out if r["order"] is None]
        if missing:
            more = ", ..." if len(missing) > 3 else ""
            raise HistoryError(
                f"--order-by {order_by}: {len(missing)} run{'s' if len(missing) > 1 else ''} "
                f"without that label ({', '.join(missing[:3])}{more})")
    return out


def run_diff(base: str, base_con: Any, head: str, head_con: Any) -> str:
    """`memtrack diff --dataset DIR BASE HEAD`'s text (memtrack.report.diff)."""
    from memtrack.report.diff import Side, diff_data
    from memtrack.report.diff import format_text as diff_text
    from memtrack.report.reader import RunReader

    return diff_text(diff_data(Side(f"run {base}", RunReader(base_con)),
                               Side(f"run {head}", RunReader(head_con))))


def run_diffs(root: str | Path, runs: list[str]) -> dict[str, str]:
    """Each run's diff against the run before it (the first has none), for the last
    MAX_DIFFS runs: each run opened once (open_dataset_run), its session kept for the
    next run's diff."""
    from memtrack.schema.dataset import open_dataset_run

    runs = runs[-MAX_DIFFS - 1:]
    out: dict[str, str] = {}
    previous = None  # (run id, its session)
    try:
        for run in runs:
            con = open_dataset_run(root, run)
            try:
                if previous is not None:
                    out[run] = run_diff(*previous, run, con)
            except BaseException:
                con.close()
                raise
            if previous is not None:
                previous[1].close()
            previous = (run, con)
    finally:
        if previous is not None:
            previous[1].close()
    return out


def losses(text: str | None) -> dict[str, int]:
    """A run's lost data (meta `losses`), as `diff` judges whether runs compare."""
    try:
        return data_lost(json.loads(text or "{}"))
    except ValueError:
        return {}


def history_data(root: str | Path, opts: HistoryOptions) -> History:
    """The history of the dataset at `root` (DatasetError, HistoryError, duckdb.Error)."""
    from memtrack.schema.dataset import RUNS_TABLE, open_dataset

    con = open_dataset(root, tables=(RUNS_TABLE,))
    try:
        order = run_order(con, opts.order_by)
    finally:
        con.close()
    if opts.last is not None:
        order = order[-opts.last:]
        for i, r in enumerate(order):
            r["position"] = i
    runs = pa.table({"run": [r["run"] for r in order],
                     "position": pa.array([r["position"] for r in order], pa.int32())})
    figures, lost = [], {}
    for i in range(0, max(len(order), 1), RUNS_PER_SESSION):
        con = open_dataset(root, tables=TABLES, runs=[r["run"] for r in order][
            i:i + RUNS_PER_SESSION])
        try:
            con.register("run_order", runs)
            con.execute("CREATE TABLE rss_rows AS SELECT * FROM rss")  # in the files' order
            con.execute(FIGURES_SQL)
            figures.append(con.execute("SELECT * FROM figures").to_arrow_table())
            lost.update(con.execute(
                "SELECT run, value FROM meta WHERE key = 'losses'").fetchall())
        finally:
            con.close()
    con = connect()
    try:
        con.register("run_order", runs)
        con.register("figures", pa.concat_tables(figures))
        exact = ", ".join(f"'{k}'" for k, (_, _, e) in FIGURES.items() if e)
        con.execute(STEPS_SQL.format(figures=", ".join(FIGURES), exact=exact,
                                     doubles=", ".join(f"{k}::DOUBLE AS {k}" for k in FIGURES),
                                     tolerance=float(opts.tolerance)))
        series = _series(con, len(order))
    finally:
        con.close()
    latest = order[-1]["run"] if order else None
    steps = [s for ser in series for s in ser["steps"]]
    steps.sort(key=lambda s: (s["position"], s["process"], s["benchmark"] or "",
                              list(FIGURES).index(s["figure"])))
    data: Data = {
        "dataset": str(root), "order_by": opts.order_by, "tolerance_pct": opts.tolerance,
        "exact": [k for k, (_, _, e) in FIGURES.items() if e],
        "runs": [{**{k: r[k] for k in ("run", "labels", "start_time", "order")},
                  "lost": losses(lost.get(r["run"]))} for r in order],
        "series": series, "steps": steps,
        "latest": {"run": latest, "steps": [s for s in steps if s["run"] == latest]},
    }
    if opts.diffs:
        data["diffs"] = run_diffs(root, [r["run"] for r in order])
    return History(data)


def _series(con: Any, runs: int) -> list[Data]:
    """Every series with its points (in run order) and its steps."""
    recent = max(runs - RECENT_RUNS, 0)
    rows = con.execute(f"""
        SELECT process, benchmark, list(run ORDER BY position), list(position ORDER BY position),
               list(instances ORDER BY position),
               {", ".join(f"list({k} ORDER BY position)" for k in FIGURES)}
        FROM figures f JOIN run_order o USING (run)
        GROUP BY process, benchmark ORDER BY process, benchmark NULLS FIRST""").fetchall()
    steps: dict[tuple[str, str | None], list[Data]] = {}
    for proc, bench, fig, run, pos, prev, before, after, change in con.execute("""
            SELECT process, benchmark, figure, run, position, previous, before, value, change
            FROM points WHERE stepped ORDER BY process, benchmark, position"""
                                                                            ).fetchall():
        unit_int = fig != "average_bytes"
        b, a = (int(before), int(after)) if unit_int else (before, after)
        steps.setdefault((proc, bench), []).append({
            "run": run, "position": pos, "previous": prev, "process": proc,
            "benchmark": bench, "figure": fig, "before": b, "after": a, "delta": a - b,
            "relative": change})
    # the largest relative change of any figure over the last RECENT_RUNS runs
    biggest = {(p, b): c for p, b, c in con.execute(f"""
        SELECT process, benchmark, max(abs(coalesce(change, 1e9))) FROM points
        WHERE position >= {recent} AND before IS NOT NULL GROUP BY process, benchmark"""
                                                    ).fetchall()}
    out = []
    for proc, bench, run_ids, positions, instances, *values in rows:
        points = [{"run": r, "position": p, "instances": n,
                   **{k: values[i][j] for i, k in enumerate(FIGURES)}}
                  for j, (r, p, n) in enumerate(zip(run_ids, positions, instances, strict=True))]
        mine = sorted(steps.get((proc, bench), []),
                      key=lambda t: (t["position"], list(FIGURES).index(t["figure"])))
        out.append({"process": proc, "benchmark": bench, "points": points, "steps": mine,
                    "recent_change": biggest.get((proc, bench), 0.0)})
    return out


# ---- rendering ------------------------------------------------------------------------
def figure_value(v: float | int | None, key: str) -> str:
    if key == "average_bytes" and v is not None and v < 1024 and v != int(v):
        return f"{v:.1f} B"  # human_bytes' figure for a fraction of a byte
    if key == "average_bytes" and v is not None:
        return value(round(v) if v < 1024 else v, "bytes")
    return value(v, FIGURES[key][1])


def series_name(s: Data) -> str:
    return f"{s['benchmark'] or WHOLE_PROCESS} [{s['process']}]"


def run_name(runs: dict[str, Data], run: str, order_by: str | None) -> str:
    """`r12 (commit_time=1012)`: a run and the label it is ordered by (or its labels)."""
    labels = runs[run]["labels"]
    shown = {order_by: labels.get(order_by)} if order_by else labels
    text = " ".join(f"{k}={v}" for k, v in shown.items())
    return f"{run} ({text})" if text else run


def step_text(s: Data) -> str:
    label, unit, _ = FIGURES[s["figure"]]
    rel = "new" if s["relative"] is None else f"{s['relative'] * 100:+.1f}%"
    if s["figure"] == "average_bytes":
        delta = ("+" if s["delta"] > 0 else "-") + figure_value(abs(s["delta"]), s["figure"])
    else:
        delta = signed(s["delta"], unit)
    return (f"{label} {figure_value(s['before'], s['figure'])} -> "
            f"{figure_value(s['after'], s['figure'])} ({delta}, {rel})")


def _head(d: Data) -> str:
    runs = d["runs"]
    by = f"label {d['order_by']}" if d["order_by"] else "start time"
    span = f" ({runs[0]['run']} ... {runs[-1]['run']})" if runs else ""
    n = len(d["steps"])
    return (f"{d['dataset']}: {len(runs)} runs by {by}{span}, {len(d['series'])} series, "
            f"{n} step{'s' if n != 1 else ''}")


def _rule(d: Data) -> str:
    noisy = [FIGURES[k][0] for k in FIGURES if k not in d["exact"]]
    return (f"a step: any change of {', '.join(FIGURES[k][0] for k in d['exact'])}; "
            f"a change beyond {d['tolerance_pct']:g}% of {', '.join(noisy)}")


def _latest_row(s: Data) -> list[str]:
    last = s["points"][-1]
    return [s["benchmark"] or WHOLE_PROCESS, s["process"], str(len(s["points"])),
            *(figure_value(last[k], k) for k in FIGURES), str(len(s["steps"]))]


HEAD = ["benchmark", "process", "runs", *(v[0] for v in FIGURES.values()), "steps"]


def format_text(h: History) -> str:
    d = h.data
    runs = {r["run"]: r for r in d["runs"]}
    lines = [_head(d), _rule(d), "", "SERIES (latest figures)"]
    rows = [HEAD, *(_latest_row(s) for s in d["series"])]
    w = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    lines += ["  ".join(c.ljust(n) if i < 2 else c.rjust(n)
                        for i, (c, n) in enumerate(zip(r, w, strict=True))).rstrip()
              for r in rows]
    lines += ["", "STEPS" if d["steps"] else "STEPS: none"]
    for s in d["steps"]:
        lines.append(f"{run_name(runs, s['run'], d['order_by'])}: {series_name(s)} "
                     f"{step_text(s)} since {s['previous']}")
    lines += lost_lines(d)
    latest = d["latest"]
    if latest["run"] is not None:
        n = len(latest["steps"])
        lines += ["", f"latest run {run_name(runs, latest['run'], d['order_by'])}: "
                  + (f"{n} step{'s' if n != 1 else ''}" if n else "no step")]
    return "\n".join(lines) + "\n"


def lost_lines(d: Data) -> list[str]:
    """A line per run that lost data: its figures fall short of what ran."""
    lost = [r for r in d["runs"] if r["lost"]]
    if not lost:
        return []
    return ["", "RUNS THAT LOST DATA (their figures fall short of what ran)"] + [
        f"{r['run']}: " + ", ".join(f"{k} {v}" for k, v in r["lost"].items()) for r in lost]


def format_markdown(h: History) -> str:
    d = h.data
    runs = {r["run"]: r for r in d["runs"]}
    latest = d["latest"]
    lines = ["### memtrack history", "", _head(d) + ".  ", _rule(d) + "."]
    if latest["run"] is not None:
        mark = ":x:" if latest["steps"] else ":white_check_mark:"
        lines += ["", f"{mark} latest run {md(run_name(runs, latest['run'], d['order_by']))}: "
                  + (f"{len(latest['steps'])} step(s)" if latest["steps"] else "no step")]
    lines += [f":warning: {md(ln)}  " for ln in lost_lines(d)[2:]]
    if d["steps"]:
        lines += ["", "| run | benchmark | process | step | since |",
                  "|:--|:--|:--|:--|:--|"]
        lines += [f"| {md(run_name(runs, s['run'], d['order_by']))} | "
                  f"{md(s['benchmark'] or WHOLE_PROCESS)} | {md(s['process'])} | "
                  f"{step_text(s)} | {md(s['previous'])} |" for s in d["steps"]]
    lines += ["", "| " + " | ".join(HEAD) + " |",
              "|:--|:--|" + "--:|" * (len(HEAD) - 2)]
    lines += ["| " + " | ".join([md(r[0]), md(r[1]), *r[2:]]) + " |"
              for r in (_latest_row(s) for s in d["series"])]
    text = "\n".join(lines) + "\n"
    if len(text) > MD_LIMIT:  # a pull-request comment holds 65536 characters
        text = text[:text.rfind("\n", 0, MD_LIMIT)] + \
            "\n\n(cut to fit a comment: --format text has it all)\n"
    return text


def format_json(h: History) -> str:
    return json.dumps(h.data, indent=1, default=str) + "\n"
