"""`memtrack export RUN.duckdb --format folded|pprof|speedscope -o FILE`: a run for the
tools that read those formats (memtrack.report.EXPORTS); with --python-only, the stacks
in the Python view (memtrack.schema.ddl.PYTHON_ONLY)."""

from __future__ import annotations

from pathlib import Path

from memtrack.commands import (
    MAX_PID,
    CommandError,
    bounded,
    check_output,
    give_to_invoking_user,
    open_run_db,
)


def run(run_db: Path, fmt: str, output: Path, metric: str, pid: int | None, *,
        pids: bool = False, force: bool = False, python_only: bool = False) -> int:
    from memtrack.report import EXPORT_METRICS, EXPORTS
    from memtrack.report.reader import RunReader

    if fmt not in EXPORTS:
        raise CommandError(f"--format: expected one of {', '.join(EXPORTS)}, got {fmt!r}")
    if metric not in EXPORT_METRICS:
        raise CommandError(
            f"--metric: expected one of {', '.join(EXPORT_METRICS)}, got {metric!r}")
    if pid is not None:
        bounded("--pid", pid, 0, MAX_PID)
    check_output(output, force)
    data = EXPORTS[fmt](RunReader(open_run_db(run_db, python_only=python_only), pid), metric, pids)
    try:
        output.write_bytes(data)
    except OSError as e:
        raise CommandError(f"{output}: {e.strerror or e}") from None
    give_to_invoking_user(output)
    return 0
