"""`memtrack query RUN.duckdb SQL`: any SQL against a run database, printed as an
aligned table, CSV or JSON."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TextIO

import duckdb

from memtrack.commands import CommandError, open_run_db

FORMATS = ("table", "csv", "json")


def run(run_db: Path, sql: str, fmt: str, out: TextIO, allow_files: bool = False) -> int:
    if fmt not in FORMATS:
        raise CommandError(f"--format: expected table, csv or json, got {fmt!r}")
    if not sql.strip():
        raise CommandError("query: no SQL given")
    con = open_run_db(run_db)
    try:
        if not allow_files:  # read_text('/etc/shadow'), COPY ... TO: not from a query
            con.execute("SET enable_external_access = false")
        cur = con.execute(sql)
        names = [d[0] for d in cur.description or []]
        # through Arrow: TIMESTAMPTZ values need no pytz
        res = cur.arrow() if cur.description else None
        table = res.read_all() if hasattr(res, "read_all") else res
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
                             default=str) + "\n")
    else:
        cells = [names] + [["NULL" if v is None else str(v) for v in r] for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(names))]
        for k, c in enumerate(cells):
            out.write("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()
                      + "\n")
            if k == 0:
                out.write("  ".join("-" * w for w in widths) + "\n")
        out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")
