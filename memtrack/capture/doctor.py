"""`memtrack doctor`: what capture needs on this machine, checked for real."""

from __future__ import annotations

import ctypes
import gzip
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # capture asks check_privileges only: it does not pay rich's import
    from rich.console import Console

TRACEFS = Path("/sys/kernel/tracing")
SETUP = "run scripts/setup as root"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _kernel_config() -> dict[str, str]:
    for p in (Path("/proc/config.gz"), Path(f"/boot/config-{platform.release()}")):
        try:
            raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        except OSError:
            continue
        cfg = {}
        for line in raw.decode(errors="replace").splitlines():
            if line.startswith("CONFIG_") and "=" in line:
                k, v = line.split("=", 1)
                cfg[k] = v
        return cfg
    return {}


def _capabilities() -> set[str]:
    """Effective capabilities of this process that matter for BPF."""
    names = {21: "CAP_SYS_ADMIN", 38: "CAP_PERFMON", 39: "CAP_BPF"}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                eff = int(line.split()[1], 16)
                return {n for bit, n in names.items() if eff >> bit & 1}
    except OSError:
        pass
    return set()


def check_privileges() -> Check:
    caps = _capabilities()
    ok = os.geteuid() == 0 or {"CAP_BPF", "CAP_PERFMON"} <= caps or "CAP_SYS_ADMIN" in caps
    who = "root" if os.geteuid() == 0 else ", ".join(sorted(caps)) or "none"
    return Check("privileges", ok, who,
                 "run as root (sudo memtrack capture ...) or grant CAP_BPF+CAP_PERFMON")


def check_bcc() -> Check:
    try:
        import bcc  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the same to the user
        return Check("bcc (python3-bpfcc)", False, f"not importable: {e}", SETUP)
    try:
        ctypes.CDLL("libbcc.so.0")
    except OSError as e:
        return Check("bcc (python3-bpfcc)", False, f"libbcc missing: {e}", SETUP)
    return Check("bcc (python3-bpfcc)", True, "importable")


def check_headers() -> Check:
    kdir = Path(f"/lib/modules/{platform.release()}")
    ok = (kdir / "build" / "Makefile").exists() and (
        kdir / "source" / "include" / "linux" / "kconfig.h").exists()
    detail = (f"build -> {(kdir / 'build').resolve()}" if ok
              else f"{kdir}/build or {kdir}/source incomplete")
    return Check("kernel headers", ok, detail,
                 SETUP + " (links Debian's linux-headers as build and source)")


def check_tracefs() -> Check:
    ok = (TRACEFS / "events").is_dir()
    return Check("tracefs", ok, str(TRACEFS) if ok else "not mounted",
                 "mount -t tracefs nodev /sys/kernel/tracing")


def check_uprobes() -> Check:
    ok = (TRACEFS / "uprobe_events").exists()
    return Check("uprobes", ok, "uprobe_events present" if ok else "kernel built without uprobes",
                 "a kernel with CONFIG_UPROBE_EVENTS=y")


def check_tracepoints() -> list[Check]:
    out = []
    for tp, why, required in (
        ("syscalls/sys_enter_mmap", "on-demand attach, mmap events", True),
        ("sched/sched_process_fork", "following the process tree", True),
        ("sched/sched_process_exec", "following exec", True),
        ("sched/sched_process_exit", "process exit", True),
        ("kmem/rss_stat", "resident memory (RSS)", False),
        ("exceptions/page_fault_user", "--track-faults", False),
    ):
        ok = (TRACEFS / "events" / tp).is_dir()
        out.append(Check(f"tracepoint {tp}", ok, why if ok else f"missing: no {why}",
                         "a kernel with this tracepoint", required))
    return out


def check_lockdown(cfg: dict[str, str]) -> Check:
    mode = ""
    p = Path("/sys/kernel/security/lockdown")
    if p.exists():
        text = p.read_text()
        mode = text[text.find("[") + 1: text.find("]")] if "[" in text else text.strip()
    elif cfg.get("CONFIG_LOCK_DOWN_KERNEL_FORCE_INTEGRITY") == "y":
        mode = "integrity"
    elif cfg.get("CONFIG_LOCK_DOWN_KERNEL_FORCE_CONFIDENTIALITY") == "y":
        mode = "confidentiality"
    if mode in ("integrity", "confidentiality"):
        detail = f"{mode}: kernel memory reads disabled; memtrack uses uprobes and tracepoints only"
        ok = mode == "integrity"
        fix = "" if ok else "confidentiality lockdown forbids bpf_probe_read_user: boot without it"
        return Check("lockdown", ok, detail, fix, required=False)
    return Check("lockdown", True, mode or "none", required=False)


def check_kernel_hooks(cfg: dict[str, str]) -> Check:
    missing = []
    if cfg.get("CONFIG_KPROBES") != "y":
        missing.append("kprobes")
    if cfg.get("CONFIG_FPROBE") != "y" and cfg:
        missing.append("fprobe")
    detail = (f"not available: {', '.join(missing)} (memtrack does not need them)"
              if missing else "kprobes available (not needed)")
    return Check("kprobes/fentry", True, detail, required=False)


def check_ringbuf_and_uprobe() -> Check:
    """Compile and load a tiny program: a ring buffer and a uprobe on libc's getpid."""
    try:
        from memtrack.capture.bcc_compat import load_probe_test
    except ImportError as e:
        return Check("load test", False, f"cannot import capture: {e}", SETUP)
    try:
        detail = load_probe_test()
    except Exception as e:  # noqa: BLE001 - the message is the diagnosis
        return Check("load test (ringbuf + uprobe)", False, str(e).splitlines()[0][:160], SETUP)
    return Check("load test (ringbuf + uprobe)", True, detail)


