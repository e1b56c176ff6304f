"""The `memtrack` launcher (and `python -m memtrack`): `memtrack --version` is answered
here, before the command line (typer) or anything it loads (rich, numpy, pyarrow) is
imported; every other command line goes to memtrack.cli (run_as_program)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    if sys.argv[1:] == ["--version"] and "_MEMTRACK_COMPLETE" not in os.environ:
        from memtrack import __version__

        print(f"memtrack {__version__}")
        sys.exit(0)
    from memtrack.cli import run_as_program

    run_as_program()


if __name__ == "__main__":
    main()
