"""`memtrack diff BASE.duckdb HEAD.duckdb` (or `--dataset DIR BASE_ID HEAD_ID`): what
changed between two runs (memtrack.report.diff), as text, JSON or markdown; with
`--fail-above PCT` exit status 1 when a gated total grew by more than PCT percent, 3
when the two runs cannot be compared (either lost data, or the kernel refused different
allocator functions in each); with --python-only, both runs' stacks in the Python view
(memtrack.schema.ddl.PYTHON_ONLY)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import duckdb

from memtrack.commands import MAX_PID, MAX_TOP, CommandError, bounded, open_run_db
from memtrack.schema.ddl import first_line

FORMATS = ("text", "json", "markdown")
MAX_PERCENT = 1e9  # --fail-above (inf and NaN are no percentage)


def choices(option: str, given: Sequence[str], allowed: Sequence[str],
            default: Sequence[str]) -> tuple[str, ...]:
    """A repeatable option whose values may also be comma-separated."""
    out = [v.strip() for g in given for v in g.split(",") if v.strip()]
    for v in out:
        if v not in allowed:
            raise CommandError(f"{option}: expected one of {', '.join(allowed)}, got {v!r}")
    return tuple(dict.fromkeys(out)) or tuple(default)


def parse_pids(pid: str) -> tuple[int, int]:
    """`--pid N` (the same pid in both runs) or `--pid BASE:HEAD`."""
    parts = pid.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise CommandError(f"--pid: expected PID or BASE_PID:HEAD_PID, got {pid!r}")
    return bounded("--pid", int(parts[0]), 0, MAX_PID), bounded("--pid", int(parts[-1]), 0,
                                                                MAX_PID)


def run(base: str, head: str, *, dataset: str | Path | None = None, fmt: str = "text",
        pid: str | None = None, process: str | None = None, metrics: Sequence[str] = (),
        top: int = 10, fail_above: float | None = None, fail_on: Sequence[str] = (),
        python_only: bool = False, out: TextIO) -> int:
    from memtrack.report.diff import (
        GATED,
        GATES,
        DiffOptions,
        Side,
        diff_data,
        format_json,
        format_markdown,
        format_text,
    )
    from memtrack.report.reader import METRICS, RunReader

    if fmt not in FORMATS:
        raise CommandError(f"--format: expected text, json or markdown, got {fmt!r}")
    bounded("--top", top, 1, MAX_TOP)
    if fail_above is not None and not 0 <= fail_above <= MAX_PERCENT:
        raise CommandError(f"--fail-above: expected a percentage from 0 to {MAX_PERCENT:g}, "
                           f"got {fail_above}")
    if fail_on and fail_above is None:
        raise CommandError("--fail-on goes with --fail-above PCT")
    if pid is not None and process is not None:
        raise CommandError("--pid and --process: give one")
    opts = DiffOptions(metrics=choices("--metric", metrics, list(METRICS), list(METRICS)),
                       top=top, fail_above=fail_above,
                       fail_on=choices("--fail-on", fail_on, list(GATES), GATED),
                       python_only=python_only)
    pids = parse_pids(pid) if pid is not None else (None, None)

    def side(which: str, run_: str, pid_: int | None) -> Side:
        if dataset is not None:
            from memtrack.schema.dataset import DatasetError, open_dataset_run

            try:
                con = open_dataset_run(dataset, run_, python_only=python_only)
            except DatasetError as e:
                raise CommandError(str(e)) from None
            name = f"run {run_}"
        else:
            con = open_run_db(Path(run_), python_only=python_only)
            name = run_
        if process is not None:
            named = RunReader(con).pids_named(process)
            if not named:
                raise CommandError(f"{which} {name}: no process named {process!r}")
            return Side(name, RunReader(con, named))
        reader = RunReader(con, pid_)
        if pid_ is not None and not reader.has_process():
            raise CommandError(f"{which} {name}: no process {pid_} in this run")
        return Side(name, reader)

    sides = side("base", base, pids[0]), side("head", head, pids[1])
    try:
        diff = diff_data(*sides, opts)
    except duckdb.Error as e:  # a damaged run (a dataset's file, say)
        raise CommandError(f"diff: {first_line(e)}") from None
    render = {"text": format_text, "json": format_json, "markdown": format_markdown}[fmt]
    out.write(render(diff))
    return diff.exit_status
