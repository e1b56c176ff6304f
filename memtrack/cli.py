"""memtrack command line: typer wiring of the subcommands in memtrack.commands (each
option, its help and environment variable here; what a command does, there)."""

from __future__ import annotations

import functools
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memtrack.capture.choices import (
    Choice,
    OnRingFull,
    ProbePlacement,
    ProbeScope,
    PythonStacks,
)
from memtrack.commands import CommandError

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(
    help="Linux memory-allocation profiler: eBPF capture, offline unwinding, DuckDB tables.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@functools.cache
def err() -> Console:
    """The console of memtrack's own messages on stderr (rich is imported only when there
    is something to say: a capture's start does not pay for it)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def fail(message: str, code: int = 2) -> typer.Exit:
    err().print(f"memtrack: {message}", markup=False, soft_wrap=True)
    return typer.Exit(code)


def show_version(value: bool) -> None:
    if value:
        from memtrack import __version__

        print(f"memtrack {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=show_version,
        help="Print memtrack's version and exit.")] = False,
) -> None:
    """Linux memory-allocation profiler: eBPF capture, offline unwinding, DuckDB tables."""


def switch_values() -> list[str]:
    return ["on", "off"]


# every on/off switch takes its value (--rss off, never --no-rss), completed in the shell
SWITCH: dict[str, Any] = {"metavar": "on|off", "autocompletion": switch_values}


def choice(values: type[Choice]) -> dict[str, Any]:
    """A capture option of a few values (memtrack.capture.options): shown and completed
    as its values, taken as a string and checked by CaptureOptions (its one-line
    error)."""
    return {"metavar": "|".join(values.values()), "autocompletion": values.values}


def on(flag: str, value: str) -> bool:
    """An on/off switch's value, or the one-line error."""
    if value not in ("on", "off"):
        raise fail(f"{flag} {value}: expected on or off")
    return value == "on"


def switch(flag: str, value: str | None) -> bool | None:
    """An on/off switch whose default depends on what it reads: None when not given."""
    return None if value is None else on(flag, value)


HOST_MODULES_HELP = ("Use host files (same build id) for modules the artifact lacks "
                     "(default: on for a run captured on this machine in this boot, else off).")


PYTHON_ONLY_HELP = ("Stacks in the Python view: a stack with Python frames keeps them and "
                    "the native frames its innermost Python frame called; the interpreter's "
                    "own frames around them are folded away (memray's default view).")


def call(run: Callable[..., int], *args: object, **kwargs: object) -> None:
    """Run a command's `run` and exit with its status (2 and one line on CommandError)."""
    try:
        status = run(*args, **kwargs)
    except CommandError as e:
        raise fail(str(e)) from None
    raise typer.Exit(status)


# an artifact reader's option (memtrack.schema.artifact.Artifact.accept_damaged)
AcceptDamaged = Annotated[bool, typer.Option(
    "--accept-damaged", help="Read a table damaged in a capture that ended normally up to "
                             "the damage (else an error).")]


@app.command()
def info(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    accept_damaged: AcceptDamaged = False,
) -> None:
    """Print an artifact's manifest, row counts per file, loss counters and modules."""
    from memtrack.commands import info as cmd

    call(cmd.run, artifact, as_json, accept_damaged)


@app.command()
def doctor() -> None:
    """Check what capture needs on this machine and how to fix what is missing."""
    from memtrack.commands import doctor as cmd

    call(cmd.run)


def capture(
    output: Annotated[Path, typer.Option("-o", "--output", envvar="MEMTRACK_OUTPUT",
                                         help="The artifact directory to write.")],
    force: Annotated[bool, typer.Option("--force", envvar="MEMTRACK_FORCE",
                                        help="Replace OUTPUT if it exists.")] = False,
    stacks: Annotated[str, typer.Option("--stacks", envvar="MEMTRACK_STACKS", **SWITCH,
                                        help="Capture allocation stacks.")] = "on",
    stack_budget: Annotated[int, typer.Option(
        "--stack-budget", envvar="MEMTRACK_STACK_BUDGET",
        help="Most bytes of stack copied per allocation (512..32768); a copy stops at "
             "the stack's end.")] = 32768,
    stack_copies: Annotated[str, typer.Option(
        "--stack-copies", envvar="MEMTRACK_STACK_COPIES", **SWITCH,
        help="Debug: also write every allocation's raw stack copy (stack_copies.arrow), "
             "the proof that each stack record unwinds as its allocations would.")] = "off",
    python_frames: Annotated[str, typer.Option(
        "--python-frames", envvar="MEMTRACK_PYTHON_FRAMES", **SWITCH,
        help="Python frames in the stacks of CPython 3.10 to 3.13 programs (with "
             "--stacks on).")] = "on",
    python_stacks: Annotated[str, typer.Option(
        "--python-stacks", envvar="MEMTRACK_PYTHON_STACKS", **choice(PythonStacks),
        help="Stacks of Python code: python (the allocator, its caller, the Python "
             "frames) or mixed (every native frame, Python frames merged in).")
    ] = PythonStacks.PYTHON.value,
    python_allocators: Annotated[str, typer.Option(
        "--python-allocators", envvar="MEMTRACK_PYTHON_ALLOCATORS", **SWITCH,
        help="Record every object of CPython 3.10+ (PyObject_Malloc, PyMem_Malloc ...: "
             "family pymalloc), not only those over 512 bytes.")] = "off",
    rss: Annotated[str, typer.Option("--rss", envvar="MEMTRACK_RSS", **SWITCH,
                                     help="Record resident memory (kmem:rss_stat).")] = "on",
    track_faults: Annotated[str, typer.Option(
        "--track-faults", envvar="MEMTRACK_TRACK_FAULTS", **SWITCH,
        help="Record user page faults (the anon RSS replay).")] = "off",
    modules: Annotated[str, typer.Option(
        "--modules", envvar="MEMTRACK_MODULES", **SWITCH,
        help="Copy the mapped modules and their debug files into the artifact (off: only "
             "those of a container that the host does not have at their paths).")] = "on",
    start_disabled: Annotated[bool, typer.Option(
        "--start-disabled", envvar="MEMTRACK_START_DISABLED",
        help="Record nothing until 'enable' arrives on the control FIFO.")] = False,
    control_fifo: Annotated[Path | None, typer.Option(
        "--control-fifo", envvar="MEMTRACK_CONTROL_FIFO",
        help="Create the control FIFO here (default: a temporary directory).")] = None,
    probe_placement: Annotated[str, typer.Option(
        "--probe-placement", envvar="MEMTRACK_PROBE_PLACEMENT", **choice(ProbePlacement),
        help="Where entry probes go: auto (a cheap instruction) or entry.")
    ] = ProbePlacement.AUTO.value,
    probe_scope: Annotated[str, typer.Option(
        "--probe-scope", envvar="MEMTRACK_PROBE_SCOPE", **choice(ProbeScope),
        help="Which processes take the allocator probes' traps: auto (only the traced "
             "tree's, where the kernel has uprobe_multi links: 6.6+) or host (every "
             "process on the machine).")] = ProbeScope.AUTO.value,
    events_ring_pages: Annotated[int | None, typer.Option(
        "--events-ring-pages", envvar="MEMTRACK_EVENTS_RING_PAGES", show_default=False,
        help="Events ring size in pages (a power of two; default: 16 MiB per CPU, at "
             "most 1/256 of the memory).")] = None,
    stacks_ring_pages: Annotated[int | None, typer.Option(
        "--stacks-ring-pages", envvar="MEMTRACK_STACKS_RING_PAGES", show_default=False,
        help="Stack ring size in pages (a power of two; default: 32 MiB per CPU, at "
             "most 1/256 of the memory).")] = None,
    on_ring_full: Annotated[str, typer.Option(
        "--on-ring-full", envvar="MEMTRACK_ON_RING_FULL", **choice(OnRingFull),
        help="When a ring fills faster than it drains: pause (stop the producing "
             "process until it has drained: nothing lost) or drop (count the lost "
             "records).")] = OnRingFull.PAUSE.value,
    fail_on_loss: Annotated[bool, typer.Option(
        "--fail-on-loss", envvar="MEMTRACK_FAIL_ON_LOSS",
        help="Exit with status 1 when any event was lost.")] = False,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", envvar="MEMTRACK_TIMEOUT",
        help="Kill CMD after this many seconds.")] = None,
    pid: Annotated[list[int] | None, typer.Option(
        "--pid", envvar="MEMTRACK_PID", show_default=False,
        help="Attach to this running process (repeatable) instead of running CMD, until "
             "the duration ends, Ctrl-C/SIGTERM (status 128 + it) or it exits.")] = None,
    duration: Annotated[float | None, typer.Option(
        "--duration", envvar="MEMTRACK_DURATION",
        help="With --pid: detach after this many seconds.")] = None,
    cmd: Annotated[list[str] | None, typer.Argument(
        help="The command to run (after --); none with --pid.", show_default=False)] = None,
    program_cache: Annotated[str, typer.Option(
        "--program-cache", envvar="MEMTRACK_PROGRAM_CACHE",
        help="Where compiled BPF programs are kept (default $XDG_CACHE_HOME/memtrack/bpf), "
             "or off.")] = "",
) -> None:
    """Record every allocation of CMD and its descendants, or of running processes and
    theirs (--pid): capture -o OUT.memtrack -- CMD..."""
    from memtrack.commands import capture as cmd_

    _ran["capture"] = True
    call(cmd_.run, cmd or [], output, pids=pid or [], duration=duration, force=force,
         stacks=on("--stacks", stacks),
         stack_budget=stack_budget, stack_copies=on("--stack-copies", stack_copies),
         python_frames=on("--python-frames", python_frames), python_stacks=python_stacks,
         python_allocators=on("--python-allocators", python_allocators),
         rss=on("--rss", rss), track_faults=on("--track-faults", track_faults),
         modules=on("--modules", modules), start_disabled=start_disabled, control_fifo=control_fifo,
         probe_placement=probe_placement, probe_scope=probe_scope,
         events_ring_pages=events_ring_pages,
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
    "(one line) to the first, read 'ok' from the second; 'begin TID NAME' / 'end TID' "
    "mark a region of thread TID, 'label TID KEY=VALUE' says something of it (limit.peak="
    "BYTES: memtrack check) (helpers: python3 -m memtrack.control prints where "
    "memtrack_control.h and .py are; pytest: each test a region, memtrack_limit markers "
    "(or pytest-memray's limit_memory, limit_leaks) its limits)."))(capture)


