"""The `memtrack` launcher (and `python -m memtrack`): `memtrack --version` is answered
here, before the command line (typer) or anything it loads (rich, numpy, pyarrow) is
imported; every other command line goes to memtrack.cli (run_as_program)."""

from __future__ import annotations

import os
import sys


def version() -> str:
    """memtrack's installed version (what the manifest records as memtrack_version)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("memtrack")
    except PackageNotFoundError:
        return "0+unknown"


def main() -> None:
    if sys.argv[1:] == ["--version"] and "_MEMTRACK_COMPLETE" not in os.environ:
        print(f"memtrack {version()}")
        sys.exit(0)
    from memtrack.cli import run_as_program

    run_as_program()


if __name__ == "__main__":
    main()
