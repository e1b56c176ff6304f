"""One capture session: a spawned command or running processes attached to, their
process tree, its event pipeline and its artifact.

A session spawns its command stopped (fork, SIGSTOP, exec), arms tracking for the pid
(from its exec on) and resumes it; or it attaches to running processes: stops each
(SIGSTOP), tracks it, snapshots its mappings and probes them as at an exec's attach
stop, and continues it. An attached session ends when its duration is over, on
SIGINT/SIGTERM, or when every attached process has exited; the processes run on
without a probe (the kernel keeps the `[uprobes]` page it mapped at the first trap).
Every exec and every executable file mapping of the tracked tree stops the process in
BPF (SIGSTOP) and files an attach request; the session then snapshots the process's
mappings, classifies the new file, attaches the allocator probes it needs and sends
SIGCONT, so a library's first allocation is seen.

Three threads share the work, so that the rings are read whatever else is going on:
- the drain thread (drain.Drain) only copies ring records into memory, and resumes
  the processes a ring pause stopped once the rings have room (stops.Pauses);
- the writer thread (drain.BatchWriter) turns them into Arrow batches and writes them;
- the caller's thread (poll/wait) serves attach requests and the control FIFO (enable,
  disable, region begin/end: capture/regions.py), copies modules, reaps the command,
  refreshes the status line and the manifest.
Whatever stops a process goes through one StopRegistry (stops.py); the tracker's
supervisor (supervisor.py) continues every tracked process if memtrack dies.

Limits (kernel facts, not bugs to fix here):
- The attach stops and ring pauses are real SIGSTOP/SIGCONT: a parent that waits with
  WUNTRACED or WCONTINUED, or handles SIGCHLD, sees them.
- A process's mappings are snapshotted at its exec and at each attach stop, not at its
  exit (it cannot be stopped there).
"""

from __future__ import annotations

import os
import pwd
import select
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import pyarrow as pa

from memtrack.capture.choices import OnRingFull
from memtrack.capture.control import ControlError, ControlFifo
from memtrack.capture.core import ATTACH_DTYPE, REQ_EXEC, REQ_FORK
from memtrack.capture.drain import Backlog, BatchWriter, Drain, Source, min_ring_bytes
from memtrack.capture.modules import ModuleRecorder
from memtrack.capture.options import CaptureError
from memtrack.capture.parts import RING_EVENTS, RING_RSS_EVENTS
from memtrack.capture.procfs import (
    MapLine,
    attach_refusal,
    mapped_file,
    read_identity,
    read_maps,
    read_ns_pid,
    read_rss,
    wait_stopped,
)
from memtrack.capture.regions import Regions
from memtrack.capture.status import StatusLine
from memtrack.capture.stops import ATTACH, StopRegistry
from memtrack.schema import PROCESSES, RSS, STOPS, clones, is_loss
from memtrack.schema.artifact import ArtifactWriter
from memtrack.schema.enums import RssMember
from memtrack.schema.manifest import Clock, ExitStatus, Host

if TYPE_CHECKING:
    from memtrack.capture.tracker import Tracker

STATUS_SECONDS = 0.5  # between two status line updates
MANIFEST_SECONDS = 1.0  # between two manifest rewrites while the command runs
# Between two looks for the links of processes gone. Soon: every hit of a probe runs
# through all its links (consumers), a gone process's too, and so does every release.
RELEASE_SECONDS = 0.05
EVENT_RINGS = (RING_EVENTS, RING_RSS_EVENTS)  # rings whose records go to events.arrow


