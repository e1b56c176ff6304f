"""memtrack: every heap allocation of a Linux program, recorded with eBPF and turned into
DuckDB tables. `memtrack.capture`, `memtrack.process` and `memtrack.open_run` are the
Python API; they are imported on first use, so that importing memtrack
costs nothing:

    result = memtrack.capture(["./bench"], "run.memtrack")  # as root
    memtrack.process("run.memtrack", "run.duckdb")
    run = memtrack.open_run("run.duckdb")
"""

from typing import Any

# The one place the version is written (pyproject.toml reads it from here): the
# launcher answers `memtrack --version` with it and the manifest records it, with no
# importlib.metadata (~0.1 s of imports).
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """memtrack.capture and memtrack.process are their packages (callable), imported on
    first use; memtrack.open_run is the report reader's."""
    import importlib

    if name in ("capture", "process"):
        return importlib.import_module(f"memtrack.{name}")
    if name == "open_run":
        from memtrack.report import open_run

        return open_run
    raise AttributeError(f"module 'memtrack' has no attribute {name!r}")
