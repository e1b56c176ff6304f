"""The capture side: everything that runs on the traced machine, as root.

The package is also the Python API's `memtrack.capture(cmd, output, ...)`: calling it
runs `capture` below (the module's class is made callable at the end of this file)."""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memtrack.capture.tracker import CaptureResult


def capture(cmd: Sequence[str], output: Path | str, *, overwrite: bool = False,
            env: dict[str, str] | None = None, cwd: Path | str | None = None,
            timeout: float | None = None, **options: Any) -> CaptureResult:
    """Run `cmd` (as root) and record every allocation of it and its descendants into
    the artifact `output`; returns once it has exited, as `memtrack capture` does but
    printing nothing. `options`: CaptureOptions' fields (`stacks=False`,
    `on_ring_full="drop"`, ...), over what the MEMTRACK_<NAME> variables of this process
    set (CaptureOptions.from_env), checked as the command line checks them; `env`: the
    command's environment (default: this process's). Raises CaptureError (one line).

        result = memtrack.capture(["./bench", "--quick"], "run.memtrack")
        assert result.status == 0 and not result.nonzero_losses()
    """
    from memtrack.capture.options import CaptureError, CaptureOptions
    from memtrack.capture.tracker import Tracker, find_command

    try:
        opts = CaptureOptions.from_env(**options)
    except TypeError as e:
        raise CaptureError(f"capture: {e}") from None
    if not cmd:
        raise CaptureError("no command given")
    find_command(cmd[0], env, cwd)
    with Tracker(opts) as tracker:
        return tracker.spawn(list(cmd), output, env=env, cwd=cwd,
                             overwrite=overwrite).wait(timeout=timeout)


class _Package(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> CaptureResult:
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _Package