@app.command()
def process(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="The DuckDB file to write (optional with --dataset).")] = None,
    parquet: Annotated[
        Path | None,
        typer.Option("--parquet", help="Also write every table as Parquet, one directory each."),
    ] = None,
    host_modules: Annotated[str | None, typer.Option(
        "--host-modules", **SWITCH, show_default=False,
        help=HOST_MODULES_HELP)] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", envvar="MEMTRACK_CACHE_DIR",
                     help="Per-build-id symbol cache [default: $XDG_CACHE_HOME/memtrack]."),
    ] = None,
    cache: Annotated[str, typer.Option(
        "--cache", **SWITCH, help="Keep symbols per build id (off: parse every "
                                        "module's DWARF afresh).")] = "on",
    force: Annotated[bool, typer.Option(
        "--force", help="Replace the run database (and its metadata, Parquet) and the "
                        "dataset's run of that id if they exist.")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No progress, no summary.")] = False,
    dataset: Annotated[str | None, typer.Option(
        "--dataset", metavar="DIR",
        help="Append the run to this Parquet dataset (DIR/TABLE/run=ID/; or a URI: "
             "s3://bucket/DIR, file:///DIR).")] = None,
    run_id: Annotated[str | None, typer.Option(
        "--run-id", help="The run's id in the dataset (letters, digits, . _ -).")] = None,
    label: Annotated[list[str] | None, typer.Option(
        "--label", help="key=value said of the run (commit=..., branch=...); repeatable; "
                        "kept in meta and in the dataset's runs.")] = None,
    jobs: Annotated[
        int | None,
        typer.Option("-j", "--jobs", envvar="MEMTRACK_JOBS",
                     help="Processes that unwind stacks, and DuckDB's threads; the tables "
                          "are the same whatever N [default: the machine's cores]."),
    ] = None,
    python_frames: Annotated[str, typer.Option(
        "--python-frames", **SWITCH, help="Merge the captured Python frames into the stacks "
                                          "(off: native frames only).")] = "on",
    accept_damaged: AcceptDamaged = False,
) -> None:
    """Decode, unwind, symbolize and load an artifact into DuckDB tables (and/or a run
    dataset).

    The memory it needs grows with the distinct stacks, not with the events: the events
    go through scratch files beside the output while it runs (about 100 bytes an event,
    removed at the end).
    """
    from memtrack.commands import process as cmd

    call(cmd.run, artifact, output, parquet=parquet,
         host_modules=switch("--host-modules", host_modules), cache_dir=cache_dir,
         no_cache=not on("--cache", cache), quiet=quiet,
         say=lambda line: err().print(line, markup=False, soft_wrap=True),
         dataset=dataset, run_id=run_id, labels=label or [], force=force, jobs=jobs,
         python_frames=on("--python-frames", python_frames), accept_damaged=accept_damaged)


