"""Runs memtrack command lines under watch, in one interpreter (tests/test_hostile.py): a
Python audit hook sees every file the interpreter opens, and each one read outside the
allowed roots or written outside the writable ones is appended to $HOSTILE_VIOLATIONS
(the roots are $HOSTILE_READ and $HOSTILE_WRITE, colon-separated). The address space is
limited by the parent (RLIMIT_AS), the time by its timeout.

    python hostile_run.py OUTDIR memtrack ARGS... [:: memtrack ARGS...] [::? memtrack ...]

Command i writes OUTDIR/i.out, OUTDIR/i.err and OUTDIR/i.code (its exit status); a
command after `::?` runs only if the one before it exited 0.
"""

from __future__ import annotations

import os
import sys
import traceback

_READ = [os.path.realpath(p) for p in os.environ["HOSTILE_READ"].split(":") if p]
_WRITE = [os.path.realpath(p) for p in os.environ["HOSTILE_WRITE"].split(":") if p]
_OUT = os.environ["HOSTILE_VIOLATIONS"]
_busy = False


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _hook(event: str, args: tuple) -> None:
    global _busy
    if event != "open" or _busy:
        return
    path, mode, flags = args
    if isinstance(path, int) or path is None:
        return
    path = os.fsdecode(path)
    walk = os.O_DIRECTORY | os.O_NOFOLLOW
    if isinstance(flags, int) and flags & walk == walk and "/" not in path:
        return  # a directory opened by name under a dir_fd (the event has no dir_fd),
        # one component of a walk that follows no symbolic link: nothing is read
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    real = os.path.realpath(os.path.abspath(path))
    ok = _inside(real, _WRITE) if writing else _inside(real, _READ + _WRITE)
    if not ok:
        _busy = True
        try:
            with open(_OUT, "a") as f:
                f.write(f"{'write' if writing else 'read'} {path} -> {real}\n")
        finally:
            _busy = False


def _run(argv: list[str], out: str) -> int:
    from memtrack.cli import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    files = [os.open(f"{out}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                  os.open(f"{out}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)]
    os.dup2(files[0], 1)
    os.dup2(files[1], 2)
    sys.argv = argv
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a crash: its traceback is what the test sees
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, *files):
            os.close(fd)
    return code


def main() -> None:
    outdir, *rest = sys.argv[1:]
    _WRITE.append(os.path.realpath(outdir))  # the results written here are the runner's
    chains: list[tuple[str, list[str]]] = [("::", [])]
    for a in rest:
        if a in ("::", "::?"):
            chains.append((a, []))
        else:
            chains[-1][1].append(a)
    sys.addaudithook(_hook)
    code = 0
    for i, (sep, argv) in enumerate(chains):
        if sep == "::?" and code != 0:
            break
        code = _run(argv, os.path.join(outdir, str(i)))
        with open(os.path.join(outdir, f"{i}.code"), "w") as f:
            f.write(str(code))


main()
