"""`memtrack query RUN.duckdb SQL`: any SQL against a run database, printed as an
aligned table, CSV or JSON (with --python-only, its stacks in the Python view:
memtrack.schema.ddl.PYTHON_ONLY); `memtrack query --dataset DIR SQL`: against every run
of a run dataset (a view per table across runs, with its `run` column)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import TextIO

import duckdb

from memtrack.commands import CommandError, open_run_db

FORMATS = ("table", "csv", "json")


def run(args: Sequence[str], fmt: str, out: TextIO, dataset: str | Path | None = None,
        allow_files: bool = False, python_only: bool = False) -> int:
    """args: RUN.duckdb and the SQL, or with a dataset the SQL alone."""
    if fmt not in FORMATS:
        raise CommandError(f"--format: expected table, csv or json, got {fmt!r}")
    if len(args) != (1 if dataset is not None else 2):
        raise CommandError("expected --dataset DIR SQL" if dataset is not None
                           else "expected RUN.duckdb SQL (or --dataset DIR SQL)")
    sql = args[-1]
    if not sql.strip():
        raise CommandError("query: no SQL given")
    # read_text('/etc/shadow'), COPY ... TO: not from a query unless --allow-files
    if dataset is not None and python_only:
        raise CommandError("--python-only: a run database's stacks, not a dataset's "
                           "(`memtrack diff --dataset DIR --python-only` folds two of its "
                           "runs)")
    if dataset is not None:
        from memtrack.schema.dataset import DatasetError, open_dataset

        try:
            con = open_dataset(dataset, files=allow_files)
        except DatasetError as e:
            raise CommandError(str(e)) from None
    else:
        con = open_run_db(Path(args[0]), files=allow_files, python_only=python_only)
    try:
        cur = con.execute(sql)
        names = [d[0] for d in cur.description or []]
        # through Arrow: TIMESTAMPTZ values need no pytz
        table = cur.to_arrow_table() if cur.description else None
    except duckdb.Error as e:
        raise CommandError(f"query: {' '.join(str(e).split())}") from None
    rows = list(zip(*(c.to_pylist() for c in table.columns), strict=True)) if table else []
    print_query(names, rows, fmt, out)
    return 0


def print_query(names: list[str], rows: list[tuple], fmt: str, out: TextIO) -> None:
    """Print a query result as an aligned table, CSV or JSON (a list of objects)."""
    if fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(names)
        w.writerows(rows)
    elif fmt == "json":
        out.write(json.dumps([dict(zip(names, r, strict=True)) for r in rows], indent=1,
                             default=_json_value) + "\n")
    else:
        cells = [names] + [["NULL" if v is None else str(v) for v in r] for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(names))]
        for k, c in enumerate(cells):
            out.write("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()
                      + "\n")
            if k == 0:
                out.write("  ".join("-" * w for w in widths) + "\n")
        out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")


def _json_value(v: object) -> object:
    """A value JSON has no type for: a DECIMAL or HUGEINT (a sum in DuckDB) as a number,
    anything else (times, intervals) as its text."""
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    return str(v)