@app.command()
def report(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    fmt: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
    pid: Annotated[int | None, typer.Option("--pid", help="Only this process.")] = None,
    top: Annotated[int, typer.Option("--top", help="Locations per section, and regions "
                                     "(most bytes allocated first).")] = 10,
    html: Annotated[
        Path | None, typer.Option("--html", help="Also write a self-contained HTML page here.")
    ] = None,
    region: Annotated[str | None, typer.Option(
        "--region", help="Only the region (benchmark, test) of this name: its figures and "
                         "allocation sites.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the HTML page if it "
                                                        "exists.")] = False,
    python_only: Annotated[bool, typer.Option("--python-only", help=PYTHON_ONLY_HELP)] = False,
) -> None:
    """The heaptrack-style report of a processed run."""
    from memtrack.commands import report as cmd

    call(cmd.run, run, fmt, pid, top, html, sys.stdout, region, force=force,
         python_only=python_only)


@app.command()
def query(
    args: Annotated[list[str], typer.Argument(
        metavar="[RUN] SQL", help="A run database written by `memtrack process` and the SQL "
                                  "to run; with --dataset, the SQL alone.")],
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    dataset: Annotated[str | None, typer.Option(
        "--dataset", metavar="DIR", help="Query every run of this dataset (a directory or a URI: "
                          "s3://bucket/DIR, file:///DIR; a view per table, with its run "
                          "column, and runs).")] = None,
    allow_files: Annotated[bool, typer.Option(
        "--allow-files", help="Let the SQL read and write files (read_csv, COPY ... TO).")
    ] = False,
    python_only: Annotated[bool, typer.Option(
        "--python-only", help=PYTHON_ONLY_HELP + " The SQL sees stack_frames, stacks and "
                              "backtraces folded so, and every view over them (a run "
                              "database only).")] = False,
) -> None:
    """Run SQL against a processed run (or a dataset of runs; read-only, no file access)
    and print the result."""
    from memtrack.commands import query as cmd

    call(cmd.run, args, fmt, sys.stdout, dataset, allow_files, python_only)


