"""The Python API of capture: a `Tracker` owns the loaded BPF program and the probes
attached so far; a `Session` (memtrack.capture.session) owns one spawned command, its
event pipeline and its artifact.

    with Tracker(CaptureOptions()) as tracker:
        session = tracker.spawn(["./prog", "arg"], Path("run.memtrack"))
        result = session.wait()          # drains until the command exits
    print(result.status, result.events, result.losses)

A tracker first starts its supervisor (memtrack.capture.supervisor), before the BPF
program is loaded: if memtrack dies, it continues every process the program stopped.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from memtrack.capture.allocators import Probe, probes_for, pymalloc_refusal, read_elf
from memtrack.capture.choices import ProbePlacement, ProbeScope
from memtrack.capture.core import CorePart
from memtrack.capture.doctor import check_pid_namespace
from memtrack.capture.links import UprobeLinks, release_in_background
from memtrack.capture.options import CaptureError, CaptureOptions
from memtrack.capture.parts import BPF_DIR, CapturePart
from memtrack.capture.procfs import MapLine
from memtrack.capture.program import (
    LoadError,
    ProgramCache,
    SlowNote,
    default_cache_dir,
    load_program,
)
from memtrack.capture.session import CaptureResult, Session
from memtrack.capture.supervisor import Supervisor
from memtrack.capture.wrappers import Site, find_wrappers
from memtrack.elf.image import ElfReadError
from memtrack.schema import LOSS_COUNTERS

__all__ = ["CaptureError", "CaptureResult", "Session", "Tracker", "default_parts",
           "find_command"]

CONFIG_SCOPED = 1  # bpf/common.h mt_config slot: new processes stop for their links
CONFIG_WRAPPED = 2  # bpf/common.h mt_config slot: wrapper call sites are registered
CONFIG_GENERATION = 3  # bpf/common.h mt_config slot: the session's generation (mt_threads)
WRAP_SITES = "mt_wrap_sites"  # bpf/alloc.c


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


@dataclass
class _Placed:
    """A classified file: the path its probes attach to, the functions still probed and
    their offsets in the function, their records in Tracker.probes, and the call sites
    of its unprobed wrappers (memtrack.capture.wrappers)."""

    path: str
    probes: list[Probe]
    offsets: dict[str, int]
    records: list[dict[str, Any]]
    sites: list[Site]
    tried: bool = False  # attached once: an offset the kernel refused moved to the entry


def _placement(code: bytes, vaddr: int, name: str, arg_regs: int) -> tuple[int, str]:
    from memtrack.capture.placement import choose_probe_offset

    p = choose_probe_offset(code, vaddr, name=name, arg_regs=arg_regs)
    return int(p.offset), str(p.reason)


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
                self.supervisor.watch_maps(self.bpf["mt_tracked"].map_fd,
                                           self.bpf["mt_paused"].map_fd)
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
        # (st_dev, st_ino) -> the file's probes (None: it has none), and per owner (a
        # pid, or 0 for host-wide links) the files linked for it
        self.classified: dict[tuple[int, int], _Placed | None] = {}
        self.linked: dict[int, set[tuple[int, int]]] = {}
        self.session_files: set[tuple[int, int]] = set()  # the files the session mapped
        self.probes: list[dict[str, Any]] = []
        self.session: Session | None = None
        self.wrapping = False  # a wrapper call site is registered (mt_config[2] is on)
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
        cfg[cfg.Key(0)] = cfg.Leaf(1 if on else 0)

    def next_generation(self) -> None:
        """A new generation of thread states: every slot of bpf/common.h mt_threads
        (the last session's threads) is free for the next session's."""
        cfg = self.bpf["mt_config"]
        key = cfg.Key(CONFIG_GENERATION)
        cfg[key] = cfg.Leaf(cfg[key].value + 1)

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
        self.session_files = set()
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
        self.session_files = set()
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

    # -- probes ---------------------------------------------------------------------

    def attach_file(self, open_path: str, mapped_path: str, build_id: str | None,
                    pid: int, mapping: MapLine | None = None) -> int:
        """Probe one ELF file's allocator functions for the process `pid` (scope
        "process"), or for every process (scope "host": once per file), and register
        the call sites of its unprobed wrappers where `mapping` (pid's executable
        mapping of it) puts them. The file is classified and its probes placed once per
        inode. Returns the number of probes attached."""
        got = self.classify(open_path, mapped_path, build_id)
        if got is None:
            return 0
        key, placed = got
        self.session_files.add(key)
        if placed is not None and placed.sites and mapping is not None:
            self._register_sites(placed.sites, mapping)
        owner = pid if self.scope == "process" else 0
        linked = self.linked.setdefault(owner, set())
        if key in linked:
            return 0
        linked.add(key)
        if placed is None:
            return 0
        if not placed.tried:
            placed.tried = True
            return self._attach_first(placed, mapped_path, owner)
        if not placed.offsets:
            return 0
        refused = self._attach(placed.path, placed.probes, placed.offsets, owner)
        for name, why in refused.items():
            self._refused(placed, name, why, mapped_path)
        return len(placed.offsets) - len(refused)

    def classify(self, open_path: str, mapped_path: str, build_id: str | None
                 ) -> tuple[tuple[int, int], _Placed | None] | None:
        """The file's (st_dev, st_ino) and its probes (None: it has none), classified
        once per inode (attach_file calls it; a caller may before, to take the work out
        of a stop); None when the file cannot be read."""
        try:
            st = os.stat(open_path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        if key not in self.classified:
            self.classified[key] = self._classify(open_path, mapped_path, build_id, key)
        return key, self.classified[key]

    def _classify(self, open_path: str, mapped_path: str, build_id: str | None,
                  key: tuple[int, int]) -> _Placed | None:
        """The file's allocator functions and where their probes go (recorded in
        self.probes); None when it has none."""
        try:
            info = read_elf(open_path)
        except ElfReadError:
            return None
        python = self.options.python_allocators
        if python:
            why = pymalloc_refusal(open_path, info)
            if why is not None:
                python = False
                self.warnings.append(f"python allocators: {mapped_path}: {why}; its objects "
                                     "are not recorded (those over 512 bytes are, by malloc)")
        probes = probes_for(info, python_allocators=python)
        if not probes:
            return None
        path = mapped_path
        try:
            same = os.stat(mapped_path)
            if (same.st_dev, same.st_ino) != key:
                path = open_path
        except OSError:
            path = open_path
        code = b""
        if self.options.probe_placement is ProbePlacement.AUTO:
            with open(open_path, "rb") as f:
                code = f.read()
        first = len(self.probes)
        wrapping = find_wrappers(open_path, mapped_path, info, probes)
        for p in probes:
            if p.name in wrapping.unprobed:
                self._record(p, mapped_path, build_id, None, wrapping.unprobed[p.name])
        probes = [p for p in probes if p.name not in wrapping.unprobed]
        offsets = {p.name: self._place_probe(p, mapped_path, build_id, code) for p in probes}
        return _Placed(path, probes, offsets, self.probes[first:], wrapping.sites)

    def _register_sites(self, sites: list[Site], mapping: MapLine) -> None:
        """The wrapper call sites inside `mapping`, at their addresses there."""
        table = self.bpf[WRAP_SITES]
        size = mapping.end - mapping.start
        for site in sites:
            if not mapping.offset <= site.offset < mapping.offset + size:
                continue
            if not self.wrapping:
                cfg = self.bpf["mt_config"]
                cfg[cfg.Key(CONFIG_WRAPPED)] = cfg.Leaf(1)
                self.wrapping = True
            leaf = table.Leaf()
            leaf.family = int(site.family)
            leaf.nsaved = len(site.saved)
            leaf.cfa = site.cfa
            leaf.delta = site.delta
            for i, (reg, off) in enumerate(site.saved):
                leaf.reg[i] = reg
                leaf.off[i] = off
            table[table.Key(mapping.start + site.offset - mapping.offset)] = leaf

    def _attach_first(self, placed: _Placed, mapped_path: str, owner: int) -> int:
        """The file's first attach: a chosen offset the kernel will not probe is tried
        at the function's entry instead, and what stays refused is left out of every
        later attach."""
        offsets = placed.offsets
        refused = self._attach(placed.path, placed.probes, offsets, owner)
        moved = {name: 0 for name in refused if offsets[name] != 0}
        if moved:
            again = self._attach(placed.path, [p for p in placed.probes if p.name in moved],
                                 moved, owner)
            refused = {k: v for k, v in refused.items() if k not in moved} | again
        for rec in placed.records:
            name = rec["function"]
            if name in moved and name not in refused:
                rec["reason"] = f"entry (the kernel refused +{offsets[name]:#x})"
                rec["probe_offset"] = offsets[name] = 0
        for name, why in refused.items():
            self._refused(placed, name, why, mapped_path)
        return len(placed.probes) - len(refused)

    def _refused(self, placed: _Placed, name: str, why: str, mapped_path: str) -> None:
        """`name` cannot be probed: its calls are not recorded (said once per file)."""
        if placed.offsets.pop(name, None) is None:
            return
        placed.probes = [p for p in placed.probes if p.name != name]
        for rec in placed.records:
            if rec["function"] == name:
                rec["refused"] = why
        self.warnings.append(f"cannot probe {name} in {mapped_path}: {why}; "
                             "its calls are not recorded")

    def refused_functions(self) -> int:
        """Allocator functions of the files this session's tree mapped that the kernel
        refused to probe."""
        return sum(1 for key in self.session_files if self.classified.get(key)
                   for rec in self.classified[key].records if "refused" in rec)

    def release(self, pid: int, *, wait: bool = False) -> None:
        """Forget the links of `pid` (a process gone, or a pid now another process's):
        closed in the background, or before returning (`wait`)."""
        if self.scope == "process":
            self.linked.pop(pid, None)
            self.uprobes.release(pid, wait=wait)

    def linked_pids(self) -> list[int]:
        return self.uprobes.owners()

    def _attach(self, path: str, probes: list[Probe], offsets: dict[str, int], owner: int
                ) -> dict[str, str]:
        """Attach `probes` at their `offsets` for the process `owner` (0: every process);
        the names the kernel refused, and why."""
        entries: list[tuple[int, int]] = []
        frees: list[tuple[int, int]] = []
        at: dict[int, list[str]] = {}
        for p in probes:
            off = p.file_offset + offsets[p.name]
            (frees if p.is_free else entries).append((off, p.cookie))
            at.setdefault(off, []).append(p.name)
        try:
            self.uprobes.wait()
        except LoadError as e:  # the verifier refused a program
            raise CaptureError(str(e)) from None
        refused = self.uprobes.attach(path, entries, frees, owner)
        return {name: why for off, why in refused.items() for name in at[off]}

    def _place_probe(self, p: Probe, mapped_path: str, build_id: str | None,
                     code: bytes) -> int:
        """The probe's offset in the function (recorded in self.probes)."""
        # The placement never moves rsp before the chosen offset, so [rsp] still holds
        # the return address there: a uretprobe at the same offset works and shares the
        # entry probe's breakpoint.
        offset, reason = 0, "entry (--probe-placement entry)"
        if code:
            offset, reason = _placement(code[p.file_offset:p.file_offset + p.size], p.vaddr,
                                        p.name, p.arg_regs)
        self._record(p, mapped_path, build_id, offset, reason)
        return offset

    def _record(self, p: Probe, mapped_path: str, build_id: str | None, offset: int | None,
                reason: str) -> None:
        """A function's record in the manifest's probes (`probe_offset` None: not probed,
        `reason` says how its calls are recorded)."""
        self.probes.append({
            "path": mapped_path, "build_id": build_id, "function": p.name,
            "family": p.family.name.lower(), "program": p.program if offset is not None
            else None, "vaddr": p.vaddr, "file_offset": p.file_offset,
            "probe_offset": offset, "reason": reason,
            "retprobe": offset is not None and not p.is_free,
        })

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

    def loss_totals(self) -> dict[str, int]:
        out = dict.fromkeys(LOSS_COUNTERS, 0)
        for part in self.parts:
            for k, v in part.losses(self.bpf).items():
                out[k] = out.get(k, 0) + int(v)
        return out
