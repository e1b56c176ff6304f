"""`memtrack check RUN.duckdb`: every region that carries limits (the pytest plugin's
`memtrack_limit`, `limit_memory`, `limit_leaks` markers) against its figures
(memtrack.report.limits); exit status 1 when a limit was exceeded, 3 when the run cannot
be judged (it lost data, or the kernel refused allocator functions: calls not recorded),
2 on an error."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

import duckdb

from memtrack.commands import MAX_PID, CommandError, bounded, open_run_db
from memtrack.schema.ddl import first_line

FORMATS = ("text", "json")


def run(run_db: Path, fmt: str, pid: int | None, out: TextIO) -> int:
    from memtrack.report.limits import LimitError, check_limits, format_json, format_text
    from memtrack.report.reader import RunReader

    if fmt not in FORMATS:
        raise CommandError(f"--format: expected text or json, got {fmt!r}")
    if pid is not None:
        bounded("--pid", pid, 0, MAX_PID)
    reader = RunReader(open_run_db(run_db), pid)
    if pid is not None and not reader.has_process():
        raise CommandError(f"{run_db}: no process {pid} in this run")
    try:
        check = check_limits(reader)
    except LimitError as e:
        raise CommandError(f"{run_db}: {e}") from None
    except duckdb.Error as e:  # a damaged run
        raise CommandError(f"check: {first_line(e)}") from None
    out.write(format_json(check) if fmt == "json" else format_text(check))
    return check.exit_status
