"""The Python API of capture: a `Tracker` owns the loaded BPF program and the probes
attached so far; a `Session` (memtrack.capture.session) owns one spawned command, its
event pipeline and its artifact.

    with Tracker(CaptureOptions()) as tracker:
        session = tracker.spawn(["./prog", "arg"], Path("run.memtrack"))
        result = session.wait()          # drains until the command exits
    print(result.status, result.events, result.losses)

A tracker first starts its supervisor (memtrack.capture.supervisor), before the BPF
program is loaded: if memtrack dies, it continues every process the program stopped.

A session reaches the program only through the tracker's four interfaces and a few
calls of its own (options, warnings, scope, set_enabled, on_stop, loss_totals,
run_stats):
- `tracked` (tracked.TrackedProcesses): the tracked tree in the kernel;
- `probes` (probes.Probes): files classified and linked per process, their records;
- `rings` (drain.Rings): the rings to drain, attach requests, region marks, pauses;
- `supervisor` (supervisor.Supervisor): the pids and terminal it must restore.

Probe scope: where the kernel has uprobe_multi links (6.6+), every traced process gets
links of its own for each allocator module it maps ("process"), and no process outside
the tree takes a trap; elsewhere (or with --probe-scope host) the links are host-wide
("host"), said once in the warnings: every process on the host that calls a probed
allocator then takes the trap (the BPF programs return at once for untracked ones),
and a uretprobe replaces the return address of every such call (an exception thrown
out of a probed operator new then finds the uprobe trampoline instead of its caller).
"""

from __future__ import annotations

import errno
import os
import resource
import signal
from pathlib import Path
from typing import Any, TextIO

from memtrack.capture.choices import ProbeScope
from memtrack.capture.core import CorePart
from memtrack.capture.doctor import check_pid_namespace
from memtrack.capture.drain import Rings
from memtrack.capture.links import UprobeLinks, release_in_background
from memtrack.capture.options import CaptureError, CaptureOptions
from memtrack.capture.parts import BPF_DIR, CONFIG_ENABLED, CONFIG_SCOPED, CapturePart
from memtrack.capture.probes import Probes
from memtrack.capture.program import (
    LoadError,
    ProgramCache,
    SlowNote,
    default_cache_dir,
    load_program,
)
from memtrack.capture.session import CaptureResult, Session
from memtrack.capture.supervisor import Supervisor
from memtrack.capture.tracked import TrackedProcesses
from memtrack.schema import LOSS_COUNTERS

__all__ = ["CaptureError", "CaptureResult", "Session", "Tracker", "default_parts",
           "find_command"]


def find_command(name: str, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None) -> str:
    """Where exec will find `name` (searched in the PATH of `env` like execvp when it has
    no slash); CaptureError with exec's reason when it cannot be run."""
    if "/" in name:
        candidates = [os.path.join(cwd or ".", name)]
    else:
        path = (os.environ if env is None else env).get("PATH", os.defpath)
        candidates = [os.path.join(cwd or ".", d or ".", name) for d in path.split(":")]
    why = errno.ENOENT
    for c in candidates:
        if os.path.isdir(c):
            why = errno.EISDIR if "/" in name else why
        elif os.path.exists(c):
            if os.access(c, os.X_OK):
                return c
            why = errno.EACCES
    reason = os.strerror(why) if "/" in name or why != errno.ENOENT else "command not found"
    raise CaptureError(f"cannot run {name}: {reason}")


def default_parts(options: CaptureOptions) -> list[CapturePart]:
    """Stacks and Python frames (when enabled), the core, RSS (when enabled), in program
    order."""
    parts: list[Any] = []
    if options.stacks:
        from memtrack.capture.stacks import StacksPart

        parts.append(StacksPart(options))
        if options.python_frames:
            from memtrack.capture.pyframes import PyFramesPart

            parts.append(PyFramesPart(options))
    parts.append(CorePart(options))
    if options.rss:
        from memtrack.capture.rss import RssPart

        parts.append(RssPart(options))
    return parts


