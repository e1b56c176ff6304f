"""manifest.json: what was captured, where, when, how, and what was lost."""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from memtrack import __version__
from memtrack.schema import FORMAT_MAJOR, FORMAT_VERSION, LOSS_COUNTERS, is_loss

# The manifest's types are its schema: Manifest.decode checks every field of an
# untrusted manifest.json against them (msgspec: strict types, bounds, no coercion of
# "yesterday" into a time), so that no reader meets a list where it expects an int.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # a counter or a ns time
Pid = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Code = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]  # an exit code or signal
PageSize = Annotated[int, msgspec.Meta(ge=512, le=2**30)]


class ManifestError(ValueError):
    """manifest.json does not match the manifest's schema (worded for one line)."""


def _read_id(path: str) -> str:
    """A one-line file of this host (/etc/machine-id, the boot id, the THP mode), ""
    when there is none."""
    try:
        with open(path) as f:
            return f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _thp_mode() -> str:
    """This host's transparent-hugepage mode ("always", "madvise", "never"), or ""."""
    m = re.search(r"\[(\w+)\]", _read_id("/sys/kernel/mm/transparent_hugepage/enabled"))
    return m[1] if m else ""


@dataclass
class Host:
    kernel: str = ""
    arch: str = ""
    page_size: PageSize = 4096
    boot_id: str = ""
    hostname: str = ""
    # /etc/machine-id (format 2.4): with the boot id, what says a run was captured on
    # the machine reading it, in the boot it runs (ModuleStore's host modules)
    machine_id: str = ""
    # /sys/kernel/mm/transparent_hugepage/enabled's mode (format 2.6; before, capture
    # kept it in options.extra["thp_enabled"]): the anon RSS replay's huge pages
    thp_enabled: str = ""

    @classmethod
    def current(cls) -> Host:
        u = platform.uname()
        return cls(
            kernel=u.release,
            arch=u.machine,
            page_size=os.sysconf("SC_PAGE_SIZE"),
            boot_id=_read_id("/proc/sys/kernel/random/boot_id"),
            hostname=u.node,
            machine_id=_read_id("/etc/machine-id"),
            thp_enabled=_thp_mode(),
        )

    def captured_here(self) -> bool:
        """Whether this host is the one the run was captured on, in the same boot: the
        same machine id and boot id, both known (a hostname proves nothing)."""
        here = Host.current()
        return bool(self.machine_id and self.boot_id) and (
            (self.machine_id, self.boot_id) == (here.machine_id, here.boot_id))


@dataclass
class Clock:
    """Event timestamps are CLOCK_MONOTONIC ns; wall = ts + wall_offset_ns."""

    source: str = "CLOCK_MONOTONIC"
    wall_offset_ns: Annotated[int, msgspec.Meta(ge=-(2**62), le=2**62)] = 0

    @classmethod
    def current(cls) -> Clock:
        return cls(wall_offset_ns=time.time_ns() - time.monotonic_ns())


@dataclass
class ExitStatus:
    code: Code | None = None  # exit(code)
    signal: Code | None = None  # killed by this signal


# Every value of a manifest, the free-form ones (options, probes, cost) too, is
# bounded before anything walks it (`info` prints them; 900 nested dicts overflowed
# Python's stack): how deep it nests and how long a string is.
MAX_DEPTH = 16
MAX_STRING = 1 << 20  # a command line's argument is at most 128 KiB


