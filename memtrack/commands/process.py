"""`memtrack process ARTIFACT -o RUN.duckdb`: decode, unwind, symbolize and load an
artifact (memtrack.process.pipeline), then print what was done and lost."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memtrack.commands import CommandError, check_output, give_to_invoking_user

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


def run(artifact: Path, output: Path, *, parquet: Path | None, host_modules: bool,
        cache_dir: Path | None, no_cache: bool, force: bool, quiet: bool,
        say: Callable[[str], None]) -> int:
    import duckdb

    from memtrack.process.pipeline import ProcessError, process
    from memtrack.schema.artifact import ArtifactError
    from memtrack.symbolize import default_cache_dir

    check_outputs(output, parquet, force)
    try:
        summary = process(
            artifact, output, parquet_dir=parquet, host_modules=host_modules,
            cache_dir=None if no_cache else (cache_dir or default_cache_dir()),
            progress=False if quiet else None,
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
        for line in summary.lines():
            say(line)
    return 0