class Tracker:
    """Owns the BPF program (compiled once) and the uprobes attached so far."""

    def __init__(self, options: CaptureOptions | None = None,
                 parts: list[CapturePart] | None = None, *,
                 progress: TextIO | None = None) -> None:
        """`progress`: where to say so when loading the program takes a while."""
        pids = check_pid_namespace()
        if not pids.ok:  # the programs' pids would match no process memtrack follows
            raise CaptureError(f"pid namespace {pids.detail}: {pids.fix}")
        # first, before any BPF fd exists: the supervisor must hold none of them
        self.supervisor = Supervisor()
        self.options = options or CaptureOptions()
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
        cache = None
        if self.options.program_cache != "off":
            cache = ProgramCache(Path(self.options.program_cache) if self.options.program_cache
                                 else default_cache_dir())
            why = cache.usable()
            if why is not None:
                self.warnings.append(f"program cache not used: {why}")
                cache = None
        with SlowNote(progress, "loading the BPF programs") as note:
            try:
                self.bpf = load_program("\n".join(text), cflags, cache, note=note)
            except LoadError as e:
                raise CaptureError(str(e)) from None
            try:
                self.tracked = TrackedProcesses(self.bpf)
                self.supervisor.watch_maps(self.tracked.map_fd, self.bpf["mt_paused"].map_fd)
                for part in self.parts:
                    self.warnings += part.attach(self.bpf)
                self.uprobes = UprobeLinks(self.bpf, multi=self.options.tuning.uprobe_attach.multi)
                try:
                    self.scope = self._choose_scope()
                except BaseException:
                    self.uprobes.close()  # waits for the programs' load
                    raise
            except BaseException as e:
                self.bpf.cleanup()
                if isinstance(e, LoadError):  # the verifier refused a program
                    raise CaptureError(str(e)) from None
                raise
        self.probes = Probes(self.bpf, self.uprobes, self.options, self.scope, self.warnings)
        self.rings = Rings(self.bpf, self.parts, self.core)
        self.session: Session | None = None
        self.closed = False

    def _choose_scope(self) -> str:
        """"process" (each traced process gets links of its own) where the kernel has
        uprobe_multi links and the options allow, else "host", said once."""
        if self.options.probe_scope is ProbeScope.AUTO and self.uprobes.multi:
            # a link per process and module: a fork-heavy tree holds many of them
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft != hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            cfg = self.bpf["mt_config"]
            cfg[cfg.Key(CONFIG_SCOPED)] = cfg.Leaf(1)
            return "process"
        why = ("--probe-scope host" if self.options.probe_scope is ProbeScope.HOST else
               "this kernel has no uprobe_multi links (Linux 6.6+)")
        self.warnings.append(f"allocator probes are host-wide ({why}): every process on "
                             "this machine that calls a probed allocator takes their trap "
                             "while the capture runs")
        return "host"

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.session is not None and not self.session.done:
            self.session.kill(signal.SIGKILL)
            self.session.detach()
            self.session.wait()
        self.finish()

    def set_enabled(self, on: bool) -> None:
        cfg = self.bpf["mt_config"]
        cfg[cfg.Key(CONFIG_ENABLED)] = cfg.Leaf(1 if on else 0)

    def spawn(self, cmd: list[str], output: Path | str, *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, overwrite: bool = False,
              user: tuple[int, int] | None = None, control: Path | None = None,
              live: TextIO | None = None, start_disabled: bool | None = None) -> Session:
        """Start recording `cmd` into the artifact `output`; returns the live session.

        `user` = (uid, gid) to run it as (default: SUDO_UID/SUDO_GID when run through
        sudo as root); `control` = where to create the control FIFO (default: a
        temporary directory); `live` = a stream for the live status line;
        `start_disabled` overrides the tracker's option for this session."""
        self._check_idle()
        if not cmd:
            raise CaptureError("no command given")
        find_command(cmd[0], env, cwd)
        self.probes.begin_session()
        self.session = Session(self, list(cmd), Path(output), env=env, cwd=cwd,
                               overwrite=overwrite, user=user, control=control, live=live,
                               start_disabled=start_disabled)
        return self.session

    def attach(self, pids: list[int], output: Path | str, *, overwrite: bool = False,
               control: Path | None = None, live: TextIO | None = None,
               start_disabled: bool | None = None) -> Session:
        """Start recording the running processes `pids` (all their threads) and every
        process they start from now on into the artifact `output`; returns the live
        session (its wait(timeout) ends the capture after `timeout` seconds, or when
        every attached process has exited; detach() ends it)."""
        self._check_idle()
        if not pids:
            raise CaptureError("no pid given")
        self.probes.begin_session()
        self.session = Session(self, [], Path(output), env=None, cwd=None,
                               overwrite=overwrite, user=None, control=control, live=live,
                               start_disabled=start_disabled, pids=list(pids))
        return self.session

    def _check_idle(self) -> None:
        if self.closed:
            raise CaptureError("tracker is finished; create a new Tracker")
        if self.session is not None and not self.session.done:
            raise CaptureError(f"session of pid {self.session.pid} is still live: "
                               "wait() for it before starting another")

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

        # the links of processes gone that the closer has not reached trap nobody
        gone = self.uprobes.closer.stop()

        def close_own() -> None:
            self.uprobes.close()
            for fd in gone:
                os.close(fd)
            self.bpf.cleanup()

        # uprobe_multi links go now, side by side, so that no allocator trap outlives
        # us; what waits for grace periods one by one goes in the background.
        release_in_background([*self.bpf.tracepoint_fds.values(), *self.uprobes.slow_links(),
                               *gone], close_own)
        self.supervisor.close()
        self.closed = True

    def on_stop(self, pid: int, maps: list[Any]) -> None:
        """A tracked process is stopped at an attach stop with these mappings: the parts
        that keep per-process kernel state (stacks: kept regions, stack ends) update it
        before it runs on; a hook may return warnings (python frames: an interpreter
        version it does not know)."""
        for part in self.parts:
            hook = getattr(part, "on_stop", None)
            if hook is not None:
                for w in hook(self.bpf, pid, maps) or ():
                    if w not in self.warnings:
                        self.warnings.append(w)

    def run_stats(self) -> dict[str, dict[str, int]]:
        """The programs' run counts and times (the manifest's cost)."""
        return self.bpf.run_stats()

    def loss_totals(self) -> dict[str, int]:
        out = dict.fromkeys(LOSS_COUNTERS, 0)
        for part in self.parts:
            for k, v in part.losses(self.bpf).items():
                out[k] = out.get(k, 0) + int(v)
        return out