@dataclass
class CaptureResult:
    artifact: Path
    pid: int
    exit_code: int | None  # exit(code), None when killed or attached to
    signal: int | None  # the signal that killed it
    events: int
    losses: dict[str, int]
    duration_s: float
    warnings: list[str] = field(default_factory=list)
    pauses: dict[str, int] = field(default_factory=dict)  # ring pauses, by ring
    paused_s: float = 0.0  # time the traced processes spent paused, summed
    attached: list[int] = field(default_factory=list)  # the pids attached to
    interrupted: int | None = None  # the signal that ended an attached capture

    @property
    def status(self) -> int:
        """The exit status a shell would report: code, or 128 + signal (the signal
        that ended an attached capture: its processes' own exits are not ours)."""
        sig = self.interrupted if self.attached else self.signal
        if sig is not None:
            return 128 + sig
        return self.exit_code or 0

    def nonzero_losses(self) -> dict[str, int]:
        """Counters of lost data that are not zero (see schema.FIDELITY_COUNTERS)."""
        return {k: v for k, v in self.losses.items() if v and is_loss(k)}

    def fidelity_notes(self) -> dict[str, int]:
        return {k: v for k, v in self.losses.items() if v and not is_loss(k)}


def _sudo_user() -> tuple[int, int] | None:
    if os.geteuid() != 0 or "SUDO_UID" not in os.environ:
        return None
    try:
        return int(os.environ["SUDO_UID"]), int(os.environ.get("SUDO_GID", "0"))
    except ValueError:
        return None


