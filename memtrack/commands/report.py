"""`memtrack report RUN.duckdb`: the heaptrack-style report (memtrack.report.text), as
text or JSON, and with --html a self-contained page (memtrack.report.html)."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from memtrack.commands import CommandError, open_run_db


def run(run_db: Path, fmt: str, pid: int | None, top: int, html: Path | None,
        out: TextIO) -> int:
    from memtrack.report.reader import RunReader
    from memtrack.report.text import ReportOptions, format_text, report_data, report_json

    if fmt not in ("text", "json"):
        raise CommandError(f"--format: expected text or json, got {fmt!r}")
    if top < 0:
        raise CommandError(f"--top: expected 0 or more locations, got {top}")
    con = open_run_db(run_db)
    if pid is not None and not RunReader(con, pid).has_process():
        raise CommandError(f"{run_db}: no process {pid} in this run")
    opts = ReportOptions(pid=pid, top=top)
    data = report_data(con, opts)
    if html is not None:
        from memtrack.report.html import write_html

        try:
            write_html(con, html, opts)
        except OSError as e:
            raise CommandError(f"{html}: {e.strerror or e}") from None
    out.write(report_json(data) + "\n" if fmt == "json" else format_text(data))
    return 0
