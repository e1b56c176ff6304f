"""`memtrack process ARTIFACT -o RUN.duckdb`: decode, unwind, symbolize and load an
artifact (memtrack.process.pipeline), then print what was done and lost. With
`--dataset DIR --run-id ID` the run is also (or only, without -o) appended to a run
dataset (memtrack.process.dataset)."""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from memtrack.commands import MAX_JOBS, CommandError, bounded, check_output, give_to_invoking_user

DUCKDB_MAGIC = b"DUCK"  # at offset 8 of every DuckDB file


def check_outputs(output: Path, parquet: Path | None, force: bool) -> None:
    """Nothing that exists is replaced without --force, and with it only a run database
    (never some other file given as -o by mistake), its metadata and a Parquet directory."""
    from memtrack.process.metadata import path_for

    if output.is_dir():
        raise CommandError(f"{output}: is a directory, not a run database path")
    check_output(output, force)
    if output.is_file():
        with output.open("rb") as f:
            if f.read(12)[8:] != DUCKDB_MAGIC:
                raise CommandError(f"{output}: exists and is not a run database: not "
                                   "replaced, even with --force")
    check_output(path_for(output), force)
    if parquet is not None:
        check_output(parquet, force or (parquet.is_dir() and not any(parquet.iterdir())))


LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)=(.*)", re.S)


def parse_labels(labels: Sequence[str]) -> dict[str, str]:
    """`--label key=value` options as a dict (a key given twice is refused)."""
    out: dict[str, str] = {}
    for text in labels:
        m = LABEL.fullmatch(text)
        if not m:
            raise CommandError(f"--label: expected key=value (a key of letters, digits, "
                               f"'_', '.', '-'), got {text!r}")
        if m[1] in out:
            raise CommandError(f"--label: {m[1]} given twice")
        out[m[1]] = m[2]
    return out


@contextmanager
def ended_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end `process` as Ctrl-C does, through every cleanup (no spill,
    no half-written database is left): SystemExit(128 + the signal). A SIGKILL leaves
    them; the next run that writes the same database deletes them
    (memtrack.process.load.remove_leftovers)."""
    def ended(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()  # signals go there only
    before = {s: signal.signal(s, ended) for s in (signal.SIGTERM, signal.SIGHUP) if main}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def run(artifact: Path, output: Path | None, *, parquet: Path | None, host_modules: bool | None,
        cache_dir: Path | None, no_cache: bool, quiet: bool,
        say: Callable[[str], None], dataset: str | Path | None = None, run_id: str | None = None,
        labels: Sequence[str] = (), force: bool = False, jobs: int | None = None,
        python_frames: bool = True, accept_damaged: bool = False) -> int:
    with ended_by_signals():
        return _run(artifact, output, parquet=parquet, host_modules=host_modules,
                    cache_dir=cache_dir, no_cache=no_cache, quiet=quiet, say=say,
                    dataset=dataset, run_id=run_id, labels=labels, force=force, jobs=jobs,
                    python_frames=python_frames, accept_damaged=accept_damaged)


def _run(artifact: Path, output: Path | None, *, parquet: Path | None, host_modules: bool | None,
         cache_dir: Path | None, no_cache: bool, quiet: bool,
         say: Callable[[str], None], dataset: str | Path | None, run_id: str | None,
         labels: Sequence[str], force: bool, jobs: int | None, python_frames: bool,
         accept_damaged: bool) -> int:
    from pyarrow.fs import LocalFileSystem

    from memtrack.schema.dataset import DatasetError

    meta_labels = parse_labels(labels)
    if jobs is not None:
        bounded("--jobs", jobs, 1, MAX_JOBS)
    if (dataset is None) != (run_id is None):
        raise CommandError("--dataset and --run-id go together")
    if output is None and dataset is None:
        raise CommandError("give -o RUN.duckdb, --dataset DIR --run-id ID, or both")
    if dataset is None or run_id is None:
        assert output is not None
        return _process(artifact, output, parquet, host_modules, cache_dir, no_cache,
                        force, quiet, say, meta_labels, jobs,
                        python_frames, accept_damaged)[0]
    from memtrack.process.dataset import append_run, check_target
    from memtrack.schema.dataset import Remote, where

    try:
        place = where(dataset)
        check_target(place, run_id, force)
        if not isinstance(place, Remote):
            place.mkdir(parents=True, exist_ok=True)
    except DatasetError as e:
        raise CommandError(str(e)) from None
    except OSError as e:
        raise CommandError(f"{e.filename or dataset}: {e.strerror or e}") from None
    # without -o the run database is written beside the dataset's files (a hidden
    # directory no engine reads; a temporary one for a dataset behind a URI), then removed
    work = None if output is not None else Path(tempfile.mkdtemp(
        prefix=".process-" if not isinstance(place, Remote) else "memtrack-process-",
        dir=None if isinstance(place, Remote) else place))
    try:
        db = output if work is None else work / "run.duckdb"
        status, metadata = _process(artifact, db, parquet, host_modules, cache_dir, no_cache,
                                    force, quiet, say, meta_labels, jobs,
                                    python_frames, accept_damaged,
                                    shown=None if work is None else f"{dataset} run {run_id}")
        try:
            replaced = append_run(place, run_id, db, metadata=metadata, force=force)
        except DatasetError as e:
            raise CommandError(str(e)) from None
        except OSError as e:
            raise CommandError(f"{e.filename or dataset}: {e.strerror or e}") from None
        local = Path(place.path) if isinstance(place, Remote) and isinstance(
            place.fs, LocalFileSystem) else None if isinstance(place, Remote) else place
        for part in sorted(local.glob(f"*/run={run_id}")) if local else ():  # this run's only
            give_to_invoking_user(part)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    if not quiet:
        say(f"{dataset}: run {run_id} {'replaced' if replaced else 'appended'}")
    return status


def _process(artifact: Path, output: Path, parquet: Path | None, host_modules: bool | None,
             cache_dir: Path | None, no_cache: bool, force: bool, quiet: bool,
             say: Callable[[str], None], labels: dict[str, str], jobs: int | None,
             python_frames: bool, accept_damaged: bool,
             shown: str | None = None) -> tuple[int, Path | None]:
    """Run the pipeline; the exit status and the memory_metadata.json it wrote. `shown`:
    the name the summary gives the run (default: the database written). Nothing that
    exists is replaced without `force`."""
    import duckdb

    from memtrack.process.pipeline import ProcessError, process
    from memtrack.schema.artifact import ArtifactError
    from memtrack.symbolize import default_cache_dir

    check_outputs(output, parquet, force)
    try:
        summary = process(
            artifact, output, parquet_dir=parquet, host_modules=host_modules,
            cache_dir=None if no_cache else (cache_dir or default_cache_dir()),
            progress=False if quiet else None, labels=labels, jobs=jobs,
            python_frames=python_frames, accept_damaged=accept_damaged,
        )
    except (ArtifactError, ProcessError) as e:
        raise CommandError(str(e)) from None
    except duckdb.IOException as e:
        raise CommandError(f"{output}: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise CommandError(f"{e.filename or output}: {e.strerror or e}") from None
    for written in (output, summary.metadata, parquet):
        if written is not None:
            give_to_invoking_user(written)
    if not quiet:
        if shown is not None:
            summary.out_db = Path(shown)
        for line in summary.lines():
            say(line)
    return 0, summary.metadata