def backlog_limit() -> int:
    """Bytes the writer may fall behind the drain: 1/32 of the memory, 64..512 MiB."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 4 << 30
    return min(max(memory // 32, 64 << 20), 512 << 20)


class Session:
    """One spawned command (`cmd`) or the running processes attached to (`pids`): their
    process tree, its event pipeline, its artifact."""

    def __init__(self, tracker: Tracker, cmd: list[str], output: Path, *,
                 env: dict[str, str] | None, cwd: str | Path | None, overwrite: bool,
                 user: tuple[int, int] | None, control: Path | None,
                 live: TextIO | None, start_disabled: bool | None = None,
                 pids: list[int] | None = None) -> None:
        self.tracker = tracker
        self.cmd = cmd
        self.output = output
        self.done = False
        # attached processes still alive: pid -> pidfd (None: a spawned command)
        self.attached: dict[int, int] | None = {} if pids else None
        self.interrupted: int | None = None
        self.result: CaptureResult | None = None
        self._status: int | None = None
        # pid -> (from when, (comm, exe, cmdline)), in time order: who it was when
        self._identity: dict[int, list[tuple[int, tuple[str, str, list[str]]]]] = {}
        self._interrupts = 0
        self._last_status = 0.0
        self._last_manifest = 0.0
        self._last_release = 0.0
        self._failure: str | None = None
        self.writer = ArtifactWriter(output, overwrite=overwrite)
        opts = tracker.options
        m = self.writer.manifest
        m.host = Host.current()
        m.clock = Clock.current()
        m.command = list(cmd)
        m.options = opts.record()
        if start_disabled is not None:
            m.options["start_disabled"] = start_disabled
        else:
            start_disabled = opts.start_disabled
        m.warnings = list(tracker.warnings)
        m.probe_scope = tracker.scope
        self.modules = ModuleRecorder(self.writer, copy_modules=opts.modules)
        self._loss_base = tracker.loss_totals()
        self.stops = StopRegistry()
        self.pauses = tracker.rings.pauses(self.stops)
        self._pause_base = self.pauses.counts()
        self._tmpdir = tempfile.mkdtemp(prefix="memtrack-")
        user = user if user is not None else _sudo_user()
        try:
            self.control = ControlFifo(Path(self._tmpdir), control, user)
        except ControlError as e:
            self._discard_artifact()
            raise CaptureError(str(e)) from None
        self.regions = Regions(tracker.rings.mark_region, self.writer,
                               lambda pid: pid in tracker.tracked)
        self._epoll = select.epoll()
        self._epoll.register(self.control.fileno(), select.EPOLLIN)
        # The data rings never wake us (the drain thread polls them); attach requests do.
        self._epoll.register(tracker.rings.attach_requests.fd, select.EPOLLIN)
        self.sources = tracker.rings.open()
        pause = opts.on_ring_full is OnRingFull.PAUSE
        self.pauses.configure([(s.ring.ring_id, s.reader.fd, s.high) for s in self.sources],
                              pause)
        m.backpressure = {"mode": opts.on_ring_full.value}
        cpus = os.cpu_count() or 1
        for s in self.sources:
            need = min_ring_bytes(s.ring.max_record, cpus)
            if pause and s.reader.size < need:
                m.warnings.append(f"the {s.ring.name} ring ({s.reader.size} bytes) is too "
                                  f"small to pause in time on {cpus} CPUs (at least "
                                  f"{need}): it may drop records")
        self.backlog = Backlog(backlog_limit())
        self.drain = Drain(self.sources, self.backlog, self.pauses.after_round)
        self.batches = BatchWriter(self.backlog, self._write, idle=self._idle)
        self.status = StatusLine(live) if live is not None else None
        tracker.set_enabled(not start_disabled)
        child_env = dict(os.environ if env is None else env)
        child_env.update(self.control.env())
        self.start_ns = time.monotonic_ns()
        self._cpu0 = time.thread_time_ns()
        m.start_ns = self.start_ns
        if self.status is not None:
            self.status.start()
            if self.status.fd is not None:  # killed, memtrack leaves the terminal as it was
                tracker.supervisor.watch_tty(self.status.fd)
        try:
            self.pid = self._attach(pids) if pids else self._spawn(cmd, child_env, cwd, user)
        except BaseException:
            self._untrack()
            self._close_status()
            self._close_io()
            self._discard_artifact()
            raise
        # threads only after the fork: the child runs Python until its exec
        self.batches.start()
        self.drain.start()
        m.root_pid = self.pid
        if pids:
            m.command = self._identity_at(self.pid)[2]
        self.writer.write_manifest()

    # -- setup ----------------------------------------------------------------------

    def _spawn(self, cmd: list[str], env: dict[str, str], cwd: str | Path | None,
               user: tuple[int, int] | None) -> int:
        """Fork, stop the child, arm tracking from its exec on, resume it."""
        supervisor = self.tracker.supervisor.fileno()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: only async-signal-safe-ish work until exec
            try:
                os.close(r)
                os.close(supervisor)  # its end must close when memtrack dies
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                if user is not None:
                    uid, gid = user
                    try:
                        os.initgroups(pwd.getpwuid(uid).pw_name, gid)
                    except KeyError:
                        os.setgroups([gid])
                    os.setgid(gid)
                    os.setuid(uid)
                if cwd is not None:
                    os.chdir(cwd)
                os.kill(os.getpid(), signal.SIGSTOP)
                os.execvpe(cmd[0], cmd, env)
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                os.write(w, msg.encode(errors="replace"))
            finally:
                os._exit(127)
        os.close(w)
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            with os.fdopen(r, "rb") as f:
                why = f.read().decode(errors="replace") or "the child exited before exec"
            raise CaptureError(f"cannot start {cmd[0]}: {why}")
        self.tracker.supervisor.watch_pid(pid)
        self.tracker.tracked.track_from_exec(pid)
        os.kill(pid, signal.SIGCONT)
        with os.fdopen(r, "rb") as f:
            err = f.read()
        if err:
            os.waitpid(pid, 0)
            raise CaptureError(f"cannot run {cmd[0]}: {err.decode(errors='replace')}")
        return pid

    def _attach(self, pids: list[int]) -> int:
        """Attach to running processes, one after the other: stop it, track it, record
        it, snapshot and probe its mappings, seed its RSS, continue it. Returns the
        first pid."""
        for pid in pids:
            why = attach_refusal(pid)
            if why is not None:
                raise CaptureError(why)
        assert self.attached is not None
        for pid in pids:
            # the files' build ids and probes before the stop: it holds for the links only
            for m, src in self._files(pid, read_maps(pid)):
                self.tracker.probes.classify(src, m.path, self.modules.build_id_of(pid, m))
            self.tracker.supervisor.watch_pid(pid)  # continued if memtrack dies now
            since = time.monotonic_ns()
            try:
                self.attached[pid] = os.pidfd_open(pid)
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                raise CaptureError(f"no process {pid}") from None
            self.stops.hold(pid, ATTACH, since)
            if not wait_stopped(pid):
                raise CaptureError(f"process {pid} did not stop to be attached to (it "
                                   "exited, or waits in the kernel)")
            self.tracker.tracked.track(pid)
            ts = time.monotonic_ns()
            self._record_process(pid, ts)
            rss = read_rss(pid) or {}
            self._probe(pid, self.modules.snapshot(pid, ts))
            if self.tracker.options.rss and rss:
                self.writer.write("rss", pa.RecordBatch.from_pydict({
                    "ts": [ts] * len(rss), "pid": [pid] * len(rss), "member": list(rss),
                    "bytes": list(rss.values()), "external": [False] * len(rss)},
                    schema=RSS))
            self.stops.release(pid, ATTACH)
            self.writer.manifest.attached.append(
                {"pid": pid, "ts": ts, "rss": {RssMember(k).name.lower(): v
                                               for k, v in rss.items()}})
            self._epoll.register(self.attached[pid], select.EPOLLIN)
            # its modules while it runs (and maps them: a container's files are read
            # through it, /proc/PID/map_files or /proc/PID/root)
            self.modules.copy_pending()
        return pids[0]

    def _untrack(self) -> None:
        """An attach that failed midway: the processes attached so far go on untracked
        (their links go with the tracker)."""
        if not self.attached:
            return
        for pid, fd in self.attached.items():
            self.tracker.tracked.untrack(pid)
            os.close(fd)
        self.stops.release_all()

    # -- the loop -------------------------------------------------------------------

    def enable(self, on: bool = True) -> None:
        """Switch recording on (or off) for the whole tree."""
        self.tracker.set_enabled(on)

    def disable(self) -> None:
        self.enable(False)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to the root process (if it still runs); an attached session's
        processes are never signalled (detach() ends it)."""
        if self._status is None and self.attached is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def detach(self, sig: int | None = None) -> None:
        """End an attached session at its next poll (`sig`: the signal that asked)."""
        if self.attached is not None and self._status is None:
            self.interrupted = sig
            self._status = 0

    def poll(self, timeout: float = 0.02) -> bool:
        """One round of the caller's thread: wait up to `timeout` s for an attach request
        or a control command and serve them, reap the command, refresh the status line
        and the manifest. Returns False once the root process has exited (attached:
        every attached process, or detach() was called)."""
        if self.done:
            return False
        try:
            ready = self._epoll.poll(timeout)
        except InterruptedError:
            ready = []
        if any(fd == self.control.fileno() for fd, _ in ready):
            self.control.serve(self.enable, self.regions)
        self.regions.flush(force=False)
        self._serve_attach()
        if self.attached is not None:
            for fd, _ in ready:
                pid = next((p for p, f in self.attached.items() if f == fd), None)
                if pid is not None:
                    self._epoll.unregister(fd)
                    os.close(self.attached.pop(pid))
            if not self.attached:
                self.detach()
        elif self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid == self.pid:
                self._status = status
        self._check_pipeline()
        now = time.monotonic()
        if now - self._last_status >= STATUS_SECONDS:
            self._last_status = now
            self._show_status()
        if now - self._last_release >= RELEASE_SECONDS and self._status is None:
            self._last_release = now  # (once the root is gone, _release_stragglers does)
            self._release_links()
        if now - self._last_manifest >= MANIFEST_SECONDS:
            self._last_manifest = now
            self._update_manifest()
            self.writer.write_manifest()
        return self._status is None

    def wait(self, timeout: float | None = None) -> CaptureResult:
        """Drain until the command exits, then write the artifact and return the result.
        SIGINT/SIGTERM received meanwhile are passed to the command (a second one kills
        it). With `timeout`, the command is killed after that many seconds. An attached
        session ends on SIGINT/SIGTERM, after `timeout` seconds, or when every attached
        process has exited."""
        if self.result is not None:
            return self.result
        deadline = None if timeout is None else time.monotonic() + timeout
        old = self._install_signals()
        try:
            while self.poll():
                if deadline is not None and time.monotonic() > deadline:
                    self.kill(signal.SIGKILL)
                    self.detach()
                    deadline = None
        finally:
            self._restore_signals(old)
        return self._finish()

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def forward(sig: int, _frame: object) -> None:
            if self.attached is not None:
                self.detach(sig)
                return
            self._interrupts += 1
            self.kill(sig if self._interrupts == 1 else signal.SIGKILL)

        return {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signals(old: dict[int, Any]) -> None:
        for s, h in old.items():
            signal.signal(s, h)

    def _check_pipeline(self) -> None:
        """A failed drain or writer thread: stop recording and let every paused process
        go on (the command runs to its end untraced); wait() then raises."""
        err = self.drain.error or self.batches.error
        if err is None or self._failure is not None:
            return
        what = "reading the rings" if self.drain.error else "writing the artifact"
        self._failure = f"capture stopped: {what} failed ({err})"
        self.writer.manifest.warnings.append(self._failure)
        self.tracker.set_enabled(False)
        self.pauses.finish()

    # -- the pipeline (writer thread) -----------------------------------------------

    def _write(self, src: Source, records: Any) -> None:
        if src.ring.ring_id == RING_EVENTS:
            self._note_forks(records)
        self.tracker.rings.write(src, self.writer, records)

    def _idle(self) -> None:
        """The writer thread's work between batches: the stops released meanwhile go to
        stops.arrow."""
        log = self.stops.take_log()
        if log:
            pid, reason, begin, end = (list(c) for c in zip(*log, strict=True))
            self.writer.write("stops", pa.RecordBatch.from_pydict(
                {"pid": pid, "reason": [int(r) for r in reason], "begin_ts": begin,
                 "end_ts": end}, schema=STOPS))

    def _note_forks(self, rec: np.ndarray) -> None:
        """processes.arrow rows for new child processes (they start as their parent)."""
        at, task, thread = clones(rec["kind"], rec["flags"], rec["addr"])
        forks = rec[at[~thread]]
        for ts, parent, child in zip(forks["ts"].tolist(), forks["pid"].tolist(),
                                     task[~thread].tolist(), strict=True):
            # the parent as it was at the fork: the writer may see the fork after the
            # parent's exec was recorded (sh -c 'cmd1; exec cmd2' forks then execs)
            comm, exe, cmdline = self._identity_at(parent, ts)
            self._identity.setdefault(child, [(ts, (comm, exe, cmdline))])
            # the child's pid in its namespace: it may be its parent's or a new one's
            # (clone(CLONE_NEWPID), `unshare --pid --fork`); read while the child lives
            # (at its fork's attach stop, usually), None once it is gone
            self._write_process(ts, child, parent, comm, exe, cmdline,
                                read_ns_pid(child, parent))

    def _identity_at(self, pid: int, ts: int | None = None) -> tuple[str, str, list[str]]:
        """(comm, exe, cmdline) of `pid` at `ts` (None: now), as far as known."""
        history = self._identity.get(pid, [])
        before = [ident for since, ident in history if ts is None or since <= ts]
        return before[-1] if before else history[0][1] if history else ("", "", [])

    def _write_process(self, ts: int, pid: int, ppid: int, comm: str, exe: str,
                       cmdline: list[str], ns_pid: int | None) -> None:
        self.writer.write("processes", pa.RecordBatch.from_pydict({
            "ts": [ts], "pid": [pid], "ppid": [ppid], "comm": [comm], "exe": [exe],
            "cmdline": [cmdline], "ns_pid": [ns_pid]}, schema=PROCESSES))

    @property
    def events(self) -> int:
        """Records drained so far that go to events.arrow."""
        return sum(s.records for s in self.sources if s.ring.ring_id in EVENT_RINGS)

    # -- on-demand attach -----------------------------------------------------------

    def _serve_attach(self) -> None:
        reader = self.tracker.rings.attach_requests
        reqs = reader.read_fixed(ATTACH_DTYPE)
        if not reqs.size:
            return
        stopped: dict[int, bool] = {}
        batches = [reqs]
        # Fixpoint: once a process is stopped, every request its threads filed is in
        # the ring; more processes may have stopped meanwhile.
        while reqs.size:
            for pid in sorted(set(reqs["pid"].tolist())):  # np.unique: +15 ms of numpy.ma
                if pid not in stopped:
                    self.stops.hold(pid, ATTACH, int(reqs["ts"][reqs["pid"] == pid].min()))
                    stopped[pid] = wait_stopped(pid)
            reqs = reader.read_fixed(ATTACH_DTYPE)
            if reqs.size:
                batches.append(reqs)
        allreqs = np.concatenate(batches) if len(batches) > 1 else batches[0]
        forks = set(allreqs["pid"][allreqs["reason"] == REQ_FORK].tolist())
        for pid in forks:  # links left by an earlier process of that pid: not its
            self.tracker.probes.release(pid)
        for r in allreqs[allreqs["reason"] == REQ_EXEC]:
            pid = int(r["pid"])
            if int(r["off"]) != pid:
                # A thread other than the leader exec'd: it leads the process now, and
                # the links held the old leader (whose mm is gone). They must be closed
                # before the new ones, or a breakpoint of both runs the program twice.
                self.tracker.probes.release(pid, wait=True)
            if stopped[pid]:
                self._record_process(pid, int(r["ts"]))
        now = time.monotonic_ns()
        for pid, ok in stopped.items():
            if not ok:
                continue
            others = allreqs["reason"][allreqs["pid"] == pid] != REQ_FORK
            if pid in forks and not others.any():
                # a new process as its parent left it: nothing to record, only its links
                self._link(pid, read_maps(pid))
            else:
                self._probe(pid, self.modules.snapshot(pid, now))
        for pid in stopped:
            self.stops.release(pid, ATTACH)
        self.modules.copy_pending()

    def _probe(self, pid: int, maps: list[MapLine] | None) -> None:
        """A stopped process's mappings, snapshotted: the parts update their kernel
        state for it, and its executable files get their probes."""
        if maps is not None:
            self.tracker.on_stop(pid, maps)
        self._link(pid, maps)

    def _link(self, pid: int, maps: list[MapLine] | None) -> None:
        for m, src in self._files(pid, maps):
            self.tracker.probes.attach_file(src, m.path, self.modules.build_id_of(pid, m), pid, m)

    @staticmethod
    def _files(pid: int, maps: list[MapLine] | None) -> list[tuple[MapLine, str]]:
        """The executable file mappings of `pid`, each with the path to open it by: its
        /proc/PID/map_files entry (the mapped file, even deleted or replaced since), or
        where that cannot be followed (without CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)
        its path as `pid` sees it while that is still the mapped file
        (procfs.mapped_file)."""
        out = []
        for m in maps or ():
            if "x" in m.perms and m.path.startswith("/") and m.inode:
                src = mapped_file(pid, m)
                if src is not None:
                    out.append((m, src))
        return out

    def _release_links(self) -> None:
        """Release the links of traced processes that are gone (BPF forgets a process
        at its exit), so that a fork-heavy tree holds only its live processes' links:
        the kernel runs every link of a probe at each hit and walks them all at each
        release, so links left behind would make both grow with the processes."""
        for pid in self.tracker.probes.linked_pids():
            if pid not in self.tracker.tracked:
                self.tracker.probes.release(pid)

    def _record_process(self, pid: int, ts: int) -> None:
        """processes.arrow's row for a process as it is now (at its exec, or attached
        to)."""
        ident = read_identity(pid)
        if ident is None:
            return
        history = self._identity.setdefault(pid, [])
        history.append((ts, (ident.comm, ident.exe, ident.cmdline)))
        history.sort(key=lambda h: h[0])
        self._write_process(ts, pid, ident.ppid, ident.comm, ident.exe, ident.cmdline,
                            ident.ns_pid)

    # -- counters, status line, manifest --------------------------------------------

    def losses(self) -> dict[str, int]:
        totals = self.tracker.loss_totals()
        losses = {k: v - self._loss_base.get(k, 0) for k, v in totals.items()}
        losses["module_copy_failed"] = losses.get("module_copy_failed", 0) + \
            self.modules.copy_failed
        losses["probes_refused"] = self.tracker.probes.refused_functions()
        return losses

    def pause_counts(self) -> dict[str, int]:
        return {k: v - self._pause_base.get(k, 0) for k, v in self.pauses.counts().items()}

    def _show_status(self) -> None:
        if self.status is None:
            return
        elapsed = (time.monotonic_ns() - self.start_ns) / 1e9
        events = self.events
        rate = events / elapsed if elapsed > 0 else 0.0
        lost = sum(v for k, v in self.losses().items() if is_loss(k))
        text = (f"memtrack: {elapsed:7.1f} s  {events:>12,} events  {rate:>11,.0f} ev/s")
        pauses = sum(self.pause_counts().values())
        if pauses:
            text += f"  paused {pauses:,}x {self.pauses.paused_ns / 1e9:.2f} s"
        self.status.update(text + f"  lost {lost:,}")

    def _update_manifest(self) -> None:
        m = self.writer.manifest
        m.losses = self.losses()
        m.probes = list(self.tracker.probes.records)
        m.warnings += [w for w in self.tracker.warnings if w not in m.warnings]
        m.backpressure = {"mode": self.tracker.options.on_ring_full.value,
                          "pauses": self.pause_counts(), "paused_ns": self.pauses.paused_ns}
        d = self.drain
        m.drain = {"rounds": d.rounds, "bytes": d.bytes, "worst_gap_ns": d.worst_gap_ns,
                   "cpu_ns": d.cpu_ns, "backlog_peak_bytes": self.backlog.peak}
        m.cost = {"main_cpu_ns": time.thread_time_ns() - self._cpu0,
                  "writer_cpu_ns": self.batches.cpu_ns, "bpf": self.tracker.run_stats()}

    # -- the end --------------------------------------------------------------------

    def _release_stragglers(self) -> None:
        """Stop tracking whatever outlives the root and let stopped ones go on."""
        self.pauses.finish()
        # The links of processes gone (the root's, at least) trap nobody: the tracker's
        # finish hands them to release_in_background instead of waiting for their grace
        # periods (~50 ms at the end of every capture). Those of the processes still
        # tracked go below, closed before finish returns. This comes before the tracked
        # pids are cleared: they tell the gone from the live.
        with self.tracker.probes.holding():
            self._release_links()
        pids = self.tracker.tracked.clear()
        self._serve_attach()
        self.stops.release_all()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        # the links of the processes that live on (stragglers, attached ones) are closed
        # before we return, not in the background: none of their traps outlives us
        for pid in self.tracker.probes.linked_pids():
            self.tracker.probes.release(pid, wait=True)

    def _finish(self) -> CaptureResult:
        self._release_stragglers()
        self.regions.flush()
        self.drain.stop()
        self.batches.stop()
        self._idle()
        self._check_pipeline()
        self._show_status()
        self._close_status()
        self.done = True
        end = time.monotonic_ns()
        status = self._status or 0
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        if self.attached is not None:  # their exit statuses are their parents' to reap
            code = None
            for fd in self.attached.values():
                os.close(fd)
        self._update_manifest()
        m = self.writer.manifest
        m.end_ns = end
        m.exit_status = ExitStatus(code=code, signal=sig)
        self.writer.close()
        self._close_io()
        self.result = CaptureResult(self.output, self.pid, code, sig, self.events,
                                    dict(m.losses), (end - self.start_ns) / 1e9,
                                    list(m.warnings), dict(m.backpressure["pauses"]),
                                    self.pauses.paused_ns / 1e9,
                                    [a["pid"] for a in m.attached], self.interrupted)
        if self._failure is not None:
            raise CaptureError(self._failure)
        return self.result

    def _close_status(self) -> None:
        if self.status is not None:
            if self.status.fd is not None:
                self.tracker.supervisor.watch_tty(None)
            self.status.close()

    def _close_io(self) -> None:
        for s in self.sources:
            s.reader.close()
        self._epoll.close()
        self.control.close()
        try:
            os.rmdir(self._tmpdir)
        except OSError:
            pass

    def _discard_artifact(self) -> None:
        """A session that never started leaves nothing behind."""
        for t in self.writer.tables.values():
            t.close()
        shutil.rmtree(self.output, ignore_errors=True)
        try:
            os.rmdir(self._tmpdir)
        except OSError:
            pass