def check_uprobe_attach() -> Check:
    """Attach cookies (Linux 5.15+) are required; uprobe_multi links (6.6+) are faster."""
    from memtrack.capture.bcc_compat import uprobe_attach_mode

    try:
        mode = uprobe_attach_mode()
    except Exception as e:  # noqa: BLE001 - the message is the diagnosis
        return Check("allocator probe attach", False, str(e).splitlines()[0][:160],
                     "Linux 5.15 or later (bpf_get_attach_cookie)")
    return Check("allocator probe attach", True, mode)


# /proc/PID/ns/pid of the initial pid namespace (the kernel's PROC_PID_INIT_INO)
INIT_PID_NS = "pid:[4026531836]"
YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")


def check_pid_namespace(link: str | None = None) -> Check:
    """The BPF programs see the kernel's pids (the initial pid namespace's): memtrack
    must see the same ones in /proc. `link`: /proc/self/ns/pid's target (read here)."""
    if link is None:
        try:
            link = os.readlink("/proc/self/ns/pid")
        except OSError as e:
            return Check("pid namespace", False, f"/proc/self/ns/pid: {e.strerror}",
                         "mount /proc")
    ok = link == INIT_PID_NS
    return Check("pid namespace", ok, "the host's" if ok else
                 f"{link}, not the host's: BPF reports the host's pids, /proc shows others",
                 "run memtrack in the host's pid namespace (docker/podman run --pid=host)")


def _ptrace_scope() -> str:
    try:
        return f"{YAMA_SCOPE.read_text().strip()} here"
    except OSError:
        return "Yama is off here"


def check_mapped_files() -> Check:
    """/proc/PID/map_files (following an entry takes CAP_SYS_ADMIN or
    CAP_CHECKPOINT_RESTORE): capture reads each mapped file through it, the file the
    process mapped even if deleted or replaced since; without it, by path
    (memtrack.capture.procfs.mapped_file)."""
    try:  # opened, not read as a link: following the link is what takes the capability
        entry = next(iter(os.listdir("/proc/self/map_files")))
        os.close(os.open(f"/proc/self/map_files/{entry}", os.O_RDONLY | os.O_CLOEXEC))
    except (OSError, StopIteration) as e:
        why = getattr(e, "strerror", None) or "empty"
        return Check("mapped files", False,
                     f"/proc/PID/map_files: {why}; files are read by path: one deleted or "
                     "replaced since it was mapped gets no probes",
                     "CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE", required=False)
    return Check("mapped files", True, "/proc/PID/map_files: the mapped files themselves, "
                 "a container's too", required=False)


def check_attach(scoped: bool | None = None) -> Check:
    """What `capture --pid` needs beyond a spawned capture: pidfd_open (Linux 5.3) to
    see the processes exit. `scoped`: the kernel has uprobe_multi links (None: not
    known, the load test did not run). It uses no ptrace: the ptrace scope is named,
    not checked."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as e:
        return Check("attach (capture --pid)", False,
                     f"not allowed: pidfd_open ({getattr(e, 'strerror', None) or e})",
                     "Linux 5.3 or later", required=False)
    parts = ["allowed (pidfd_open)"]
    if scoped is not None:
        parts.append("probes only in the attached processes" if scoped else
                     "probes host-wide (no uprobe_multi links)")
    parts.append(f"no ptrace, so kernel.yama.ptrace_scope does not matter ({_ptrace_scope()})")
    return Check("attach (capture --pid)", True, "; ".join(parts), required=False)


def check_loop_iterator() -> Check:
    """Whether the BPF loops run on the kernel's number iterator (bpf/common.h MT_LOOP):
    without it the verifier walks every iteration of the stack loops at each start."""
    from memtrack.capture.program import iterator_kfuncs

    if iterator_kfuncs():
        return Check("BPF loops", True, "on the kernel's number iterator (bpf_iter_num): "
                     "the stack capture verifies in ~0.1 s", required=False)
    return Check("BPF loops", False, "bounded: the verifier walks each iteration, ~0.5 s "
                 "more at each capture's start with stacks",
                 "Linux 6.7+ with BTF (/sys/kernel/btf/vmlinux)", required=False)


def run_doctor(console: Console | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False)
    cfg = _kernel_config()
    checks: list[Check] = [check_privileges(), check_bcc(), check_headers(), check_tracefs(),
                           check_uprobes(), check_pid_namespace(), *check_tracepoints(),
                           check_lockdown(cfg), check_kernel_hooks(cfg)]
    scoped = None
    if all(c.ok for c in checks[:5]):
        probe_attach = check_uprobe_attach()
        checks += [check_ringbuf_and_uprobe(), probe_attach]
        scoped = probe_attach.detail.startswith("uprobe_multi") if probe_attach.ok else None
    checks += [check_loop_iterator(), check_mapped_files(), check_attach(scoped)]
    t = Table(title=f"memtrack doctor — {platform.node()} {platform.release()}", show_edge=False)
    for col in ("check", "status", "detail", "fix"):
        t.add_column(col)
    for c in checks:
        status = "[green]ok[/green]" if c.ok else ("[red]missing[/red]" if c.required
                                                   else "[yellow]degraded[/yellow]")
        t.add_row(c.name, status, c.detail, "" if c.ok else c.fix)
    console.print(t)
    bad = [c for c in checks if c.required and not c.ok]
    console.print("capture: [green]ready[/green]" if not bad else
                  f"capture: [red]not ready[/red] ({len(bad)} missing)")
    console.print("capture --pid (attach to a running process) needs the same and the "
                  "attach check: it uses no ptrace, so kernel.yama.ptrace_scope does not "
                  "matter")
    return 1 if bad else 0
