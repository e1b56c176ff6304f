"""What capture reads from /proc about the traced processes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class MapLine:
    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str


def parse_maps(text: str) -> list[MapLine]:
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, hi = parts[0].split("-")
        out.append(MapLine(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), parts[3],
                           int(parts[4]), parts[5] if len(parts) > 5 else ""))
    return out


def map_file(pid: int, m: MapLine) -> Path:
    """/proc/PID/map_files/ entry of a mapping: the mapped file itself, even when its
    path was since deleted or replaced."""
    return PROC / str(pid) / "map_files" / f"{m.start:x}-{m.end:x}"


def identity(m: MapLine) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a mapping's file, from its "major:minor" and inode."""
    major, _, minor = m.dev.partition(":")
    try:
        return os.makedev(int(major, 16), int(minor, 16)), m.inode
    except ValueError:
        return None


def is_mapped_file(path: str, m: MapLine) -> bool:
    """Whether `path` is the file mapped by `m` (its device and inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == identity(m)


def mapped_file(pid: int, m: MapLine) -> str | None:
    """The path to open the file of `pid`'s mapping `m` by: its map_files entry (the
    mapped file, even deleted or replaced since), or where that cannot be followed
    (without CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE) its path as `pid` sees it while
    that is still the mapped file; None when neither."""
    src = str(map_file(pid, m))
    if os.path.exists(src):
        return src
    path = in_root(process_root(pid), m.path)
    return path if is_mapped_file(path, m) else None


def read_maps(pid: int) -> list[MapLine] | None:
    try:
        return parse_maps((PROC / str(pid) / "maps").read_text())
    except (OSError, UnicodeDecodeError):
        return None


def task_states(pid: int) -> list[str] | None:
    """The state letter of every thread of `pid`, None when the process is gone."""
    try:
        tids = os.listdir(PROC / str(pid) / "task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            stat = (PROC / str(pid) / "task" / tid / "stat").read_text()
        except OSError:
            continue
        states.append(stat[stat.rfind(")") + 2])
    return states


def wait_stopped(pid: int, timeout: float = 5.0) -> bool:
    """Wait until every thread of `pid` is stopped (T/t). False when the process is gone
    (or dead, or did not stop within `timeout`)."""
    deadline = time.monotonic() + timeout
    delay = 0.0
    while True:
        states = task_states(pid)
        if not states or all(s in "ZX" for s in states):
            return False
        if all(s in "Tt" or s in "ZX" for s in states):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(0.002, delay + 0.0002)


@dataclass(frozen=True)
class Identity:
    """Who a live process is (a processes.arrow row): `ns_pid` is its pid in its own pid
    namespace (a container's; the pid itself outside one), None where unknown."""

    ppid: int
    comm: str
    exe: str
    cmdline: list[str]
    ns_pid: int | None


def _status_field(status: str, name: str) -> list[str]:
    """The values of one line of /proc/PID/status ([] when it has none)."""
    head = f"\n{name}:"
    at = status.find(head)
    return status[at + len(head):].split("\n", 1)[0].split() if at >= 0 else []


def ns_pid_of(status: str) -> int | None:
    """The pid a process has in its own (innermost) pid namespace, from its
    /proc/PID/status text: NSpid's last value (Linux 4.1+), None without one."""
    values = _status_field(status, "NSpid")
    return int(values[-1]) if values and values[-1].isdigit() else None


def read_ns_pid(pid: int, ppid: int | None = None) -> int | None:
    """`pid`'s pid in its own pid namespace; None when it is gone (or, with `ppid`, is
    no longer that parent's child: the pid may be another process's by now)."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    if ppid is not None and _status_field(status, "PPid") != [str(ppid)]:
        return None
    return ns_pid_of(status)


def read_identity(pid: int) -> Identity | None:
    """Who a live process is, None when it is gone."""
    base = PROC / str(pid)
    try:
        stat = (base / "stat").read_text()
        status = (base / "status").read_text()
        comm = (base / "comm").read_text().rstrip("\n")
        raw = (base / "cmdline").read_bytes()
    except OSError:
        return None
    try:
        exe = os.readlink(base / "exe")
    except OSError:
        exe = ""
    ppid = int(stat[stat.rfind(")") + 2:].split()[1])
    cmdline = [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []
    return Identity(ppid, comm, exe, cmdline, ns_pid_of(status))


def process_root(pid: int) -> Path | None:
    """Where memtrack finds the files `pid` names by path: None when `pid` sees them
    where memtrack does (its mount namespace and root are memtrack's), else its
    /proc/PID/root (a container's, an `unshare --mount`'s, a chroot's: its path names
    another file, or none, on this host). A process gone gives its /proc/PID/root too:
    never the host's file of that path."""
    base = PROC / str(pid)
    try:
        same_ns = os.readlink(base / "ns" / "mnt") == os.readlink(PROC / "self" / "ns" / "mnt")
        theirs, ours = os.stat(base / "root"), os.stat("/")
    except OSError:
        return base / "root"
    if same_ns and (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return None
    return base / "root"


def in_root(root: Path | None, path: str) -> str:
    """The path memtrack opens for the file a process names `path` (absolute), given its
    process_root."""
    return path if root is None else str(root / path.lstrip("/"))


def thread_start(pid: int, tid: int) -> int | None:
    """The start time (clock ticks after boot) of thread `tid` of process `pid`, None
    when there is no such thread: it tells a thread from a later one given the same id.
    (os.read, not pathlib: a few microseconds, on the control FIFO's path.)"""
    try:
        fd = os.open(f"/proc/{pid}/task/{tid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (IndexError, ValueError):
        return None


def thread_identity(tid: int) -> tuple[int, int] | None:
    """(its process id, its start time) of a live thread, None when it is gone."""
    try:
        status = (PROC / str(tid) / "status").read_text()
        tgid = int(_status_field(status, "Tgid")[0])
    except (OSError, IndexError, ValueError):
        return None
    start = thread_start(tgid, tid)
    return None if start is None else (tgid, start)


def read_memory(pid: int, start: int, length: int) -> bytes | None:
    try:
        fd = os.open(PROC / str(pid) / "mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.pread(fd, length, start)
    except OSError:
        return None
    finally:
        os.close(fd)


def own_vdso(size: int) -> bytes | None:
    """memtrack's own vDSO image if it is `size` bytes (the kernel maps the same image
    into every process of an ABI; reading one's own memory needs no ptrace access)."""
    for m in read_maps(os.getpid()) or ():
        if m.path == "[vdso]" and m.end - m.start == size:
            return read_memory(os.getpid(), m.start, size)
    return None


PF_KTHREAD = 0x00200000  # /proc/PID/stat flags: a kernel thread
# /proc/PID/status fields of a process's resident memory, by kmem:rss_stat member
# (memtrack.schema.enums.RssMember: FILE, ANON, SHMEM)
RSS_FIELDS = {"RssFile": 0, "RssAnon": 1, "RssShmem": 3}


def attach_refusal(pid: int) -> str | None:
    """Why capture cannot attach to `pid` (one line), None when it can: a process that
    does not exist, a thread of another process, a kernel thread, memtrack itself."""
    try:
        status = (PROC / str(pid) / "status").read_text()
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return f"no process {pid}"
    tgid = int(_status_field(status, "Tgid")[0])
    if tgid == os.getpid():
        return f"process {pid} is memtrack itself"
    if tgid != pid:
        return f"{pid} is a thread of process {tgid}: give the process's pid"
    if int(stat[stat.rfind(")") + 2:].split()[6]) & PF_KTHREAD:
        return f"process {pid} is a kernel thread"
    return None


def read_rss(pid: int) -> dict[int, int] | None:
    """`pid`'s resident bytes per kmem:rss_stat member (/proc/PID/status), None when it
    is gone."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    out = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in RSS_FIELDS:
            out[RSS_FIELDS[name]] = int(value.split()[0]) * 1024
    return out
