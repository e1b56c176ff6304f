"""The processing side: an artifact into a run database, on any machine, no root.

The package is also the Python API's `memtrack.process(artifact, output, ...)`: calling
it runs `process` below (the module's class is made callable at the end of this
file)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memtrack.process.pipeline import Summary


def process(artifact: Path | str, output: Path | str, **options: Any) -> Summary:
    """Turn an artifact into the run database `output`, as `memtrack process` does but
    drawing no progress unless `progress=True`; `options` as
    memtrack.process.pipeline.process takes them (`jobs`, `cache_dir`, `labels`,
    `host_modules`, ...). Returns the summary (`.warnings`, `.counters`, rows). Raises
    ArtifactError (one line) for an artifact it cannot read.

        summary = memtrack.process("run.memtrack", "run.duckdb", jobs=2)
    """
    from memtrack.process.pipeline import process as pipeline

    return pipeline(artifact, output, **{"progress": False, **options})


class _Package(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Summary:
        return process(*args, **kwargs)


sys.modules[__name__].__class__ = _Package
