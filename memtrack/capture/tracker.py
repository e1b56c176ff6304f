"""The Python API of capture: a `Tracker` owns the loaded BPF program and the probes
attached so far; a `Session` owns one spawned command, its event pipeline and its
artifact.

    with Tracker(CaptureOptions()) as tracker:
        session = tracker.spawn(["./prog", "arg"], Path("run.memtrack"))
        result = session.wait()          # drains until the command exits
    print(result.status, result.events, result.losses)

A session spawns its command stopped (fork, SIGSTOP, exec), arms tracking for the pid
(from its exec on) and resumes it. Every exec and every executable file mapping of
the tracked tree stops the process in BPF (SIGSTOP) and files an attach request; the
session then snapshots the process's mappings, classifies the new file, attaches the
allocator probes it needs and sends SIGCONT, so a library's first allocation is seen.

Limits (kernel facts, not bugs to fix here):
- Uprobes live on the file's inode: while a tracker holds them, every process on the
  host that calls a probed allocator takes the trap (the BPF programs return at once
  for untracked processes), and a uretprobe replaces the return address of every such
  call: an exception thrown out of a probed operator new (bad_alloc) then finds the
  uprobe trampoline instead of its caller and the C++ runtime aborts.
- The attach stops are real SIGSTOP/SIGCONT: a parent that waits with WUNTRACED or
  WCONTINUED, or handles SIGCHLD, sees them.
- A process's mappings are snapshotted at its exec and at each attach stop, not at its
  exit (it cannot be stopped there).
"""

from __future__ import annotations

import errno
import os
import pwd
import select
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa

from memtrack.capture.allocators import ElfError, Probe, probes_for, read_elf
from memtrack.capture.bcc_compat import attach_uprobe
from memtrack.capture.core import ATTACH_DTYPE, REQ_EXEC, CorePart, events_batch
from memtrack.capture.modules import ModuleRecorder
from memtrack.capture.parts import BPF_DIR, CaptureOptions, CapturePart
from memtrack.capture.procfs import map_file, read_identity, wait_stopped
from memtrack.schema import LOSS_COUNTERS, PROCESSES, EventKind, is_loss
from memtrack.schema.artifact import ArtifactWriter
from memtrack.schema.manifest import Clock, ExitStatus, Host

CLONE_THREAD = 0x10000
CONTROL_ENV = "MEMTRACK_CONTROL"
CONTROL_ACK_ENV = "MEMTRACK_CONTROL_ACK"
BATCH_ROWS = 65536  # events per events.arrow batch, at most
BATCH_SECONDS = 0.5  # and at least one batch this often while events arrive


class CaptureError(Exception):
    """Capture cannot go on; the message is one line for the user."""


@dataclass
class CaptureResult:
    artifact: Path
    pid: int
    exit_code: int | None  # exit(code), None when killed
    signal: int | None  # the signal that killed it
    events: int
    losses: dict[str, int]
    duration_s: float
    warnings: list[str] = field(default_factory=list)

    @property
    def status(self) -> int:
        """The exit status a shell would report: code, or 128 + signal."""
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code or 0

    def nonzero_losses(self) -> dict[str, int]:
        """Counters of lost data that are not zero (see schema.FIDELITY_COUNTERS)."""
        return {k: v for k, v in self.losses.items() if v and is_loss(k)}

    def fidelity_notes(self) -> dict[str, int]:
        return {k: v for k, v in self.losses.items() if v and not is_loss(k)}


def default_parts(options: CaptureOptions) -> list[CapturePart]:
    """Stacks (when enabled), the core, RSS (when enabled), in program order."""
    parts: list[Any] = []
    if options.stacks:
        from memtrack.capture.stacks import StacksPart

        parts.append(StacksPart(options))
    parts.append(CorePart(options))
    if options.rss:
        from memtrack.capture.rss import RssPart

        parts.append(RssPart(options))
    return parts


