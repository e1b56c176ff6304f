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


_CAPTURE_ENV = (
    "Every option can also be set in the environment: MEMTRACK_OUTPUT, MEMTRACK_FORCE, "
    "MEMTRACK_STACKS, MEMTRACK_STACK_BUDGET, MEMTRACK_STACK_COMPRESSION, MEMTRACK_RSS, "
    "MEMTRACK_TRACK_FAULTS, MEMTRACK_MODULES, MEMTRACK_START_DISABLED, "
    "MEMTRACK_CONTROL_FIFO, MEMTRACK_PROBE_PLACEMENT, MEMTRACK_EVENTS_RING_PAGES, "
    "MEMTRACK_STACKS_RING_PAGES, MEMTRACK_FAIL_ON_LOSS, MEMTRACK_TIMEOUT. "
    "CMD sees MEMTRACK_CONTROL / MEMTRACK_CONTROL_ACK: write 'enable' or 'disable' "
    "(one line) to the first, read 'ok' from the second."
)


@app.command(epilog=_CAPTURE_ENV)
def capture(
    cmd: Annotated[list[str], typer.Argument(help="The command to run (after --).")],
    output: Annotated[Path, typer.Option("-o", "--output", envvar="MEMTRACK_OUTPUT",
                                         help="The artifact directory to write.")],
    force: Annotated[bool, typer.Option("--force", envvar="MEMTRACK_FORCE",
                                        help="Replace OUTPUT if it exists.")] = False,
    stacks: Annotated[str, typer.Option("--stacks", envvar="MEMTRACK_STACKS",
                                        help="Capture allocation stacks: on or off.")] = "on",
    stack_budget: Annotated[int, typer.Option(
        "--stack-budget", envvar="MEMTRACK_STACK_BUDGET",
        help="Most bytes of stack copied per allocation (512..32768); a copy stops at "
             "the stack's end.")] = 32768,
    stack_copies: Annotated[bool, typer.Option(
        "--stack-copies", envvar="MEMTRACK_STACK_COPIES",
        help="Debug: also write every allocation's raw stack copy (stack_copies.arrow), "
             "the proof that each stack record unwinds as its allocations would.")] = False,
    rss: Annotated[bool, typer.Option("--rss/--no-rss", envvar="MEMTRACK_RSS",
                                      help="Record resident memory (kmem:rss_stat).")] = True,
    track_faults: Annotated[bool, typer.Option("--track-faults", envvar="MEMTRACK_TRACK_FAULTS",
                                               help="Record user page faults.")] = False,
    modules: Annotated[bool, typer.Option(
        "--modules/--no-modules", envvar="MEMTRACK_MODULES",
        help="Copy the mapped modules and their debug files into the artifact.")] = True,
    start_disabled: Annotated[bool, typer.Option(
        "--start-disabled", envvar="MEMTRACK_START_DISABLED",
        help="Record nothing until 'enable' arrives on the control FIFO.")] = False,
    control_fifo: Annotated[Path | None, typer.Option(
        "--control-fifo", envvar="MEMTRACK_CONTROL_FIFO",
        help="Create the control FIFO here (default: a temporary directory).")] = None,
    probe_placement: Annotated[str, typer.Option(
        "--probe-placement", envvar="MEMTRACK_PROBE_PLACEMENT",
        help="Where entry probes go: auto (a cheap instruction) or entry.")] = "auto",
    events_ring_pages: Annotated[int, typer.Option(
        "--events-ring-pages", envvar="MEMTRACK_EVENTS_RING_PAGES",
        help="Events ring size in pages (a power of two).")] = 4096,
    stacks_ring_pages: Annotated[int, typer.Option(
        "--stacks-ring-pages", envvar="MEMTRACK_STACKS_RING_PAGES",
        help="Stack ring size in pages (a power of two).")] = 8192,
    fail_on_loss: Annotated[bool, typer.Option(
        "--fail-on-loss", envvar="MEMTRACK_FAIL_ON_LOSS",
        help="Exit with status 1 when any event was lost.")] = False,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", envvar="MEMTRACK_TIMEOUT",
        help="Kill CMD after this many seconds.")] = None,
) -> None:
    """Record every allocation of CMD and its descendants: capture -o OUT.memtrack -- CMD..."""
    from memtrack.capture.parts import CaptureOptions
    from memtrack.capture.run import run_capture
    from memtrack.capture.tracker import CaptureError

    if stacks not in ("on", "off"):
        raise fail(f"--stacks {stacks}: expected on or off")
    options = CaptureOptions(
        stacks=stacks == "on", stack_budget=stack_budget, stack_copies=stack_copies,
        rss=rss, track_faults=track_faults, modules=modules, start_disabled=start_disabled,
        probe_placement=probe_placement, events_ring_pages=events_ring_pages,
        stacks_ring_pages=stacks_ring_pages, fail_on_loss=fail_on_loss)
    try:
        status = run_capture(cmd, output, options, force=force, control=control_fifo,
                             timeout=timeout)
    except (CaptureError, ArtifactError, ValueError) as e:
        raise fail(str(e)) from None
    raise typer.Exit(status)


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
        Path | None,
        typer.Option("--cache-dir", envvar="MEMTRACK_CACHE_DIR",
                     help="Per-build-id symbol cache [default: $XDG_CACHE_HOME/memtrack]."),
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Parse every module's DWARF afresh.")
    ] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No progress, no summary.")] = False,
) -> None:
    """Decode, unwind, symbolize and load an artifact into DuckDB tables."""
    import duckdb

    from memtrack.process.pipeline import ProcessError
    from memtrack.process.pipeline import process as run_process
    from memtrack.symbolize import default_cache_dir

    try:
        summary = run_process(
            artifact, output, parquet_dir=parquet, host_modules=host_modules,
            cache_dir=None if no_cache else (cache_dir or default_cache_dir()),
            progress=False if quiet else None,
        )
    except (ArtifactError, ProcessError) as e:
        raise fail(str(e)) from None
    except duckdb.IOException as e:
        raise fail(f"{output}: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise fail(f"{e.filename or output}: {e.strerror or e}") from None
    if not quiet:
        for line in summary.lines():
            err.print(line, markup=False, soft_wrap=True)


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


@app.command()
def symbolize(
    module: Annotated[Path, typer.Option("--module", help="The ELF file (PIE, shared or not).")],
    addresses: Annotated[list[str], typer.Argument(help="ELF virtual addresses (0x hex).")],
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", help="Cache directory [default: $XDG_CACHE_HOME/memtrack]."),
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Neither read nor write the cache.")
    ] = False,
) -> None:
    """Print the frames of addresses in a module, innermost first (llvm-symbolizer --inlines)."""
    from memtrack.symbolize import default_cache_dir
    from memtrack.symbolize.command import run_symbolize

    cache = None if no_cache else (cache_dir or default_cache_dir())
    try:
        raise typer.Exit(run_symbolize(module, addresses, cache, sys.stdout, sys.stderr))
    except ValueError as e:
        raise fail(f"symbolize: {e}") from None


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
