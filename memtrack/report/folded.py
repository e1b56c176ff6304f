"""Folded stacks (flamegraph.pl, inferno): one line per stack, `process;outermost;...;site
VALUE`, for one metric; the process by its name (with its pid: `pids`)."""

from __future__ import annotations

from memtrack.report.reader import Costs, RunReader


def folded(c: Costs, metric: str, pids: bool = False) -> str:
    """flamegraph.pl / inferno input: `process;outermost;...;site VALUE` per line (a stack
    cut short starts with [truncated] after the process), the process `name`, or
    `name (pid)` with `pids`."""
    acc: dict[str, int] = {}
    for row in c.rows:
        v = row.value(metric)
        if v <= 0:
            continue
        names = [c.root(row.pid, pids), *reversed(c.names(row.backtrace))]
        key = ";".join(n.replace(";", ":").replace("\n", " ") for n in names)
        acc[key] = acc.get(key, 0) + v
    return "".join(f"{k} {v}\n" for k, v in sorted(acc.items()))


def render(run: RunReader, metric: str, pids: bool = False) -> bytes:
    return folded(run.costs(), metric, pids).encode()
