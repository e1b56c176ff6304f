"""One reader of a run database for every report and export: named queries over the
run database's views (memtrack.schema.ddl), optionally for one process.

The per-stack costs come from the `stack_costs` view and the backtraces from the
`backtraces` table (a backtrace: a stack's frames from its allocation site outward, the
allocator itself left out where it has callers; stacks whose frames are at the same
locations are one backtrace). Text, JSON, HTML, folded, pprof and speedscope all read
what this gives, and `memtrack diff` matches the sites of two runs by LOCATION.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa

from memtrack.schema.ddl import NO_CALLER, NO_STACK, SITE_DEPTH

__all__ = ["COUNTED", "LOCATION", "METRICS", "NO_CALLER", "NO_STACK", "TRUNCATED", "RunReader"]

# A metric per allocation, as a column of stack_costs: the report's sections and the
# exports' --metric name them the same.
METRICS = {
    "allocated": "bytes",  # bytes allocated
    "calls": "calls",  # calls to allocation functions
    "peak": "peak_bytes",  # bytes alive at the process's heap peak
    "leaked": "leaked_bytes",  # bytes never freed
    "temporary": "temporary",  # allocations freed by their thread's next allocator event
}
# The allocations a metric counts (its value may be 0 for some, as malloc(0)'s bytes).
COUNTED = {"allocated": "calls", "calls": "calls", "peak": "peak_calls",
           "leaked": "leaked_calls", "temporary": "temporary"}
UNITS = {"allocated": "bytes", "calls": "calls", "peak": "bytes", "leaked": "bytes",
         "temporary": "calls"}

# A *location*, heaptrack's granularity: a function at one source line (the frame's
# name, file and line; an unsymbolized frame's name is its module and address). An
# allocation's *site* is the location of its backtrace's first frame (the view
# stack_location); the report groups allocations by site, the backtraces under a site
# are merged where all their frames are at the same locations (the `backtraces`
# table), and two runs' sites are matched by it.
LOCATION = ("location", "file", "line")

# A stack cut short: unwinding needed bytes beyond its copy (stacks.truncated, stop
# 'truncated') and the kernel's frame-pointer chain did not reach the outermost frame
# either (not complete). Its outermost frame is no root: every report and export
# shows TRUNCATED past it.
TRUNCATED = "[truncated]"
CUT_SQL = "(NOT s.complete AND (s.truncated OR s.stop = 'truncated'))"
TITLE_CHARS = 80


class Level(NamedTuple):
    """One logical frame: an inline level of a code location."""

    name: str
    file: str | None
    line: int | None
    module_id: int | None = None
    vaddr: int | None = None  # ELF address in the module (null: not normalized)
    reason: str | None = None  # why it is unsymbolized (null: found)
    symbol: str | None = None  # the ELF symbol (raw) holding the location


NO_STACK_LEVEL = Level(NO_STACK, None, None)
TRUNCATED_LEVEL = Level(TRUNCATED, None, None)


@dataclass
class Backtrace:
    """A backtrace as its representative stack unwound it."""

    frames: tuple[int, ...]  # frame ids from the allocation site outward
    addresses: tuple[int, ...]  # their runtime addresses (return addresses past the site)
    pid: int  # the process whose stack was unwound (the addresses are in its space)
    cut: bool  # the stack was cut short (TRUNCATED past its last frame)


@dataclass
class Cost:
    """Every metric of one (backtrace, process); backtrace None: no stack captured."""

    backtrace: int | None  # backtrace_id
    pid: int
    calls: int
    allocated: int
    temporary: int
    peak_calls: int
    peak: int
    leaked_calls: int
    leaked: int

    def value(self, metric: str) -> int:
        return int(getattr(self, metric))


@dataclass
class Module:
    path: str
    build_id: str | None


@dataclass
class Costs:
    """The costs of a run per (backtrace, pid), and what names their frames."""

    rows: list[Cost]
    backtraces: dict[int, Backtrace]
    frames: dict[int, list[Level]]  # frame_id -> inline levels, innermost first
    processes: dict[int, str]  # pid -> name
    modules: dict[int, Module]

    def levels(self, backtrace: int | None) -> list[Level]:
        """Logical frames from the allocation site outward, TRUNCATED last where the
        stack was cut short."""
        if backtrace is None or backtrace not in self.backtraces:
            return [NO_STACK_LEVEL]
        bt = self.backtraces[backtrace]
        out = [lv for f in bt.frames for lv in self.frames.get(f, ())]
        if bt.cut:
            out.append(TRUNCATED_LEVEL)
        return out or [NO_STACK_LEVEL]

    def names(self, backtrace: int | None) -> list[str]:
        return [lv.name for lv in self.levels(backtrace)]

    def root(self, pid: int, pids: bool = True) -> str:
        """The name a process's stacks hang from: `name (pid)`, its name alone without
        `pids` (so that the stacks of two runs, or of processes of one name, match)."""
        name = self.processes.get(pid, "?")
        return f"{name} ({pid})" if pids else name


class RunReader:
    """Named queries over a run database, for every process, one (`pid`) or several
    (a tuple of pids: the processes `pids_named` a name, say)."""

    def __init__(self, con: duckdb.DuckDBPyConnection,
                 pid: int | tuple[int, ...] | None = None) -> None:
        self.con = con
        self.pid = pid

    def where(self, alias: str = "") -> str:
        """The SQL predicate selecting the reader's processes."""
        if self.pid is None:
            return "TRUE"
        pids = (self.pid,) if isinstance(self.pid, int) else self.pid
        return f"{alias}pid IN ({', '.join(str(int(p)) for p in pids) or 'NULL'})"

    def one(self, sql: str, params: list[Any] | None = None) -> Any:
        row = self.con.execute(sql, params or []).fetchone()
        return row[0] if row else None

    @functools.cached_property
    def meta(self) -> dict[str, str]:
        return dict(self.con.execute("SELECT key, value FROM meta").fetchall())

    @functools.cached_property
    def rss_recorded(self) -> bool:
        """Whether capture recorded resident memory (not with --rss off: its rss rows are
        then only the zeros of execs and exits, no figure)."""
        options = json.loads(self.meta.get("options") or "{}")
        return not isinstance(options, dict) or options.get("rss", True) is not False

    @property
    def start_ns(self) -> int:
        return int(self.meta.get("start_ns", 0) or 0)

    @property
    def command(self) -> list[str]:
        return json.loads(self.meta.get("command", "[]"))

    @property
    def attached(self) -> list[str]:
        """`capture --pid`: "attached to PID at TIME: ..." per process attached to."""
        try:
            procs = json.loads(self.meta.get("attached", "[]"))
            offset = int(self.meta.get("wall_offset_ns", 0) or 0)
            at = [(int(a["pid"]), time.localtime((int(a["ts"]) + offset) / 1e9)) for a in procs]
            return [f"attached to {pid} at {time.strftime('%Y-%m-%d %H:%M:%S', t)}: blocks "
                    "allocated before are not known" for pid, t in at]
        except (ValueError, TypeError, KeyError, OverflowError, OSError):
            return ["attached to a running process: blocks allocated before are not known"]

    @property
    def labels(self) -> dict[str, str]:
        """What `process --label key=value` said of the run (a commit, a build...)."""
        return json.loads(self.meta.get("labels", "{}"))

    @functools.cached_property
    def program_start_ns(self) -> int:
        """The run's time zero: the end of its root's first attach stop, its first
        instruction after exec with memtrack attached (capture's own start and that stop
        are memtrack's time, not the program's); capture's start where no stop was
        recorded (an artifact before format 2.3)."""
        row = self.con.execute(
            "SELECT arg_min(end_ts, begin_ts) FROM stops WHERE pid = ? AND reason = 'attach'",
            [int(self.meta.get("root_pid", 0) or 0)]).fetchone()
        return int(row[0]) if row and row[0] is not None else self.start_ns

    def stopped(self, since_ns: int) -> dict[str, dict[str, float]]:
        """The stops of the selected processes that began at or after `since_ns`, by
        reason: how many and how long in all (seconds)."""
        return {r: {"count": int(n), "seconds": int(ns) / 1e9} for r, n, ns in self.con.execute(
            f"""SELECT reason::VARCHAR, count(*), sum(end_ts - begin_ts) FROM stops
                WHERE {self.where()} AND begin_ts >= ? GROUP BY ALL ORDER BY 1""",
            [since_ns]).fetchall()}

    @property
    def losses(self) -> dict[str, int]:
        """The capture's non-zero loss and fidelity counters (its manifest's losses)."""
        losses = _json(self.meta.get("losses"), {})
        return {k: v for k, v in losses.items() if isinstance(v, int) and v} \
            if isinstance(losses, dict) else {}

    @property
    def probes_refused(self) -> list[dict[str, str]]:
        """The allocator functions the kernel refused to probe ({path, function, why}):
        their calls are missing from the run."""
        refused = _json(self.meta.get("probes_refused"), [])
        return [{k: str(r.get(k, "")) for k in ("path", "function", "why")}
                for r in (refused if isinstance(refused, list) else []) if isinstance(r, dict)]

    @property
    def title(self) -> str:
        """The run's name in one short line: its command, the first line of it, at most
        TITLE_CHARS characters."""
        words = " ".join(self.command).strip()
        first = words.splitlines()[0] if words else "memtrack"
        if len(first) > TITLE_CHARS or first != words:
            first = first[:TITLE_CHARS - 1].rstrip() + "…"
        return first

    def has_process(self) -> bool:
        return bool(self.one(f"SELECT count(*) FROM processes WHERE {self.where()}"))

    def pids_named(self, name: str) -> tuple[int, ...]:
        """The pids of the processes called `name` (comm), in start order."""
        return tuple(p for (p,) in self.con.execute(
            "SELECT pid FROM processes WHERE name = ? ORDER BY start_ts, pid", [name]
        ).fetchall())

    # ---- totals ------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        pids = self.where()
        start, end = self.program_start_ns, int(self.meta.get("end_ns", 0) or 0)
        if self.pid is not None:
            span = self.con.execute(
                f"SELECT min(start_ts), max(exit_ts) FROM processes WHERE {pids}").fetchone()
            start = span[0] if span and span[0] is not None else start
            end = span[1] if span and span[1] is not None else end
        runtime = max(end - start, 0) / 1e9
        sums = self.con.execute(f"""
            SELECT coalesce(sum(calls), 0), coalesce(sum(bytes), 0),
                   coalesce(sum(temporary), 0), coalesce(sum(leaked_calls), 0),
                   coalesce(sum(leaked_bytes), 0)
            FROM stack_costs WHERE {pids}""").fetchone()
        calls, allocated, temporary, leaked_n, leaked = (int(v) for v in sums)  # type: ignore[union-attr]
        # Peak of the heap of the selected processes together, at event granularity.
        npids = self.one(f"SELECT count(DISTINCT pid) FROM heap_peak WHERE {pids}")
        if npids <= 1:
            peak = self.con.execute(
                f"SELECT peak_bytes, peak_ts FROM heap_peak WHERE {pids}").fetchone()
        else:
            peak = self.con.execute(f"""
                SELECT heap, ts FROM (
                    SELECT ts, sum(sum(delta)) OVER (ORDER BY event_id) AS heap
                    FROM heap_timeline WHERE {pids} GROUP BY event_id, ts)
                ORDER BY heap DESC, ts LIMIT 1""").fetchone()
        # RSS of the selected processes together: each update's change, summed over time.
        rss = self.con.execute(f"""
            SELECT total, ts FROM (
                SELECT ts, sum(sum(d)) OVER (ORDER BY ts) AS total FROM (
                    SELECT ts, rss - coalesce(lag(rss) OVER (PARTITION BY pid ORDER BY ts), 0)
                           AS d
                    FROM rss_timeline WHERE {pids})
                GROUP BY ts)
            ORDER BY total DESC, ts LIMIT 1""").fetchone() if self.rss_recorded else None

        def per_s(n: int) -> float:
            return n / runtime if runtime > 0 else 0.0

        def rel(ts: int | None) -> float | None:
            return (ts - start) / 1e9 if ts is not None else None

        return {
            "runtime_s": runtime,
            "stopped": self.stopped(start),
            "calls": calls,
            "calls_per_s": per_s(calls),
            "allocated_bytes": allocated,
            "temporary": temporary,
            "temporary_per_s": per_s(temporary),
            "peak_heap_bytes": int(peak[0]) if peak and peak[0] is not None else 0,
            "peak_heap_at_s": rel(peak[1]) if peak else None,
            "peak_rss_bytes": int(rss[0]) if rss and rss[0] is not None else None,
            "peak_rss_at_s": rel(rss[1]) if rss else None,
            "leaked_bytes": leaked,
            "leaked_allocations": leaked_n,
        }

    def processes(self) -> list[dict[str, Any]]:
        rows = self.con.execute(f"""
            WITH c AS (SELECT pid, sum(calls) AS calls, sum(leaked_bytes) AS leaked
                       FROM stack_costs GROUP BY pid),
            r AS (SELECT pid, max(rss) AS rss FROM rss_timeline GROUP BY pid)
            SELECT p.pid, p.ppid, p.name, p.exe, p.exit_code, p.exit_signal,
                   coalesce(h.peak_bytes, 0), (h.peak_ts::DOUBLE - ?) / 1e9,
                   coalesce(c.calls, 0)::BIGINT, coalesce(c.leaked, 0)::BIGINT,
                   CASE WHEN ? THEN r.rss END, p.ns_pid
            FROM processes p LEFT JOIN heap_peak h USING (pid) LEFT JOIN c USING (pid)
                LEFT JOIN r USING (pid)
            WHERE {self.where("p.")} ORDER BY p.start_ts, p.pid""",
                                [float(self.start_ns), self.rss_recorded]).fetchall()
        keys = ("pid", "ppid", "name", "exe", "exit_code", "exit_signal", "peak_heap_bytes",
                "peak_heap_at_s", "calls", "leaked_bytes", "peak_rss_bytes", "ns_pid")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    # ---- costs -------------------------------------------------------------------
    @functools.cache  # noqa: B019 - a reader lives as long as one report
    def costs(self) -> Costs:
        """Every metric per (backtrace, pid), with the backtraces' frames."""
        where = self.where("c.")
        raw = self.con.execute(f"""
            SELECT b.backtrace_id, c.pid, sum(c.calls)::BIGINT, sum(c.bytes)::BIGINT,
                   sum(c.temporary)::BIGINT, sum(c.peak_calls)::BIGINT,
                   sum(c.peak_bytes)::BIGINT, sum(c.leaked_calls)::BIGINT,
                   sum(c.leaked_bytes)::BIGINT
            FROM stack_costs c LEFT JOIN backtraces b USING (stack_id)
            WHERE {where} GROUP BY 1, 2""").fetchall()
        rows = sorted((Cost(*r) for r in raw),
                      key=lambda r: (r.pid, r.backtrace is not None, r.backtrace or 0))
        reps = f"""SELECT DISTINCT b.backtrace_id AS stack_id FROM stack_costs c
                   JOIN backtraces b USING (stack_id) WHERE {where}"""
        # the frames of each backtrace, as rows (a list aggregate per group is slower)
        seq = self.con.execute(f"""
            SELECT bf.stack_id, bf.frame_id, sf.address FROM backtrace_frames bf
            JOIN ({reps}) r USING (stack_id)
            JOIN stack_frames sf ON sf.stack_id = bf.stack_id AND sf.depth = bf.depth
            ORDER BY bf.stack_id, bf.depth""").to_arrow_table()
        sid = seq.column("stack_id").to_numpy()
        cut = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]]) if len(sid) else sid
        heads = sid[cut].tolist()
        fids = np.split(seq.column("frame_id").to_numpy(), cut[1:]) if len(sid) else []
        addrs = np.split(seq.column("address").to_numpy(), cut[1:]) if len(sid) else []
        info = {k: (p, c) for k, p, c in self.con.execute(f"""
            SELECT s.stack_id, s.pid, {CUT_SQL} FROM stacks s JOIN ({reps}) r USING (stack_id)
            """).fetchall()}
        backtraces = {
            k: Backtrace(tuple(f.tolist()), tuple(a.tolist()), *info[k])
            for k, f, a in zip(heads, fids, addrs, strict=True)}
        frames: dict[int, list[Level]] = {}
        for fid, *level in self.con.execute(f"""
                SELECT frame_id, name, file, line, module_id, vaddr, reason, symbol FROM frames
                WHERE frame_id IN (SELECT DISTINCT bf.frame_id FROM backtrace_frames bf

                                   JOIN ({reps}) r USING (stack_id))
                ORDER BY frame_id, inline_depth""").fetchall():
            frames.setdefault(fid, []).append(Level(*level))
        procs = {p: n or "?" for p, n in self.con.execute(
            "SELECT pid, name FROM processes").fetchall()}
        modules = {m: Module(path, bid) for m, path, bid in self.con.execute(
            "SELECT module_id, path, build_id FROM modules ORDER BY 1").fetchall()}
        return Costs(rows, backtraces, frames, procs, modules)

    # ---- sites -------------------------------------------------------------------
    def site_costs(self) -> pa.Table:
        """Every site (LOCATION, with its module) and every metric of its allocations,
        with the number of backtraces under it; the costliest by bytes allocated first."""
        return self.con.execute(f"""
            WITH per_stack AS (
                SELECT stack_id, sum(calls) AS calls, sum(bytes) AS allocated,
                       sum(temporary) AS temporary, sum(peak_calls) AS peak_calls,
                       sum(peak_bytes) AS peak, sum(leaked_calls) AS leaked_calls,
                       sum(leaked_bytes) AS leaked
                FROM stack_costs WHERE {self.where()} GROUP BY stack_id)
            SELECT coalesce(l.name, '{NO_STACK}') AS location, l.file, l.line,
                   any_value(m.path) AS module, sum(calls)::BIGINT AS calls,
                   sum(allocated)::BIGINT AS allocated, sum(temporary)::BIGINT AS temporary,
                   sum(peak_calls)::BIGINT AS peak_calls, sum(peak)::BIGINT AS peak,
                   sum(leaked_calls)::BIGINT AS leaked_calls, sum(leaked)::BIGINT AS leaked,
                   count(DISTINCT b.backtrace_id) AS backtraces
            FROM per_stack s LEFT JOIN backtraces b USING (stack_id)
            LEFT JOIN stack_location l ON l.stack_id = s.stack_id
            LEFT JOIN modules m ON m.module_id = l.module_id
            GROUP BY 1, 2, 3 ORDER BY allocated DESC, 1, 2, 3""").to_arrow_table()

    def sites(self, metric: str, top: int = 10, backtraces: int = 3) -> list[dict[str, Any]]:
        """The `top` allocation sites by `metric`, each with its `backtraces` costliest
        backtraces (frames from the site outward)."""
        return self.sites_of(f"SELECT * FROM stack_costs WHERE {self.where()}",
                             METRICS[metric], COUNTED[metric], top, backtraces)

    def sites_of(self, costs: str, col: str, counted: str, top: int = 10,
                 backtraces: int = 3) -> list[dict[str, Any]]:
        """`sites` over any relation of per-stack costs (the SQL of one, with stack_id,
        the value column `col` and the count of allocations it counts `counted`)."""
        rows = self.con.execute(f"""
            WITH per_stack AS (
                SELECT stack_id, sum({col}) AS v FROM ({costs})
                GROUP BY stack_id HAVING sum({counted}) > 0),
            per_backtrace AS (
                SELECT b.backtrace_id, sum(s.v) AS v
                FROM per_stack s LEFT JOIN backtraces b USING (stack_id)
                GROUP BY b.backtrace_id),
            loc AS (
                SELECT coalesce(l.name, '{NO_STACK}') AS location, l.file, l.line,
                       m.path AS module, s.backtrace_id, s.v
                FROM per_backtrace s LEFT JOIN stack_location l ON l.stack_id = s.backtrace_id
                LEFT JOIN modules m ON m.module_id = l.module_id)
            SELECT location, file, line, any_value(module), sum(v)::BIGINT AS total,
                   list(backtrace_id ORDER BY v DESC, backtrace_id)[1:{int(backtraces)}],
                   list(v::BIGINT ORDER BY v DESC, backtrace_id)[1:{int(backtraces)}],
                   count(*)
            FROM loc GROUP BY location, file, line HAVING sum(v) > 0
            ORDER BY total DESC, location, file, line LIMIT {int(top)}""").fetchall()
        out = []
        for location, file, line, module, total, sids, vals, nstacks in rows:
            bts = [{"stack_id": s, "value": v, "truncated": self.cut(s),
                    "frames": self.backtrace(s)} for s, v in zip(sids, vals, strict=True)]
            out.append({"location": location, "file": file, "line": line, "module": module,
                        "value": total, "stacks": nstacks, "backtraces": bts})
        return out

    def call_paths(self) -> pa.Table:
        """Every metric (METRICS' names) per call path, the identity by which a site and
        its backtraces are matched across builds (`memtrack diff`): the backtrace's
        logical frames by function name and source file name, never by address, line or
        module path, which differ between two builds of one program. `path_key` and
        `levels` (a hash sum over (name, file, position) and the frame count) key a call
        path, `site` and `site_file` name its allocation site (its first frame: the
        report's location; `site_symbolized` false where that frame is only an address,
        which another build or process does not share); `stack_id` is one backtrace of
        the path to print its frames (null, with path_key 0, for allocations with no
        stack)."""
        sums = ", ".join(f"sum(c.{col})::BIGINT AS {name}" for name, col in METRICS.items())
        return self.con.execute(f"""
            WITH per_backtrace AS MATERIALIZED (
                SELECT b.backtrace_id AS stack_id, {sums}
                FROM stack_costs c LEFT JOIN backtraces b USING (stack_id)
                WHERE {self.where("c.")} GROUP BY 1),
            levels AS (  -- the logical frames of the backtraces only, numbered
                SELECT sf.stack_id, f.name, regexp_extract(coalesce(f.file, ''), '[^/]*$')
                       AS file, f.reason IS NULL AS symbolized,
                       row_number() OVER (PARTITION BY sf.stack_id
                                                   ORDER BY sf.depth, f.inline_depth) AS pos
                FROM backtrace_frames sf JOIN frames f USING (frame_id)
                WHERE sf.stack_id IN (SELECT stack_id FROM per_backtrace)),
            paths AS (
                SELECT stack_id, sum(hash(name, file, pos)::HUGEINT) AS path_key,
                       count(*) AS levels, arg_min(name, pos) AS site,
                       arg_min(file, pos) AS site_file, arg_min(symbolized, pos)
                       AS site_symbolized
                FROM levels GROUP BY stack_id)
            SELECT coalesce(k.path_key, 0) AS path_key, coalesce(k.levels, 0) AS levels,
                   coalesce(k.site, '{NO_STACK}') AS site, coalesce(k.site_file, '')
                   AS site_file, coalesce(k.site_symbolized, TRUE) AS site_symbolized, p.*
            FROM per_backtrace p LEFT JOIN paths k USING (stack_id)""").to_arrow_table()

    def cut(self, stack_id: int | None) -> bool:
        """Whether a stack was cut short (CUT_SQL)."""
        if stack_id is None:
            return False
        return bool(self.one(f"SELECT {CUT_SQL} FROM stacks s WHERE stack_id = ?", [stack_id]))

    def backtrace(self, stack_id: int | None) -> list[dict[str, Any]]:
        """A stack's logical frames from the allocation site outward, TRUNCATED last
        where it was cut short."""
        if stack_id is None:
            return []
        rows = self.con.execute(f"""
            SELECT l.name, l.file, l.line, m.path FROM stack_lines l
            JOIN stacks s USING (stack_id) LEFT JOIN modules m USING (module_id)
            WHERE l.stack_id = ? AND l.depth >= {SITE_DEPTH}
            ORDER BY l.position""", [stack_id]).fetchall()
        out = [{"function": n, "file": f, "line": ln, "module": m} for n, f, ln, m in rows]
        if self.cut(stack_id):
            out.append({"function": TRUNCATED, "file": None, "line": None, "module": None})
        return out

    def hotspots(self, limit: int = 50) -> list[dict[str, Any]]:
        """Per function of every process (allocator functions left out): the allocations
        it made itself and those made beneath it (the hotspots view)."""
        cur = self.con.execute(f"""
            SELECT * FROM hotspots ORDER BY self_bytes DESC, incl_bytes DESC, function
            LIMIT {int(limit)}""")
        names = [d[0] for d in cur.description or []]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    # ---- address spaces ----------------------------------------------------------
    def module_mappings(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """Where each module lay in each process, (pid, module_id) -> (lowest start,
        highest end, file offset at the lowest start)."""
        return {(p, m): (lo, hi, off) for p, m, lo, hi, off in self.con.execute("""
            SELECT pid, module_id, min("start"), max("end"), arg_min("offset", "start")
            FROM mappings WHERE module_id IS NOT NULL GROUP BY 1, 2""").fetchall()}

    def main_module(self) -> int | None:
        """The traced executable's module: the root process's (last) executable."""
        return self.one("""
            SELECT min(m.module_id) FROM processes p JOIN modules m ON m.path = p.exe
            WHERE p.pid = ?""", [int(self.meta.get("root_pid", 0) or 0)])

    # ---- timelines ---------------------------------------------------------------
    def timelines(self, points: int, only: list[int] | None = None) -> list[dict[str, Any]]:
        """Per process (of `only`, when given): heap bytes and RSS over time, [seconds
        from the run's time zero (program_start_ns; earlier samples at 0), bytes], each
        series cut to at most `points` (downsampled: each bucket's minimum, maximum and
        last value kept), ending at its last value (the heap at exit); and the stops
        that capture held it for, [begin s, end s, reason] (the `points` longest)."""
        chosen = self.where() if only is None else RunReader(self.con, tuple(only)).where()
        pids = f"SELECT pid FROM processes WHERE {self.where()} AND {chosen}"
        series = {"heap": f"""SELECT pid, ts, heap_bytes, event_id FROM heap_timeline
                              WHERE pid IN ({pids})""",
                  "rss": f"SELECT pid, ts, rss, ts FROM rss_timeline WHERE pid IN ({pids})"}
        if not self.rss_recorded:
            del series["rss"]
        points_of: dict[str, dict[int, list[list[float | int]]]] = {}
        start = self.program_start_ns
        for key, sql in series.items():
            by_pid = points_of[key] = {}
            for p, t, v in self.con.execute(downsampled(sql, points)).fetchall():
                by_pid.setdefault(p, []).append([round(max(t - start, 0) / 1e9, 9), int(v)])
        stops: dict[int, list[list[float | str]]] = {}
        for p, b, e, r in self.con.execute(f"""
                SELECT pid, begin_ts, end_ts, reason::VARCHAR FROM (
                    SELECT *, row_number() OVER (PARTITION BY pid
                                                 ORDER BY end_ts - begin_ts DESC) AS n
                    FROM stops WHERE pid IN ({pids}) AND end_ts > ?)
                WHERE n <= ? ORDER BY pid, begin_ts""", [start, points]).fetchall():
            stops.setdefault(p, []).append([round(max(b - start, 0) / 1e9, 9),
                                            round((e - start) / 1e9, 9), r])
        out = []
        for p, name in self.con.execute(f"""SELECT pid, name FROM processes
                                            WHERE pid IN ({pids}) ORDER BY start_ts, pid
                                            """).fetchall():
            heap, rss = points_of["heap"].get(p, []), points_of.get("rss", {}).get(p, [])
            if heap or rss:
                out.append({"pid": p, "name": name or "?", "heap": heap, "rss": rss,
                            "stops": stops.get(p, [])})
        return out


def _json(text: str | None, default: Any) -> Any:
    """A meta value decoded, or `default` where it is missing or not JSON."""
    try:
        return json.loads(text) if text else default
    except ValueError:
        return default


def downsampled(series: str, points: int) -> str:
    """SQL cutting each series of the relation `series` (its columns: the series' key,
    a time, a value and the series' order) to at most `points` rows: the key, time and
    value, in the key's and the series' order. A longer series is cut in points // 3
    buckets of consecutive rows, each keeping its minimum, its maximum and its last row,
    so that no peak, no trough and no final value (a series' last row is kept always)
    disappears from a plot."""
    buckets = max(points // 3, 1)
    return f"""
        WITH s AS (
            SELECT k, ts, v, row_number() OVER (PARTITION BY k ORDER BY o) - 1 AS i,
                   count(*) OVER (PARTITION BY k) AS n
            FROM ({series}) s(k, ts, v, o)),
        b AS (SELECT *, CASE WHEN n <= {int(points)} THEN i ELSE i * {buckets} // n END
                        AS b FROM s),
        kept AS (
            SELECT k, unnest([arg_min(i, (v, i)), arg_max(i, (v, -i)), max(i)]) AS i
            FROM b GROUP BY k, b)
        SELECT k, ts, v FROM b SEMI JOIN (SELECT DISTINCT k, i FROM kept) USING (k, i)
        ORDER BY k, i"""
