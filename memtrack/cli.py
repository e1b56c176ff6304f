"""memtrack command line (typer)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from memtrack.schema.artifact import ArtifactError

app = typer.Typer(
    help="Linux memory-allocation profiler: eBPF capture, offline unwinding, DuckDB tables.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False)


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"memtrack: {message}", markup=False)
    return typer.Exit(code)


def not_built(command: str, issue: int) -> typer.Exit:
    return fail(f"{command}: this stage is not built yet (issue #{issue})", 1)


@app.command()
def info(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Print an artifact's manifest, row counts per file, loss counters and modules."""
    from memtrack.info import show_info

    try:
        show_info(artifact, as_json=as_json)
    except ArtifactError as e:
        raise fail(str(e)) from None


@app.command()
def doctor() -> None:
    """Check what capture needs on this machine and how to fix what is missing."""
    from memtrack.capture.doctor import run_doctor

    raise typer.Exit(run_doctor())


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def capture(ctx: typer.Context) -> None:
    """Record every allocation of CMD and its descendants: capture -o OUT.memtrack -- CMD..."""
    raise not_built("capture", 3)


@app.command()
def process(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The DuckDB file to write.")],
) -> None:
    """Decode, unwind, symbolize and load an artifact into DuckDB tables."""
    raise not_built("process", 8)


@app.command()
def report(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
) -> None:
    """The heaptrack-style report of a processed run."""
    raise not_built("report", 8)


@app.command()
def query(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    sql: Annotated[str, typer.Argument(help="The SQL to run.")],
) -> None:
    """Run SQL against a processed run and print the result."""
    raise not_built("query", 8)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
) -> None:
    """Export a processed run as folded stacks, pprof or speedscope."""
    raise not_built("export", 8)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("memtrack: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
