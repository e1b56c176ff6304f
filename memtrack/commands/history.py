"""`memtrack history --dataset DIR`: every benchmark (region name) and process name
across the runs of a dataset, with the runs that stepped (memtrack.report.history), as
text, JSON or markdown, and with `--html OUT.html` one page of charts; with
`--fail-on-step` exit status 1 when the latest run stepped, 3 when it or the run
before it lost data (as `diff`'s gate: their figures do not compare)."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

import duckdb

from memtrack.commands import CommandError, bounded, check_output
from memtrack.schema.ddl import first_line

FORMATS = ("text", "json", "markdown")
MAX_TOLERANCE = 1e6  # percent
MAX_RUNS = 10**7  # --last


def run(dataset: str | Path, *, fmt: str = "text", order_by: str | None = None,
        tolerance: float | None = None, last: int | None = None,
        fail_on_step: bool = False, html: Path | None = None, force: bool = False,
        out: TextIO) -> int:
    from memtrack.report.history import (
        DEFAULT_TOLERANCE,
        EXIT_NOT_COMPARABLE,
        EXIT_STEPPED,
        HistoryError,
        HistoryOptions,
        format_json,
        format_markdown,
        format_text,
        history_data,
    )
    from memtrack.schema.dataset import DatasetError

    if fmt not in FORMATS:
        raise CommandError(f"--format: expected text, json or markdown, got {fmt!r}")
    tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
    bounded("--tolerance", tolerance, 0, MAX_TOLERANCE)
    if last is not None:
        bounded("--last", last, 1, MAX_RUNS)
    if order_by is not None and not order_by.strip():
        raise CommandError("--order-by: expected a label's key")
    if html is not None:
        check_output(html, force)
    opts = HistoryOptions(order_by=order_by, tolerance=tolerance, last=last,
                          diffs=html is not None)
    try:
        history = history_data(dataset, opts)
        if html is not None:
            from memtrack.report.history_html import write_html

            write_html(history, html)
    except (DatasetError, HistoryError) as e:
        raise CommandError(str(e)) from None
    except duckdb.Error as e:  # a damaged run (a dataset's file)
        raise CommandError(f"history: {first_line(e)}") from None
    render = {"text": format_text, "json": format_json, "markdown": format_markdown}[fmt]
    out.write(render(history))
    if not fail_on_step:
        return 0
    return EXIT_NOT_COMPARABLE if not history.comparable else \
        EXIT_STEPPED if history.stepped else 0