@app.command()
def diff(
    base: Annotated[str, typer.Argument(
        metavar="BASE", help="The base run: a run database, or with --dataset a run id.")],
    head: Annotated[str, typer.Argument(metavar="HEAD", help="The head run, the same way.")],
    dataset: Annotated[str | None, typer.Option(
        "--dataset", metavar="DIR",
        help="BASE and HEAD are run ids of this dataset (a directory or a URI).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="text, json or markdown.")] = "text",
    pid: Annotated[str | None, typer.Option(
        "--pid", help="Only this process: PID in both runs, or BASE_PID:HEAD_PID.")] = None,
    process: Annotated[str | None, typer.Option(
        "--process", help="Only the processes of this name (comm) in each run.")] = None,
    metric: Annotated[list[str] | None, typer.Option(
        "--metric", show_default="all",
        help="Site sections: allocated, calls, peak, leaked, temporary (repeatable or "
             "comma-separated).")] = None,
    top: Annotated[int, typer.Option("--top", help="Sites per list.")] = 10,
    fail_above: Annotated[float | None, typer.Option(
        "--fail-above", metavar="PCT",
        help="Exit with status 1 when a gated total grew by more than PCT percent, 3 when "
             "the runs are not comparable (data lost, or different allocator functions "
             "refused).")] = None,
    fail_on: Annotated[list[str] | None, typer.Option(
        "--fail-on", show_default="peak,allocated,leaked",
        help="The gated totals: peak, allocated, leaked, calls, temporary, rss (repeatable "
             "or comma-separated).")] = None,
    python_only: Annotated[bool, typer.Option(
        "--python-only", help=PYTHON_ONLY_HELP + " Both runs folded so.")] = False,
) -> None:
    """What changed between two runs: totals, processes and regions by name, and the
    allocation sites whose cost changed, matched across builds by call path."""
    from memtrack.commands import diff as cmd

    call(cmd.run, base, head, dataset=dataset, fmt=fmt, pid=pid, process=process,
         metrics=metric or [], top=top, fail_above=fail_above, fail_on=fail_on or [],
         python_only=python_only, out=sys.stdout)


@app.command()
def history(
    dataset: Annotated[str, typer.Option(
        "--dataset", metavar="DIR",
        help="The run dataset (DIR/TABLE/run=ID/, or a URI: s3://bucket/DIR, file:///DIR) "
             "whose runs to follow.")],
    fmt: Annotated[str, typer.Option("--format", help="text, json or markdown.")] = "text",
    order_by: Annotated[str | None, typer.Option(
        "--order-by", metavar="LABEL", show_default="the runs' start time",
        help="Order the runs by this label (--label of process, e.g. commit_time): "
             "numerically when every value is a number, else as text.")] = None,
    tolerance: Annotated[float | None, typer.Option(
        "--tolerance", metavar="PCT", show_default="5",
        help="A noisy figure (peak heap, peak RSS) steps when it changes by more than "
             "PCT percent; calls, bytes allocated, average size and leaked step on any "
             "change.")] = None,
    last: Annotated[int | None, typer.Option(
        "--last", metavar="N", help="Only the last N runs in order.")] = None,
    fail_on_step: Annotated[bool, typer.Option(
        "--fail-on-step", help="Exit with status 1 when the latest run stepped, 3 when it "
                               "or the run before it lost data (not comparable).")] = False,
    html: Annotated[Path | None, typer.Option(
        "--html", help="Also write a self-contained HTML page of charts here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the HTML page if it "
                                                        "exists.")] = False,
) -> None:
    """Every benchmark (region) and process name across the runs of a dataset: its peak
    heap, bytes allocated, calls, average size, leaked and peak RSS per run, and the
    runs where a figure stepped."""
    from memtrack.commands import history as cmd

    call(cmd.run, dataset, fmt=fmt, order_by=order_by, tolerance=tolerance, last=last,
         fail_on_step=fail_on_step, html=html, force=force, out=sys.stdout)


@app.command()
def compact(
    dataset: Annotated[str, typer.Option(
        "--dataset", metavar="DIR",
        help="The local run dataset whose runs to merge (DIR/TABLE/run=ID/, or file:///DIR).")],
) -> None:
    """Merge the small files of a dataset's runs: each table's runs into one compacted
    batch (DIR/TABLE/batch=_c.../), `run` then in the files; every query reads the same
    rows before and after, and appends go on (docs/dataset.md)."""
    from memtrack.commands import compact as cmd

    call(cmd.run, dataset, out=sys.stdout)


@app.command()
def check(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    fmt: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
    pid: Annotated[int | None, typer.Option("--pid", help="Only this process.")] = None,
) -> None:
    """Hold each region to its limits (pytest: @pytest.mark.memtrack_limit(peak="24 MB",
    leaked="0 B", leaked_per_stack=..., allocated=..., calls=...), limit_memory("24 MB"),
    limit_leaks("1 KB")): print every limit exceeded with the region's figure; exit
    status 1 when one was, 3 when the run lost data (no verdict)."""
    from memtrack.commands import check as cmd

    call(cmd.run, run, fmt, pid, sys.stdout)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="A run database written by `memtrack process`.")],
    fmt: Annotated[str, typer.Option("--format", help="folded, pprof or speedscope.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The file to write.")],
    metric: Annotated[
        str,
        typer.Option("--metric", help="allocated, calls, peak, leaked or temporary (pprof: "
                                      "the default sample type; all are in the profile)."),
    ] = "allocated",
    pid: Annotated[int | None, typer.Option("--pid", help="Only this process.")] = None,
    pids: Annotated[str, typer.Option(
        "--pids", **SWITCH, help="Tell processes apart by pid: each stack's root is `name "
                                 "(pid)` (folded, speedscope), each pprof sample has a pid "
                                 "label. Off: by name, so that two runs' stacks match.")] = "off",
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
    python_only: Annotated[bool, typer.Option("--python-only", help=PYTHON_ONLY_HELP)] = False,
) -> None:
    """Export a processed run as folded stacks, pprof or speedscope."""
    from memtrack.commands import export as cmd

    call(cmd.run, run, fmt, output, metric, pid, pids=on("--pids", pids), force=force,
         python_only=python_only)


