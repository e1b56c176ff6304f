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
    err.print(f"memtrack: {message}", markup=False, soft_wrap=True)
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
    parquet: Annotated[
        Path | None,
        typer.Option("--parquet", help="Also write every table as Parquet, one directory each."),
    ] = None,
    host_modules: Annotated[
        bool,
        typer.Option(
            "--host-modules/--no-host-modules",
            help="Use host files (same build id) for modules the artifact lacks.",
        ),
    ] = True,
    cache_dir: Annotated[
        Path | None, typer.Option("--cache-dir", help="Symbolization cache directory.")
    ] = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No progress, no summary.")] = False,
) -> None:
    """Decode, unwind, symbolize and load an artifact into DuckDB tables."""
    from memtrack.process.pipeline import process as run_process

    try:
        summary = run_process(
            artifact, output, parquet_dir=parquet, host_modules=host_modules,
            cache_dir=cache_dir, progress=False if quiet else None,
        )
    except ArtifactError as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"{e.filename or output}: {e.strerror or e}") from None
    if not quiet:
        for line in summary.lines():
            err.print(line, markup=False)


def _open_run(run: Path):  # noqa: ANN202 - duckdb connection
    from memtrack.schema.ddl import RunError, open_run

    try:
        return open_run(run)
    except RunError as e:
        raise fail(str(e)) from None


@app.command()
def report(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    fmt: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
    pid: Annotated[int | None, typer.Option("--pid", help="Only this process.")] = None,
    top: Annotated[int, typer.Option("--top", help="Locations per section.")] = 10,
    html: Annotated[
        Path | None, typer.Option("--html", help="Also write a self-contained HTML page here.")
    ] = None,
) -> None:
    """The heaptrack-style report of a processed run."""
    from memtrack.process.report import ReportOptions, format_text, report_data, report_json

    if fmt not in ("text", "json"):
        raise fail(f"--format: expected text or json, got {fmt!r}")
    con = _open_run(run)
    opts = ReportOptions(pid=pid, top=top)
    if pid is not None and not con.execute(
        "SELECT count(*) FROM processes WHERE pid = ?", [pid]
    ).fetchone()[0]:
        raise fail(f"{run}: no process {pid} in this run")
    data = report_data(con, opts)
    if html is not None:
        from memtrack.process.html import write_html

        try:
            write_html(con, html, opts)
        except OSError as e:
            raise fail(f"{html}: {e.strerror or e}") from None
    sys.stdout.write(report_json(data) + "\n" if fmt == "json" else format_text(data))


@app.command()
def query(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    sql: Annotated[str, typer.Argument(help="The SQL to run.")],
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
) -> None:
    """Run SQL against a processed run and print the result."""
    import duckdb

    from memtrack.process.report import print_query

    if fmt not in ("table", "csv", "json"):
        raise fail(f"--format: expected table, csv or json, got {fmt!r}")
    con = _open_run(run)
    try:
        cur = con.execute(sql)
    except duckdb.Error as e:
        msg = " ".join(str(e).split())
        raise fail(f"query: {msg}") from None
    print_query(cur, fmt, sys.stdout)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    fmt: Annotated[str, typer.Option("--format", help="folded, pprof or speedscope.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The file to write.")],
    metric: Annotated[
        str,
        typer.Option("--metric", help="folded/speedscope: allocated, calls, peak or leaked."),
    ] = "allocated",
    pid: Annotated[int | None, typer.Option("--pid", help="Only this process.")] = None,
) -> None:
    """Export a processed run as folded stacks, pprof or speedscope."""
    from memtrack.process.export import FORMATS, METRICS, export_run

    if fmt not in FORMATS:
        raise fail(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if metric not in METRICS:
        raise fail(f"--metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    con = _open_run(run)
    try:
        export_run(con, fmt, output, metric=metric, pid=pid)
    except OSError as e:
        raise fail(f"{output}: {e.strerror or e}") from None


@app.command("unwind")
def unwind_record(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    record: Annotated[str, typer.Option("--record", help="The stack hash (hex or decimal).")],
    host_modules: Annotated[bool, typer.Option(
        "--host-modules", help="Read modules missing from the artifact from this host.")] = False,
) -> None:
    """Unwind one stack record and print its frames with method (regs, cfi, fp, fp-kernel)
    and symbol."""
    from memtrack.process.unwind import show_record

    try:
        raise typer.Exit(show_record(artifact, record, sys.stdout, host_modules=host_modules))
    except (ArtifactError, ValueError) as e:
        raise fail(f"unwind: {e}") from None


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("memtrack: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
