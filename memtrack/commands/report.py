"""`memtrack report RUN.duckdb`: the heaptrack-style report (memtrack.report.text), as
text or JSON, and with --html a self-contained page (memtrack.report.html); with
--region NAME, that region's figures and allocation sites (memtrack.report.regions);
with --python-only, the stacks in the Python view (memtrack.schema.ddl.PYTHON_ONLY)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from memtrack.commands import (
    MAX_PID,
    MAX_TOP,
    CommandError,
    bounded,
    check_output,
    give_to_invoking_user,
    open_run_db,
)


def run(run_db: Path, fmt: str, pid: int | None, top: int, html: Path | None,
        out: TextIO, region: str | None = None, *, force: bool = False,
        python_only: bool = False) -> int:
    from memtrack.report.reader import RunReader
    from memtrack.report.text import ReportOptions, format_text, report_data, report_json

    if fmt not in ("text", "json"):
        raise CommandError(f"--format: expected text or json, got {fmt!r}")
    bounded("--top", top, 0, MAX_TOP)
    if pid is not None:
        bounded("--pid", pid, 0, MAX_PID)

    if html is not None:
        check_output(html, force)
    con = open_run_db(run_db, python_only=python_only)
    if pid is not None and not RunReader(con, pid).has_process():
        raise CommandError(f"{run_db}: no process {pid} in this run")
    opts = ReportOptions(pid=pid, top=top, python_only=python_only)
    if region is not None:
        return _region(con, run_db, region, fmt, opts, out)
    data = report_data(con, opts)
    if html is not None:
        from memtrack.report.html import write_html

        try:
            write_html(con, html, opts, data)
        except OSError as e:
            raise CommandError(f"{html}: {e.strerror or e}") from None
        give_to_invoking_user(html)
    out.write(report_json(data) + "\n" if fmt == "json" else format_text(data))
    return 0


def _region(con: Any, run_db: Path, name: str, fmt: str, opts: Any, out: TextIO) -> int:
    from memtrack.report.reader import RunReader
    from memtrack.report.regions import RegionReader, format_region, region_data
    from memtrack.report.text import report_json

    run = RunReader(con, opts.pid)
    data = region_data(run, name, opts.top, opts.backtraces)
    if data is None:
        like = RegionReader(run).similar(name)
        hint = f" (regions named like it: {', '.join(like)})" if like else ""
        where = f"process {opts.pid}" if opts.pid is not None else "this run"
        raise CommandError(f"{run_db}: no region named {name!r} in {where}{hint}")
    out.write(report_json(data) + "\n" if fmt == "json" else format_region(data))
    return 0