@app.command()
def symbolize(
    module: Annotated[Path, typer.Option("--module", help="The ELF file (PIE, shared or not).")],
    addresses: Annotated[list[str], typer.Argument(help="ELF virtual addresses (0x hex).")],
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", help="Cache directory [default: $XDG_CACHE_HOME/memtrack]."),
    ] = None,
    cache: Annotated[str, typer.Option(
        "--cache", **SWITCH, help="Read and write the cache.")] = "on",
) -> None:
    """Print the frames of addresses in a module, innermost first (llvm-symbolizer --inlines)."""
    from memtrack.commands import symbolize as cmd

    call(cmd.run, module, addresses, cache_dir, not on("--cache", cache), sys.stdout,
         sys.stderr)


@app.command("unwind")
def unwind_record(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory (NAME.memtrack).")],
    record: Annotated[str, typer.Option("--record", help="The stack hash (hex or decimal).")],
    host_modules: Annotated[str | None, typer.Option(
        "--host-modules", **SWITCH, show_default=False,
        help=HOST_MODULES_HELP)] = None,
    accept_damaged: AcceptDamaged = False,
) -> None:
    """Unwind one stack record and print its frames with method (regs, cfi, fp, fp-kernel)
    and symbol."""
    from memtrack.commands import unwind as cmd

    call(cmd.run, artifact, record, switch("--host-modules", host_modules), sys.stdout,
         accept_damaged, sys.stderr)


