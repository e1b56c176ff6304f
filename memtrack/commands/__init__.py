"""The subcommands, one module each with a `run(...)` that takes plain values, writes
its output and returns the exit status; memtrack.cli wires them to the command line.
A command that cannot do what it was asked raises CommandError (one line)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # capture never opens a database: it does not pay duckdb's import
    import duckdb


class CommandError(Exception):
    """The message is one line for the user (`memtrack: MESSAGE`, exit status 2)."""


# The bounds of the numeric options (an unbounded --top reached DuckDB as a value
# beyond BIGINT: a traceback).
MAX_TOP = 1_000_000  # --top: rows per section
MAX_PID = (1 << 32) - 1  # --pid: a pid column is UINTEGER
MAX_JOBS = 1024  # --jobs
MAX_SECONDS = 10**7  # --timeout, --duration: 115 days


def bounded(option: str, value: float, low: float, high: float) -> float:
    """`value` of `option` if low <= value <= high (not NaN), else CommandError."""
    if not low <= value <= high:
        raise CommandError(f"{option}: expected {low} to {high}, got {value}")
    return value


def check_output(path: Path, force: bool) -> None:
    """An output path a command may write: its directory exists (nothing creates it),
    and what is there already is replaced only with --force; else CommandError."""
    parent = path.parent
    try:
        if not parent.is_dir():
            raise CommandError(f"{path}: no such directory {parent}" if not parent.exists()
                               else f"{path}: {parent} is not a directory")
        exists = path.exists()
    except PermissionError:
        raise CommandError(f"{path}: permission denied") from None
    if exists and not force:
        raise CommandError(f"{path}: already exists (use --force to replace it)")


def open_run_db(path: Path, *, files: bool = False,
                python_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A run database opened for reading (memtrack.schema.ddl.open_run: no file access
    unless `files`; `python_only`: its stacks in the Python view), or CommandError (an
    artifact given instead says to process it first)."""
    from memtrack.schema.ddl import RunError, open_run

    try:
        artifact = (path / "manifest.json").is_file()
    except PermissionError:
        raise CommandError(f"{path}: permission denied") from None
    if artifact:
        raise CommandError(f"{path} is a capture artifact, not a run database: run "
                           f"`memtrack process {path} -o {path.with_suffix('.duckdb')}` first")
    try:
        return open_run(path, files=files, python_only=python_only)
    except RunError as e:
        raise CommandError(str(e)) from None


def require_privileges(command: str, usage: str = "") -> None:
    """CommandError (one line: what is missing, how to get it) unless this process may
    load BPF programs and attach uprobes and tracepoints."""
    from memtrack.capture.doctor import check_privileges

    c = check_privileges()
    if not c.ok:
        raise CommandError(
            f"{command} needs root: loading BPF programs and attaching uprobes takes "
            f"CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN), and this process has "
            f"{c.detail}: run `sudo memtrack {command}{usage}`")


def give_to_invoking_user(path: Path) -> None:
    """Under sudo, `path` (and everything under it) becomes the invoking user's
    (SUDO_UID/SUDO_GID) and readable by them: what a root capture or process wrote is
    theirs to read, process and delete. Symbolic links are not followed."""
    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if os.geteuid() != 0 or not uid.isdigit() or not path.exists():
        return
    owner = (int(uid), int(gid) if gid.isdigit() else -1)
    todo = [path]
    while todo:
        p = todo.pop()
        try:
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                os.lchown(p, *owner)
                continue
            os.chown(p, *owner)
            is_dir = stat.S_ISDIR(st.st_mode)
            want = stat.S_IRUSR | stat.S_IWUSR | (stat.S_IXUSR if is_dir else 0)
            if st.st_mode & want != want:
                os.chmod(p, stat.S_IMODE(st.st_mode) | want)
            if is_dir:
                todo.extend(p.iterdir())
        except OSError as e:  # e.g. root squashed on NFS: the output stays, said once
            sys.stderr.write(f"memtrack: warning: {p}: not given to uid {uid}: "
                             f"{e.strerror or e}\n")
            return