def _placement(code: bytes, vaddr: int, name: str, arg_regs: int) -> tuple[int, str]:
    from memtrack.capture.placement import choose_probe_offset

    p = choose_probe_offset(code, vaddr, name=name, arg_regs=arg_regs)
    return int(p.offset), str(p.reason)


class Tracker:
    """Owns the BPF program (compiled once) and the uprobes attached so far."""

    def __init__(self, options: CaptureOptions | None = None,
                 parts: list[CapturePart] | None = None) -> None:
        from bcc import BPF

        self.options = options or CaptureOptions()
        if self.options.probe_placement not in ("auto", "entry"):
            raise CaptureError(f"probe placement {self.options.probe_placement!r}: "
                               "expected 'auto' or 'entry'")
        self.parts: list[Any] = list(parts) if parts is not None else default_parts(self.options)
        cores = [p for p in self.parts if isinstance(p, CorePart)]
        if len(cores) != 1:
            raise CaptureError("a tracker needs exactly one CorePart among its parts")
        self.core: CorePart = cores[0]
        text = [(BPF_DIR / "common.h").read_text()]
        cflags: list[str] = []
        for part in self.parts:
            text += [(BPF_DIR / s).read_text() for s in part.sources()]
            cflags += part.cflags()
        self.warnings: list[str] = []
        self.bpf = BPF(text="\n".join(text), cflags=cflags)
        for part in self.parts:
            self.warnings += part.attach(self.bpf)
        self.attached: set[tuple[int, int]] = set()  # (st_dev, st_ino) of classified files
        self.probes: list[dict[str, Any]] = []
        self.session: Session | None = None
        self.closed = False

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.session is not None and not self.session.done:
            self.session.kill(signal.SIGKILL)
            self.session.wait()
        self.finish()

    def set_enabled(self, on: bool) -> None:
        cfg = self.bpf["mt_config"]
        cfg[cfg.Key(0)] = cfg.Leaf(1 if on else 0)

    def spawn(self, cmd: list[str], output: Path | str, *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, overwrite: bool = False,
              user: tuple[int, int] | None = None, control: Path | None = None,
              live: TextIO | None = None, start_disabled: bool | None = None) -> Session:
        """Start recording `cmd` into the artifact `output`; returns the live session.

        `user` = (uid, gid) to run it as (default: SUDO_UID/SUDO_GID when run through
        sudo as root); `control` = where to create the control FIFO (default: a
        temporary directory); `live` = a stream for the live status line;
        `start_disabled` overrides the tracker's option for this session."""
        if self.closed:
            raise CaptureError("tracker is finished; create a new Tracker")
        if self.session is not None and not self.session.done:
            raise CaptureError(f"session of pid {self.session.pid} is still live: "
                               "wait() for it before spawning another")
        if not cmd:
            raise CaptureError("no command given")
        self.session = Session(self, list(cmd), Path(output), env=env, cwd=cwd,
                               overwrite=overwrite, user=user, control=control, live=live,
                               start_disabled=start_disabled)
        return self.session

    def finish(self) -> None:
        """Detach every probe and unload the program."""
        if self.closed:
            return
        if self.session is not None and not self.session.done:
            raise CaptureError(f"finish() while the session of pid {self.session.pid} is "
                               "live: wait() for it (or kill() it) first")
        for part in self.parts:
            close = getattr(part, "close", None)
            if close is not None:
                close()
        self.bpf.cleanup()
        self.closed = True

    # -- probes ---------------------------------------------------------------------

    def attach_file(self, open_path: str, mapped_path: str, build_id: str | None) -> int:
        """Classify one ELF file and probe its allocator functions (once per inode).
        Returns the number of probes attached."""
        try:
            st = os.stat(open_path)
        except OSError:
            return 0
        key = (st.st_dev, st.st_ino)
        if key in self.attached:
            return 0
        self.attached.add(key)
        try:
            info = read_elf(open_path)
        except (ElfError, OSError):
            return 0
        probes = probes_for(info)
        if not probes:
            return 0
        path = mapped_path
        try:
            same = os.stat(mapped_path)
            if (same.st_dev, same.st_ino) != key:
                path = open_path
        except OSError:
            path = open_path
        code = b""
        if self.options.probe_placement == "auto":
            with open(open_path, "rb") as f:
                code = f.read()
        for p in probes:
            self._attach_probe(p, path, mapped_path, build_id, code)
        return len(probes)

    def _attach_probe(self, p: Probe, path: str, mapped_path: str, build_id: str | None,
                      code: bytes) -> None:
        # The placement never moves rsp before the chosen offset, so [rsp] still holds
        # the return address there: a uretprobe at the same offset works and shares the
        # entry probe's breakpoint.
        offset, reason = 0, "entry (--probe-placement entry)"
        if code:
            offset, reason = _placement(code[p.file_offset:p.file_offset + p.size], p.vaddr,
                                        p.name, p.arg_regs)
        attach_uprobe(self.bpf, p.program, path, p.file_offset + offset)
        if not p.is_free:
            attach_uprobe(self.bpf, "mt_ret", path, p.file_offset + offset, retprobe=True)
        self.probes.append({
            "path": mapped_path, "build_id": build_id, "function": p.name,
            "family": p.family.name.lower(), "program": p.program, "vaddr": p.vaddr,
            "file_offset": p.file_offset, "probe_offset": offset, "reason": reason,
            "retprobe": not p.is_free,
        })

    def on_stop(self, pid: int, maps: list[Any]) -> None:
        """A tracked process is stopped at an attach stop with these mappings: the parts
        that keep per-process kernel state (stacks: kept regions, stack ends) update it
        before it runs on."""
        for part in self.parts:
            hook = getattr(part, "on_stop", None)
            if hook is not None:
                hook(self.bpf, pid, maps)

    def loss_totals(self) -> dict[str, int]:
        out = dict.fromkeys(LOSS_COUNTERS, 0)
        for part in self.parts:
            for k, v in part.losses(self.bpf).items():
                out[k] = out.get(k, 0) + int(v)
        return out


