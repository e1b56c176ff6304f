"""`memtrack report`: the heaptrack-style summary of a run database, as text or JSON.

Every figure comes from the run database's views (memtrack.schema.ddl): calls from
`allocations`, temporary allocations from `temporary`, peak heap from `heap_timeline`,
leaks from `leaks`, peak RSS from `rss_timeline`. Locations are allocation sites
(`stack_location`: the first frame outside the allocator).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from typing import Any, TextIO

import duckdb

from memtrack.schema import loss_lines

# Section key -> (title, SQL giving (stack_id, value) rows per allocation, value noun)
SECTIONS: dict[str, tuple[str, str, str]] = {
    "calls": ("MOST CALLS TO ALLOCATION FUNCTIONS",
              "SELECT stack_id, 1 AS v FROM allocations WHERE {pids}", "calls"),
    "peak": ("PEAK MEMORY CONSUMERS",
             "SELECT stack_id, size AS v FROM peak WHERE {pids}", "bytes"),
    "leaks": ("MEMORY LEAKS", "SELECT stack_id, size AS v FROM leaks WHERE {pids}", "bytes"),
    "temporary": ("MOST TEMPORARY ALLOCATIONS",
                  "SELECT stack_id, 1 AS v FROM temporary WHERE {pids}", "calls"),
}  # fmt: skip


@dataclass
class ReportOptions:
    pid: int | None = None
    top: int = 10  # locations per section
    backtraces: int = 3  # backtraces per location


def _pids(opts: ReportOptions) -> str:
    return "TRUE" if opts.pid is None else f"pid = {int(opts.pid)}"


def _one(con: duckdb.DuckDBPyConnection, sql: str) -> Any:
    row = con.execute(sql).fetchone()
    return row[0] if row else None


def _meta(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(con.execute("SELECT key, value FROM meta").fetchall())


def totals(con: duckdb.DuckDBPyConnection, opts: ReportOptions) -> dict[str, Any]:
    meta = _meta(con)
    pids = _pids(opts)
    start, end = int(meta.get("start_ns", 0) or 0), int(meta.get("end_ns", 0) or 0)
    if opts.pid is not None:
        span = con.execute(
            f"SELECT min(start_ts), max(exit_ts) FROM processes WHERE {pids}").fetchone()
        start = span[0] if span and span[0] is not None else start
        end = span[1] if span and span[1] is not None else end
    runtime = max(end - start, 0) / 1e9
    calls = _one(con, f"SELECT count(*) FROM allocations WHERE {pids}")
    temporary = _one(con, f"SELECT count(*) FROM temporary WHERE {pids}")
    # Peak of the heap of the selected processes together, at event granularity.
    npids = _one(con, f"SELECT count(DISTINCT pid) FROM heap_peak WHERE {pids}")
    if npids <= 1:
        peak = con.execute(
            f"SELECT peak_bytes, peak_ts FROM heap_peak WHERE {pids}").fetchone()
    else:
        peak = con.execute(f"""
            SELECT heap, ts FROM (
                SELECT ts, sum(sum(delta)) OVER (ORDER BY event_id) AS heap
                FROM heap_timeline WHERE {pids} GROUP BY event_id, ts)
            ORDER BY heap DESC, ts LIMIT 1""").fetchone()
    # RSS of the selected processes together: each update's change, summed over time.
    rss = con.execute(f"""
        SELECT total, ts FROM (
            SELECT ts, sum(sum(d)) OVER (ORDER BY ts) AS total FROM (
                SELECT ts, rss - coalesce(lag(rss) OVER (PARTITION BY pid ORDER BY ts), 0) AS d
                FROM rss_timeline WHERE {pids})
            GROUP BY ts)
        ORDER BY total DESC, ts LIMIT 1""").fetchone()
    leaked = _one(con, f"SELECT coalesce(sum(size), 0) FROM leaks WHERE {pids}")
    leaked_n = _one(con, f"SELECT count(*) FROM leaks WHERE {pids}")
    allocated = _one(con, f"SELECT coalesce(sum(size), 0) FROM allocations WHERE {pids}")

    def per_s(n: int) -> float:
        return n / runtime if runtime > 0 else 0.0

    def rel(ts: int | None) -> float | None:
        return (ts - start) / 1e9 if ts is not None else None

    return {
        "runtime_s": runtime,
        "calls": calls,
        "calls_per_s": per_s(calls),
        "allocated_bytes": int(allocated),
        "temporary": temporary,
        "temporary_per_s": per_s(temporary),
        "peak_heap_bytes": int(peak[0]) if peak and peak[0] is not None else 0,
        "peak_heap_at_s": rel(peak[1]) if peak else None,
        "peak_rss_bytes": int(rss[0]) if rss and rss[0] is not None else None,
        "peak_rss_at_s": rel(rss[1]) if rss else None,
        "leaked_bytes": int(leaked),
        "leaked_allocations": leaked_n,
    }


def processes(con: duckdb.DuckDBPyConnection, opts: ReportOptions) -> list[dict[str, Any]]:
    rows = con.execute(f"""
        SELECT p.pid, p.ppid, p.name, p.exe, p.exit_code, p.exit_signal,
               coalesce(h.peak_bytes, 0),
               (h.peak_ts::DOUBLE - (SELECT value::DOUBLE FROM meta WHERE key = 'start_ns'))
               / 1e9,
               (SELECT count(*) FROM allocations a WHERE a.pid = p.pid),
               (SELECT coalesce(sum(size), 0) FROM leaks l WHERE l.pid = p.pid),
               (SELECT max(rss) FROM rss_timeline r WHERE r.pid = p.pid)
        FROM processes p LEFT JOIN heap_peak h USING (pid)
        WHERE {_pids(opts).replace("pid", "p.pid")} ORDER BY p.start_ts, p.pid""").fetchall()
    keys = ("pid", "ppid", "name", "exe", "exit_code", "exit_signal", "peak_heap_bytes",
            "peak_heap_at_s", "calls", "leaked_bytes", "peak_rss_bytes")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def section(con: duckdb.DuckDBPyConnection, key: str, opts: ReportOptions) -> list[dict]:
    _, src, _ = SECTIONS[key]
    rows = con.execute(f"""
        WITH src AS ({src.format(pids=_pids(opts))}),
        per_stack AS (SELECT stack_id, sum(v) AS v FROM src GROUP BY stack_id),
        -- stack records whose bytes differ (locals, spilled registers) often unwind to
        -- the same frames: a backtrace is a distinct frame sequence, not a record
        paths AS (
            SELECT stack_id, hash(list(frame_id ORDER BY depth)) AS path
            FROM stack_frames WHERE stack_id IN (SELECT stack_id FROM per_stack)
            GROUP BY stack_id),
        per_path AS (
            SELECT min(s.stack_id) AS stack_id, sum(s.v) AS v
            FROM per_stack s LEFT JOIN paths p USING (stack_id)
            GROUP BY coalesce(p.path, hash(s.stack_id))),
        loc AS (
            SELECT coalesce(l.name, '[no stack]') AS location, l.file, l.line,
                   s.stack_id, s.v
            FROM per_path s LEFT JOIN stack_location l USING (stack_id))
        SELECT location, arg_max(file, v), arg_max(line, v), sum(v)::BIGINT AS total,
               list(stack_id ORDER BY v DESC, stack_id)[1:{int(opts.backtraces)}],
               list(v::BIGINT ORDER BY v DESC, stack_id)[1:{int(opts.backtraces)}],
               count(*)
        FROM loc GROUP BY location HAVING sum(v) > 0
        ORDER BY total DESC, location LIMIT {int(opts.top)}""").fetchall()
    out = []
    for location, file, line, total, sids, vals, nstacks in rows:
        bts = [{"stack_id": s, "value": v, "frames": backtrace(con, s)}
               for s, v in zip(sids, vals, strict=True)]
        out.append({"location": location, "file": file, "line": line, "value": total,
                    "stacks": nstacks, "backtraces": bts})
    return out


def backtrace(con: duckdb.DuckDBPyConnection, stack_id: int | None) -> list[dict[str, Any]]:
    """A stack's logical frames from the allocation site outward (the allocator dropped)."""
    if stack_id is None:
        return []
    rows = con.execute("""
        SELECT l.name, l.file, l.line, m.path FROM stack_lines l
        LEFT JOIN modules m USING (module_id)
        WHERE l.stack_id = ? AND l.depth > 0 ORDER BY l.position""", [stack_id]).fetchall()
    return [{"function": n, "file": f, "line": ln, "module": m} for n, f, ln, m in rows]


