"""The subcommands, one module each with a `run(...)` that takes plain values, writes
its output and returns the exit status; memtrack.cli wires them to the command line.
A command that cannot do what it was asked raises CommandError (one line)."""

from __future__ import annotations

from pathlib import Path

import duckdb


class CommandError(Exception):
    """The message is one line for the user (`memtrack: MESSAGE`, exit status 2)."""


def open_run_db(path: Path) -> duckdb.DuckDBPyConnection:
    """A run database opened read-only, or CommandError."""
    from memtrack.schema.ddl import RunError, open_run

    try:
        return open_run(path)
    except RunError as e:
        raise CommandError(str(e)) from None
