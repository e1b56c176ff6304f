"""memtrack command line: typer wiring of the subcommands in memtrack.commands (each
option, its help and environment variable here; what a command does, there)."""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from memtrack.commands import CommandError

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


def call(run: Callable[..., int], *args: object, **kwargs: object) -> None:
    """Run a command's `run` and exit with its status (2 and one line on CommandError)."""
    try:
        status = run(*args, **kwargs)
    except CommandError as e:
        raise fail(str(e)) from None
    raise typer.Exit(status)


@app.command()
def info(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Print an artifact's manifest, row counts per file, loss counters and modules."""
    from memtrack.commands import info as cmd

    call(cmd.run, artifact, as_json)


@app.command()
def doctor() -> None:
    """Check what capture needs on this machine and how to fix what is missing."""
    from memtrack.commands import doctor as cmd

    call(cmd.run)


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
    events_ring_pages: Annotated[int | None, typer.Option(
        "--events-ring-pages", envvar="MEMTRACK_EVENTS_RING_PAGES", show_default=False,
        help="Events ring size in pages (a power of two; default: 16 MiB per CPU, at "
             "most 1/256 of the memory).")] = None,
    stacks_ring_pages: Annotated[int | None, typer.Option(
        "--stacks-ring-pages", envvar="MEMTRACK_STACKS_RING_PAGES", show_default=False,
        help="Stack ring size in pages (a power of two; default: 32 MiB per CPU, at "
             "most 1/256 of the memory).")] = None,
    on_ring_full: Annotated[str, typer.Option(
        "--on-ring-full", envvar="MEMTRACK_ON_RING_FULL",
        help="When a ring fills faster than it drains: pause (stop the producing "
             "process until it has drained: nothing lost) or drop (count the lost "
             "records).")] = "pause",
    fail_on_loss: Annotated[bool, typer.Option(
        "--fail-on-loss", envvar="MEMTRACK_FAIL_ON_LOSS",
        help="Exit with status 1 when any event was lost.")] = False,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", envvar="MEMTRACK_TIMEOUT",
        help="Kill CMD after this many seconds.")] = None,
    program_cache: Annotated[str, typer.Option(
        "--program-cache", envvar="MEMTRACK_PROGRAM_CACHE",
        help="Where compiled BPF programs are kept (default $XDG_CACHE_HOME/memtrack/bpf), "
             "or off.")] = "",
) -> None:
    """Record every allocation of CMD and its descendants: capture -o OUT.memtrack -- CMD..."""
    from memtrack.commands import capture as cmd_

    call(cmd_.run, cmd, output, force=force, stacks=stacks, stack_budget=stack_budget,
         stack_copies=stack_copies, rss=rss, track_faults=track_faults,
         modules=modules, start_disabled=start_disabled, control_fifo=control_fifo,
         probe_placement=probe_placement, events_ring_pages=events_ring_pages,
         stacks_ring_pages=stacks_ring_pages, on_ring_full=on_ring_full, fail_on_loss=fail_on_loss,
         timeout=timeout, program_cache=program_cache)


def envvars(fn: Callable[..., object]) -> list[str]:
    """The environment variables of a command's options, in their order."""
    out = []
    for hint in typing.get_type_hints(fn, include_extras=True).values():
        for meta in getattr(hint, "__metadata__", ()):
            env = getattr(meta, "envvar", None)
            if env:
                out.append(env)
    return out


app.command(epilog=(
    "Every option can also be set in the environment: " + ", ".join(envvars(capture)) +
    ". CMD sees MEMTRACK_CONTROL / MEMTRACK_CONTROL_ACK: write 'enable' or 'disable' "
    "(one line) to the first, read 'ok' from the second."))(capture)


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
    from memtrack.commands import process as cmd

    call(cmd.run, artifact, output, parquet=parquet, host_modules=host_modules,
         cache_dir=cache_dir, no_cache=no_cache, quiet=quiet,
         say=lambda line: err.print(line, markup=False, soft_wrap=True))


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
    from memtrack.commands import report as cmd

    call(cmd.run, run, fmt, pid, top, html, sys.stdout)


@app.command()
def query(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    sql: Annotated[str, typer.Argument(help="The SQL to run.")],
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    allow_files: Annotated[bool, typer.Option(
        "--allow-files", help="Let the SQL read and write files (read_csv, COPY ... TO).")
    ] = False,
) -> None:
    """Run SQL against a processed run (read-only, no file access) and print the result."""
    from memtrack.commands import query as cmd

    call(cmd.run, run, sql, fmt, sys.stdout, allow_files)


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
    from memtrack.commands import export as cmd

    call(cmd.run, run, fmt, output, metric, pid)


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
    from memtrack.commands import symbolize as cmd

    call(cmd.run, module, addresses, cache_dir, no_cache, sys.stdout, sys.stderr)


@app.command("unwind")
def unwind_record(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    record: Annotated[str, typer.Option("--record", help="The stack hash (hex or decimal).")],
    host_modules: Annotated[bool, typer.Option(
        "--host-modules", help="Read modules missing from the artifact from this host.")] = False,
) -> None:
    """Unwind one stack record and print its frames with method (regs, cfi, fp, fp-kernel)
    and symbol."""
    from memtrack.commands import unwind as cmd

    call(cmd.run, artifact, record, host_modules, sys.stdout)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("memtrack: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