# the commands run by main() so far (run_as_program ends the process at once after capture)
_ran: dict[str, bool] = {}


def main() -> None:
    """The command line: a usage error is one line too (typer draws a box), naming the
    help of the command it concerns."""
    try:
        status = app(standalone_mode=False)
    except KeyboardInterrupt:
        err().print("memtrack: interrupted")
        sys.exit(130)
    except typer.Abort:
        sys.exit(1)
    except typer.TyperException as e:  # click's usage errors
        ctx = getattr(e, "ctx", None)
        where = ctx.command_path if ctx is not None else "memtrack"
        message = " ".join(e.format_message().split())  # type: ignore[attr-defined]
        if message:  # none after the help a bare command prints
            err().print(f"memtrack: {message} (`{where} -h` for help)", markup=False,
                      soft_wrap=True)
        sys.exit(getattr(e, "exit_code", 2))
    sys.exit(status if isinstance(status, int) else 0)



def run_as_program() -> None:
    """main() as the whole process (the launcher, python -m memtrack.cli). After a
    capture the process ends as soon as main() returns: the artifact is closed and its
    threads are gone (what releases the probes in the background is a process of its
    own), and the interpreter's teardown of numpy, pyarrow and the rest (~0.1 s) is
    left out (the exit handlers still run; not under a profiler or coverage, which
    write their results at the interpreter's exit)."""
    try:
        main()
    except SystemExit as e:
        if not _ran.get("capture") or not isinstance(e.code, int) or \
                sys.gettrace() is not None or sys.getprofile() is not None:
            raise
        import atexit
        import os

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(e.code)


if __name__ == "__main__":
    run_as_program()
