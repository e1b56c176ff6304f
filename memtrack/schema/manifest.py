"""manifest.json: what was captured, where, when, how, and what was lost."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

from memtrack.schema import FORMAT_VERSION, LOSS_COUNTERS, is_loss


def _memtrack_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memtrack")
    except PackageNotFoundError:
        return "0+unknown"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class Host:
    kernel: str = ""
    arch: str = ""
    page_size: int = 4096
    boot_id: str = ""
    hostname: str = ""

    @classmethod
    def current(cls) -> Host:
        u = platform.uname()
        return cls(
            kernel=u.release,
            arch=u.machine,
            page_size=os.sysconf("SC_PAGE_SIZE"),
            boot_id=_boot_id(),
            hostname=u.node,
        )


@dataclass
class Clock:
    """Event timestamps are CLOCK_MONOTONIC ns; wall = ts + wall_offset_ns."""

    source: str = "CLOCK_MONOTONIC"
    wall_offset_ns: int = 0

    @classmethod
    def current(cls) -> Clock:
        return cls(wall_offset_ns=time.time_ns() - time.monotonic_ns())


@dataclass
class ExitStatus:
    code: int | None = None  # exit(code)
    signal: int | None = None  # killed by this signal


@dataclass
class Manifest:
    format_version: str = FORMAT_VERSION
    memtrack_version: str = field(default_factory=_memtrack_version)
    host: Host = field(default_factory=Host)
    clock: Clock = field(default_factory=Clock)
    command: list[str] = field(default_factory=list)
    root_pid: int = 0
    exit_status: ExitStatus = field(default_factory=ExitStatus)
    start_ns: int = 0  # CLOCK_MONOTONIC
    end_ns: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    losses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOSS_COUNTERS, 0))
    # Per probed function: where the probe went and why (see capture placement).
    probes: list[dict[str, Any]] = field(default_factory=list)
    # Per module copied into modules/: {"build_id", "path", "file", "debug_file"}.
    modules: list[dict[str, Any]] = field(default_factory=list)
    # Capabilities capture found missing on the host and what that disabled.
    warnings: list[str] = field(default_factory=list)
    # --on-ring-full and what it cost (not losses): {"mode": "pause" | "drop",
    # "pauses": {ring: times a process was stopped for it}, "paused_ns": time the
    # traced processes spent stopped so, summed over them}.
    backpressure: dict[str, Any] = field(default_factory=dict)
    # The drain thread: {"rounds", "bytes" read, "worst_gap_ns" between two reads,
    # "cpu_ns", "backlog_peak_bytes" (read, not written yet)}.
    drain: dict[str, int] = field(default_factory=dict)
    complete: bool = False  # set when capture finished writing every file

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        """Build from parsed JSON; unknown keys (from a newer minor version) are kept out."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if isinstance(kw.get("host"), dict):
            kw["host"] = Host(**_known(Host, kw["host"]))
        if isinstance(kw.get("clock"), dict):
            kw["clock"] = Clock(**_known(Clock, kw["clock"]))
        if isinstance(kw.get("exit_status"), dict):
            kw["exit_status"] = ExitStatus(**_known(ExitStatus, kw["exit_status"]))
        m = cls(**kw)
        for k in LOSS_COUNTERS:
            m.losses.setdefault(k, 0)
        return m

    def nonzero_losses(self) -> dict[str, int]:
        """Counters of lost data that are not zero (fidelity counters left out)."""
        return {k: v for k, v in self.losses.items() if v and is_loss(k)}


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}
