"""`memtrack compact --dataset DIR`: the runs' own files of every table of a local
dataset merged into one compacted batch per table (memtrack.process.dataset.compact),
with what it did on one line."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from memtrack.commands import CommandError


def run(dataset: str | Path, out: TextIO) -> int:
    from memtrack.process.dataset import compact
    from memtrack.schema.dataset import DatasetError

    try:
        done = compact(dataset)
    except DatasetError as e:
        raise CommandError(str(e)) from None
    except OSError as e:  # the disk full, a directory it may not write
        raise CommandError(f"compact: {e.filename or dataset}: {e.strerror or e}") from None
    if not done.tables:
        out.write(f"{dataset}: nothing to compact (no run outside a compacted batch)\n")
        return 0
    out.write(f"{dataset}: {done.runs} run{'s' if done.runs != 1 else ''} compacted in "
              f"{done.tables} table{'s' if done.tables != 1 else ''}: {done.files_before} "
              f"files -> {done.files_after}\n")
    return 0
