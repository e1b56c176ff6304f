"""Reports of a run database: text and JSON (memtrack.report.text), one HTML page
(memtrack.report.html), and the exports folded, pprof and speedscope. Every one reads
the run through memtrack.report.reader.RunReader; each export is a module with
`render(run, metric, pids) -> bytes`, listed in EXPORTS; every export honours every
metric (EXPORT_METRICS: the reader's METRICS) and tells processes apart by pid only with
`pids` (else two runs' stacks match: folded and speedscope name the root by the process,
pprof gives a sample no pid label)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memtrack.report import folded, pprof, speedscope
from memtrack.report.reader import METRICS, RunReader

EXPORTS: dict[str, Callable[[RunReader, str, bool], bytes]] = {
    "folded": folded.render,
    "pprof": pprof.render,
    "speedscope": speedscope.render,
}
EXPORT_METRICS = tuple(METRICS)


def open_run(path: Path | str, pid: int | None = None, *,
             python_only: bool = False) -> RunReader:
    """A run database for reading as `report` reads it (read-only, no file access from
    SQL): `.totals()`, `.processes()`, `.hotspots(n)`, `.timelines(points)`, and `.con`
    for any SQL; `pid`: that process only; `python_only`: the stacks in the Python view
    (`report --python-only`). The Python API's `memtrack.open_run`.

        run = memtrack.open_run("run.duckdb")
        run.totals()["peak_heap_bytes"], run.con.sql("SELECT count(*) FROM allocations")
    """
    from memtrack.schema.ddl import open_run as open_db

    return RunReader(open_db(path, python_only=python_only), pid)
