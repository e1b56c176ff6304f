"""`memtrack process ARTIFACT -o RUN.duckdb`: decode, unwind, symbolize and load an
artifact (memtrack.process.pipeline), then print what was done and lost."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memtrack.commands import CommandError


def run(artifact: Path, output: Path, *, parquet: Path | None, host_modules: bool,
        cache_dir: Path | None, no_cache: bool, quiet: bool,
        say: Callable[[str], None], python_frames: str = "on") -> int:
    import duckdb

    from memtrack.process.pipeline import ProcessError, process
    from memtrack.schema.artifact import ArtifactError
    from memtrack.symbolize import default_cache_dir

    if python_frames not in ("on", "off"):
        raise CommandError(f"--python-frames {python_frames}: expected on or off")
    try:
        summary = process(
            artifact, output, parquet_dir=parquet, host_modules=host_modules,
            cache_dir=None if no_cache else (cache_dir or default_cache_dir()),
            progress=False if quiet else None, python_frames=python_frames == "on",
        )
    except (ArtifactError, ProcessError) as e:
        raise CommandError(str(e)) from None
    except duckdb.IOException as e:
        raise CommandError(f"{output}: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise CommandError(f"{e.filename or output}: {e.strerror or e}") from None
    if not quiet:
        for line in summary.lines():
            say(line)
    return 0