def _sudo_user() -> tuple[int, int] | None:
    if os.geteuid() != 0 or "SUDO_UID" not in os.environ:
        return None
    try:
        return int(os.environ["SUDO_UID"]), int(os.environ.get("SUDO_GID", "0"))
    except ValueError:
        return None


class Session:
    """One spawned command: its process tree, its event pipeline, its artifact."""

    def __init__(self, tracker: Tracker, cmd: list[str], output: Path, *,
                 env: dict[str, str] | None, cwd: str | Path | None, overwrite: bool,
                 user: tuple[int, int] | None, control: Path | None,
                 live: TextIO | None, start_disabled: bool | None = None) -> None:
        self.tracker = tracker
        self.bpf = tracker.bpf
        self.cmd = cmd
        self.output = output
        self.live = live
        self.done = False
        self.result: CaptureResult | None = None
        self._status: int | None = None
        self._events = 0
        self._identity: dict[int, tuple[str, str, list[str]]] = {}
        self._interrupts = 0
        self._last_live = 0.0
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._last_flush = time.monotonic()
        self.writer = ArtifactWriter(output, overwrite=overwrite)
        opts = tracker.options
        m = self.writer.manifest
        m.host = Host.current()
        m.clock = Clock.current()
        m.command = list(cmd)
        m.options = asdict(opts)
        if start_disabled is not None:
            m.options["start_disabled"] = start_disabled
        else:
            start_disabled = opts.start_disabled
        m.warnings = list(tracker.warnings)
        self.modules = ModuleRecorder(self.writer, copy_modules=opts.modules)
        self._loss_base = tracker.loss_totals()
        self._tmpdir = tempfile.mkdtemp(prefix="memtrack-")
        user = user if user is not None else _sudo_user()
        self.control_path, self.ack_path = self._make_fifos(control, user)
        self._ctl_fd = os.open(self.control_path, os.O_RDONLY | os.O_NONBLOCK)
        self._ctl_keep = os.open(self.control_path, os.O_WRONLY | os.O_NONBLOCK)
        self._ctl_buf = b""
        self._epoll = select.epoll()
        self._epoll.register(self._ctl_fd, select.EPOLLIN)
        # The events ring never wakes us (its records are submitted without a wakeup,
        # which is cheaper): poll() reads it on every round; attach requests do wake us.
        assert tracker.core.attach_requests is not None
        self._epoll.register(tracker.core.attach_requests.fd, select.EPOLLIN)
        tracker.set_enabled(not start_disabled)
        child_env = dict(os.environ if env is None else env)
        child_env[CONTROL_ENV] = str(self.control_path)
        child_env[CONTROL_ACK_ENV] = str(self.ack_path)
        self.start_ns = time.monotonic_ns()
        m.start_ns = self.start_ns
        try:
            self.pid = self._spawn(cmd, child_env, cwd, user)
        except BaseException:
            self._epoll.close()
            os.close(self._ctl_fd)
            os.close(self._ctl_keep)
            self._cleanup_fifos()
            for t in self.writer.tables.values():
                t.close()
            shutil.rmtree(output, ignore_errors=True)
            raise
        m.root_pid = self.pid
        self.writer.write_manifest()

    # -- setup ----------------------------------------------------------------------

    def _make_fifos(self, control: Path | None, user: tuple[int, int] | None
                    ) -> tuple[Path, Path]:
        ctl = Path(control) if control else Path(self._tmpdir) / "control"
        ack = ctl.with_name(ctl.name + ".ack")
        for p in (ctl, ack):
            try:
                os.mkfifo(p, 0o600)
            except FileExistsError:
                raise CaptureError(f"{p}: already exists; choose another control FIFO "
                                   "path") from None
            except OSError as e:
                raise CaptureError(f"{p}: cannot create the control FIFO ({e.strerror})") \
                    from None
            if user is not None:
                os.chown(p, user[0], user[1])
        if user is not None and control is None:
            os.chown(self._tmpdir, user[0], user[1])
        return ctl, ack

    def _spawn(self, cmd: list[str], env: dict[str, str], cwd: str | Path | None,
               user: tuple[int, int] | None) -> int:
        """Fork, stop the child, arm tracking from its exec on, resume it."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: only async-signal-safe-ish work until exec
            try:
                os.close(r)
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
        pending = self.bpf["mt_pending"]
        pending[pending.Key(pid)] = pending.Leaf(1)
        os.kill(pid, signal.SIGCONT)
        with os.fdopen(r, "rb") as f:
            err = f.read()
        if err:
            os.waitpid(pid, 0)
            raise CaptureError(f"cannot run {cmd[0]}: {err.decode(errors='replace')}")
        return pid

    # -- the loop -------------------------------------------------------------------

    def enable(self, on: bool = True) -> None:
        """Switch recording on (or off) for the whole tree."""
        self.tracker.set_enabled(on)

    def disable(self) -> None:
        self.enable(False)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to the root process (if it still runs)."""
        if self._status is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def poll(self, timeout: float = 0.02) -> bool:
        """One round: wait up to `timeout` s for data, serve attach requests and control
        commands, drain every ring. Returns False once the root process has exited."""
        if self.done:
            return False
        try:
            ready = self._epoll.poll(timeout)
        except InterruptedError:
            ready = []
        if any(fd == self._ctl_fd for fd, _ in ready):
            self._serve_control()
        self._serve_attach()
        self._drain()
        if self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid == self.pid:
                self._status = status
        self._show_live()
        return self._status is None

    def wait(self, timeout: float | None = None) -> CaptureResult:
        """Drain until the command exits, then write the artifact and return the result.
        SIGINT/SIGTERM received meanwhile are passed to the command (a second one kills
        it). With `timeout`, the command is killed after that many seconds."""
        if self.result is not None:
            return self.result
        deadline = None if timeout is None else time.monotonic() + timeout
        old = self._install_signals()
        try:
            while self.poll():
                if deadline is not None and time.monotonic() > deadline:
                    self.kill(signal.SIGKILL)
                    deadline = None
        finally:
            self._restore_signals(old)
        return self._finish()

    def _install_signals(self) -> dict[int, Any]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}

        def forward(sig: int, _frame: object) -> None:
            self._interrupts += 1
            self.kill(sig if self._interrupts == 1 else signal.SIGKILL)

        return {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signals(old: dict[int, Any]) -> None:
        for s, h in old.items():
            signal.signal(s, h)

    def _drain(self) -> int:
        core = self.tracker.core
        n = 0
        rec = core.read_events()
        if rec.size:
            self._pending.append(rec)
            self._pending_rows += rec.size
            self._note_forks(rec)
            n += rec.size
        if self._pending_rows >= BATCH_ROWS or (
                self._pending and time.monotonic() - self._last_flush >= BATCH_SECONDS):
            self._flush_events()
        for part in self.tracker.parts:
            if part is not core:
                n += part.drain(self.bpf, self.writer)
        self._events += int(rec.size)
        return n

    def _flush_events(self) -> None:
        """Write the drained events as one batch (a batch per 20 ms round would make
        tiny, slow-to-read batches)."""
        if self._pending:
            rec = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
            self.writer.write("events", events_batch(rec))
            self.writer.flush()
        self._pending = []
        self._pending_rows = 0
        self._last_flush = time.monotonic()

    def _note_forks(self, rec: np.ndarray) -> None:
        """processes.arrow rows for new child processes (they start as their parent)."""
        forks = rec[(rec["kind"] == EventKind.FORK) & ((rec["flags"] & CLONE_THREAD) == 0)]
        for ts, parent, child in zip(forks["ts"].tolist(), forks["pid"].tolist(),
                                     forks["addr"].tolist(), strict=True):
            comm, exe, cmdline = self._identity.get(parent, ("", "", []))
            self._identity.setdefault(child, (comm, exe, cmdline))
            self._write_process(ts, child, parent, comm, exe, cmdline)

    def _write_process(self, ts: int, pid: int, ppid: int, comm: str, exe: str,
                       cmdline: list[str]) -> None:
        self.writer.write("processes", pa.RecordBatch.from_pydict({
            "ts": [ts], "pid": [pid], "ppid": [ppid], "comm": [comm], "exe": [exe],
            "cmdline": [cmdline]}, schema=PROCESSES))

    # -- on-demand attach -----------------------------------------------------------

    def _serve_attach(self) -> None:
        reader = self.tracker.core.attach_requests
        assert reader is not None
        reqs = reader.read_fixed(ATTACH_DTYPE)
        if not reqs.size:
            return
        stopped: dict[int, bool] = {}
        batches = [reqs]
        # Fixpoint: once a process is stopped, every request its threads filed is in
        # the ring; more processes may have stopped meanwhile.
        while reqs.size:
            for pid in np.unique(reqs["pid"]).tolist():
                if pid not in stopped:
                    stopped[pid] = wait_stopped(pid)
            reqs = reader.read_fixed(ATTACH_DTYPE)
            if reqs.size:
                batches.append(reqs)
        allreqs = np.concatenate(batches) if len(batches) > 1 else batches[0]
        for r in allreqs[allreqs["reason"] == REQ_EXEC]:
            pid = int(r["pid"])
            if stopped[pid]:
                self._on_exec(pid, int(r["ts"]))
        now = time.monotonic_ns()
        for pid, ok in stopped.items():
            if ok:
                maps = self.modules.snapshot(pid, now)
                if maps is not None:
                    self.tracker.on_stop(pid, maps)
                for m in maps or ():
                    if "x" in m.perms and m.path.startswith("/") and m.inode:
                        src = str(map_file(pid, m))
                        self.tracker.attach_file(src, m.path, self.modules.build_id_of(pid, m))
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.modules.copy_pending()

    def _on_exec(self, pid: int, ts: int) -> None:
        ident = read_identity(pid)
        if ident is None:
            return
        ppid, comm, exe, cmdline = ident
        self._identity[pid] = (comm, exe, cmdline)
        self._write_process(ts, pid, ppid, comm, exe, cmdline)

    # -- control FIFO ---------------------------------------------------------------

    def _serve_control(self) -> None:
        try:
            data = os.read(self._ctl_fd, 4096)
        except BlockingIOError:
            return
        self._ctl_buf += data
        *lines, self._ctl_buf = self._ctl_buf.split(b"\n")
        for line in lines:
            cmd = line.strip().decode(errors="replace").lower()
            if cmd in ("enable", "on", "1", "start"):
                self.enable(True)
                reply = "ok"
            elif cmd in ("disable", "off", "0", "stop"):
                self.enable(False)
                reply = "ok"
            elif not cmd:
                continue
            else:
                reply = f"error unknown command {cmd!r}"
            self._ack(reply)

    def _ack(self, reply: str) -> None:
        try:
            fd = os.open(self.ack_path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # nobody waits for an answer (a runner's plain write)
            if e.errno == errno.ENXIO:
                return
            raise
        try:
            os.write(fd, (reply + "\n").encode())
        except BlockingIOError:
            pass
        finally:
            os.close(fd)

    # -- the end --------------------------------------------------------------------

    def _show_live(self, final: bool = False) -> None:
        if self.live is None:
            return
        now = time.monotonic()
        if not final and now - self._last_live < 0.5:
            return
        self._last_live = now
        elapsed = (time.monotonic_ns() - self.start_ns) / 1e9
        lost = sum(v - self._loss_base.get(k, 0)
                   for k, v in self.tracker.loss_totals().items())
        rate = self._events / elapsed if elapsed > 0 else 0.0
        self.live.write(f"\rmemtrack: {elapsed:7.1f} s  {self._events:>12,} events  "
                        f"{rate:>11,.0f} ev/s  lost {lost:,}" + ("\n" if final else ""))
        self.live.flush()

    def _release_stragglers(self) -> None:
        """Stop tracking whatever outlives the root and let stopped ones go on."""
        tracked = self.bpf["mt_tracked"]
        pids = [k.value for k in tracked.keys()]
        for k in list(tracked.keys()):
            try:
                del tracked[k]
            except KeyError:
                pass
        for name in ("mt_pending", "mt_calls"):
            table = self.bpf[name]
            for k in list(table.keys()):
                try:
                    del table[k]
                except KeyError:
                    pass
        self._serve_attach()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _finish(self) -> CaptureResult:
        self._release_stragglers()
        while self._drain():
            pass
        self._flush_events()
        self._show_live(final=True)
        self.done = True
        end = time.monotonic_ns()
        status = self._status or 0
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        totals = self.tracker.loss_totals()
        losses = {k: v - self._loss_base.get(k, 0) for k, v in totals.items()}
        losses["module_copy_failed"] = losses.get("module_copy_failed", 0) + \
            self.modules.copy_failed
        m = self.writer.manifest
        m.end_ns = end
        m.exit_status = ExitStatus(code=code, signal=sig)
        m.losses = losses
        m.probes = list(self.tracker.probes)
        self.writer.close()
        self._epoll.close()
        os.close(self._ctl_fd)
        os.close(self._ctl_keep)
        self._cleanup_fifos()
        self.result = CaptureResult(self.output, self.pid, code, sig, self._events, losses,
                                    (end - self.start_ns) / 1e9, list(m.warnings))
        return self.result

    def _cleanup_fifos(self) -> None:
        for p in (self.control_path, self.ack_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        try:
            os.rmdir(self._tmpdir)
        except OSError:
            pass