def _check_shape(raw: Any) -> None:
    """ManifestError unless every value nests at most MAX_DEPTH deep and every string
    (a key too) holds at most MAX_STRING characters."""
    todo = [(raw, 0)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ManifestError(f"a value nested more than {MAX_DEPTH} deep")
        if isinstance(v, dict):
            todo.extend((k, depth + 1) for k in v)
            todo.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            todo.extend((x, depth + 1) for x in v)
        elif isinstance(v, str) and len(v) > MAX_STRING:
            raise ManifestError(f"a string of {len(v):,} characters, more than {MAX_STRING:,}")


@dataclass
class Manifest:
    format_version: str = FORMAT_VERSION
    memtrack_version: str = __version__
    host: Host = field(default_factory=Host)
    clock: Clock = field(default_factory=Clock)
    command: list[str] = field(default_factory=list)  # attached: the first pid's cmdline
    root_pid: Pid = 0
    # `capture --pid`: per process attached to, {"pid", "ts" (CLOCK_MONOTONIC ns: when
    # it was tracked, stopped), "rss": {"file", "anon", "shmem": bytes resident then}};
    # empty for a spawned command. Blocks allocated before are not known.
    attached: list[dict[str, Any]] = field(default_factory=list)
    exit_status: ExitStatus = field(default_factory=ExitStatus)
    start_ns: Count = 0  # CLOCK_MONOTONIC
    end_ns: Count = 0
    options: dict[str, Any] = field(default_factory=dict)
    losses: dict[str, Count] = field(default_factory=lambda: dict.fromkeys(LOSS_COUNTERS, 0))
    # Per probed function: where the probe went and why (see capture placement).
    probes: list[dict[str, Any]] = field(default_factory=list)
    # Where the allocator probes fired: "process" (only in the traced tree's processes,
    # each with links of its own) or "host" (every process on the host, filtered in
    # BPF); "" in artifacts from before the choice existed (host).
    probe_scope: str = ""
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
    drain: dict[str, Count] = field(default_factory=dict)
    # What the capture itself took: {"main_cpu_ns" (attach stops, control), "writer_cpu_ns"
    # (Arrow, compression, writes), "bpf": {program: {"run_ns", "runs"}}: the BPF
    # programs' own run time, counted while kernel.bpf_stats_enabled is on (else {})}.
    cost: dict[str, Any] = field(default_factory=dict)
    complete: bool = False  # set when capture finished writing every file
    # Per finished table file ("events.arrow"): "blake2b:HEX" of its bytes, written with
    # `complete`; a reader that finds a file whose bytes differ names it as damaged.
    checksums: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # options.extra: where formats before 2.6 kept thp_enabled (anon_replay.thp_mode)
        if not isinstance(self.options.get("extra", {}), dict):
            raise ValueError("options.extra is not an object")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        """Build from parsed JSON, every field checked against its type (ManifestError);
        unknown keys (from a newer minor version) are left out."""
        try:
            m = msgspec.convert(d, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ManifestError(f"malformed manifest ({e})") from None
        for k in LOSS_COUNTERS:
            m.losses.setdefault(k, 0)
        return m

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """manifest.json's bytes -> Manifest (ManifestError: not JSON, a format this
        memtrack does not read, or not this schema)."""
        try:
            raw = msgspec.json.decode(data, type=dict[str, Any])
        except msgspec.ValidationError:
            raise ManifestError("not a JSON object") from None
        except msgspec.DecodeError as e:
            raise ManifestError(f"not valid JSON ({e})") from None
        except RecursionError:
            raise ManifestError("not valid JSON (nested too deeply)") from None
        _check_shape(raw)
        version = raw.get("format_version", "")
        try:
            major = int(str(version).split(".")[0])
        except ValueError:
            raise ManifestError(f"bad format_version {version!r}") from None
        if major > FORMAT_MAJOR:
            raise ManifestError(
                f"format {version} is newer than this memtrack reads ({FORMAT_MAJOR}.x); "
                "upgrade memtrack")
        if major < FORMAT_MAJOR:
            raise ManifestError(
                f"format {version} is older than this memtrack reads ({FORMAT_MAJOR}.x: "
                "stack records are skeletons since 2.0); capture again")
        return cls.from_dict(raw)

    def nonzero_losses(self) -> dict[str, int]:
        """Counters of lost data that are not zero (fidelity counters left out)."""
        return {k: v for k, v in self.losses.items() if v and is_loss(k)}