def report_data(con: duckdb.DuckDBPyConnection, opts: ReportOptions | None = None) -> dict:
    """Everything the report shows, as plain data (the --format json output)."""
    opts = opts or ReportOptions()
    meta = _meta(con)
    return {
        "command": json.loads(meta.get("command", "[]")),
        "artifact": meta.get("artifact"),
        "pid": opts.pid,
        "totals": totals(con, opts),
        "processes": processes(con, opts),
        "sections": {k: section(con, k, opts) for k in SECTIONS},
        "losses": {k: v for k, v in json.loads(meta.get("losses", "{}")).items() if v},
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
    for key, (title, _, noun) in SECTIONS.items():
        lines += ["", title]
        entries = data["sections"][key]
        if not entries:
            lines.append("  (none)")
        for e in entries:
            where = f" ({e['file']}:{e['line']})" if e["file"] else ""
            lines.append(f"{_value(e['value'], noun)} from {e['location']}{where}"
                         f" in {e['stacks']} backtrace{'s' if e['stacks'] != 1 else ''}")
            for bt in e["backtraces"]:
                lines.append(f"    {_value(bt['value'], noun)} from:")
                frames = bt["frames"] or [{"function": "[no stack]", "file": None}]
                for f in frames[:MAX_FRAMES]:
                    loc = f"  {f['file']}:{f['line']}" if f.get("file") else ""
                    lines.append(f"      {f['function']}{loc}")
                if len(frames) > MAX_FRAMES:
                    lines.append(f"      ... {len(frames) - MAX_FRAMES} outer frames "
                                 "(--format json has them all)")
    return "\n".join(lines) + "\n"


def report_json(data: dict) -> str:
    return json.dumps(data, indent=2, default=str)


def print_query(cur: duckdb.DuckDBPyConnection, fmt: str, out: TextIO) -> None:
    """Print a query result as an aligned table, CSV or JSON (a list of objects)."""
    names = [d[0] for d in cur.description or []]
    rows = cur.fetchall()
    if fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(names)
        w.writerows(rows)
    elif fmt == "json":
        out.write(json.dumps([dict(zip(names, r, strict=True)) for r in rows], indent=1,
                             default=str) + "\n")
    else:
        cells = [names] + [["NULL" if v is None else str(v) for v in r] for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(names))]
        for k, c in enumerate(cells):
            out.write("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()
                      + "\n")
            if k == 0:
                out.write("  ".join("-" * w for w in widths) + "\n")
        out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")
