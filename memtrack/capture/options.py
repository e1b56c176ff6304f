"""Capture's options: one typed `CaptureOptions`, checked when it is made, and how the
environment sets it (the choices' enums: memtrack.capture.choices).

Every field of CaptureOptions is a `memtrack capture` option: `--NAME` on the command
line (NAME with dashes), `MEMTRACK_<NAME>` in the environment. The command line's
typer options read those variables; `CaptureOptions.from_env` reads them the same way
for the Python API (`memtrack.capture(...)`): an on/off switch takes exactly "on" or
"off", `--start-disabled` and `--fail-on-loss` a boolean as click reads one (1, true,
yes, on ... / 0, false, no, off ...), a number Python's int(), an empty value is
unset. `Tuning` holds the knobs of tests and benchmarks, which have no option.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from memtrack.capture.choices import (
    Choice,
    OnRingFull,
    ProbePlacement,
    ProbeScope,
    PythonStacks,
    UprobeAttach,
)

MAX_RING_PAGES = 1 << 20  # a ring of 4 GiB per CPU
ENV_PREFIX = "MEMTRACK_"
# bool options given as a bare flag (`--fail-on-loss`); every other bool is an on/off
# switch (`--rss off`: memtrack.cli.SWITCH)
FLAGS = ("start_disabled", "fail_on_loss")
_TRUE = ("1", "true", "t", "yes", "y", "on")  # click's BoolParamType
_FALSE = ("0", "false", "f", "no", "n", "off")


class CaptureError(Exception):
    """Capture cannot go on; the message is one line for the user."""


C = TypeVar("C", bound=Choice)


def choose(kind: type[C], value: object, given: str) -> C:
    """`value` as a member of `kind`, or the one-line error "`given`: expected ..."."""
    try:
        return kind(value)
    except ValueError:
        raise CaptureError(f"{given}: expected {kind.expected()}") from None


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


def _floor_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def default_ring_pages(per_cpu: int, *, memory: int | None = None,
                       cpus: int | None = None) -> int:
    """Ring size in pages from the machine: `per_cpu` bytes for every CPU (the producers
    a drain round may have to absorb), at most 1/256 of the memory and 1 GiB, at least
    4 MiB; a power of two."""
    memory = _memory_bytes() if memory is None else memory
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    size = min(max(cpus, 1) * per_cpu, memory // 256, 1 << 30)
    return _floor_pow2(max(size, 4 << 20)) // mmap.PAGESIZE


def _events_ring_pages() -> int:
    return default_ring_pages(16 << 20)


def _stacks_ring_pages() -> int:
    return default_ring_pages(32 << 20)


def _check_pages(name: str, pages: int) -> None:
    if pages <= 0 or pages & (pages - 1) or pages > MAX_RING_PAGES:
        raise CaptureError(f"{name} {pages}: must be a power of two (pages), at most "
                           f"{MAX_RING_PAGES} (4 GiB per CPU)")


def _check_types(obj: Any, flags: bool) -> None:
    """CaptureError unless every field holds its type: a Choice from its value, a bool
    only as a bool, an int not a bool; named as its option (`flags`) or its field."""
    for f in dataclasses.fields(obj):
        value, default = getattr(obj, f.name), _default(f)
        name = _flag(f.name) if flags else f.name
        if isinstance(default, Choice):
            object.__setattr__(obj, f.name, choose(type(default), value, f"{name} {value}"))
        elif not isinstance(value, type(default)) or type(value) is bool is not type(default):
            raise CaptureError(f"{name} {value!r}: expected {type(default).__name__}")


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING \
        else f.default  # type: ignore[misc]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Tuning:
    """Knobs of tests and benchmarks (no command-line option), recorded in the
    manifest's options with the rest."""

    # bpf/common.h mt_threads: one per thread, indexed by the tid's low bits (a power
    # of two; fewer only to test the spill)
    thread_slots: int = 16384
    uprobe_attach: UprobeAttach = UprobeAttach.AUTO
    # bpf/rss.c's rings, in pages (a power of two)
    rss_ring_pages: int = 2048
    rss_events_ring_pages: int = 256
    faults_ring_pages: int = 4096

    def __post_init__(self) -> None:
        _check_types(self, flags=False)
        if self.thread_slots < 1 or self.thread_slots & (self.thread_slots - 1):
            raise CaptureError(f"thread slots {self.thread_slots}: expected a power of two")
        for name in ("rss_ring_pages", "rss_events_ring_pages", "faults_ring_pages"):
            _check_pages(name, getattr(self, name))


@dataclass(frozen=True)
class CaptureOptions:
    """Every capture option, checked when made (CaptureError, worded as `memtrack
    capture` words it); each is `--NAME` and `MEMTRACK_<NAME>` (from_env)."""

    stacks: bool = True
    stack_budget: int = 32768  # at most; a copy stops at the stack's end
    stack_copies: bool = False  # debug: every capture's raw copy too (stack_copies.arrow)
    python_frames: bool = True  # Python frames in the stacks (with stacks on)
    python_stacks: PythonStacks = PythonStacks.PYTHON
    python_allocators: bool = False  # CPython's object allocator probed (family pymalloc)
    rss: bool = True
    track_faults: bool = False
    modules: bool = True
    start_disabled: bool = False
    probe_placement: ProbePlacement = ProbePlacement.AUTO
    probe_scope: ProbeScope = ProbeScope.AUTO
    # ring sizes: 16 / 32 MiB per CPU, at most 1/256 of the memory (default_ring_pages)
    events_ring_pages: int = field(default_factory=_events_ring_pages)
    stacks_ring_pages: int = field(default_factory=_stacks_ring_pages)
    on_ring_full: OnRingFull = OnRingFull.PAUSE
    fail_on_loss: bool = False
    program_cache: str = ""  # where compiled programs are kept ("": the default, "off")
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        _check_types(self, flags=True)
        if self.stacks:  # capture.stacks is imported only then
            from memtrack.capture.stacks import check_budget

            try:
                check_budget(self.stack_budget)
            except ValueError as e:
                raise CaptureError(str(e)) from None
        for name in ("events_ring_pages", "stacks_ring_pages"):
            _check_pages(_flag(name), getattr(self, name))
        if self.on_ring_full is OnRingFull.PAUSE:
            self._check_pause()

    def _check_pause(self) -> None:
        """Each ring's headroom above its high watermark holds what the producers write
        before they stop (drain.min_ring_pages)."""
        from memtrack.capture.drain import min_ring_pages
        from memtrack.schema import EVENT_DTYPE

        cpus = os.cpu_count() or 1
        rings = [("--events-ring-pages", self.events_ring_pages, EVENT_DTYPE.itemsize)]
        if self.stacks:
            from memtrack.capture.stacks import record_words

            rings.append(("--stacks-ring-pages", self.stacks_ring_pages,
                          record_words(self.stack_budget, self.stack_copies) * 8))
        for name, pages, record in rings:
            need = min_ring_pages(record, cpus)
            if pages < need:
                raise CaptureError(f"{name} {pages}: too small to pause the producers in "
                                   f"time on {cpus} CPUs (at least {need})")

    def record(self) -> dict[str, Any]:
        """The options as the manifest records them (a Choice as its value)."""
        return dataclasses.asdict(self, dict_factory=lambda kv: {
            k: v.value if isinstance(v, Choice) else v for k, v in kv})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **given: Any) -> CaptureOptions:
        """The options the `MEMTRACK_<NAME>` variables of `environ` (default: this
        process's) set, read as the command line reads them, then those `given` (as
        an option on the command line wins over its variable). CaptureError names
        the variable of a value that does not parse; TypeError for a name that is
        not an option."""
        environ = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            var = ENV_PREFIX + f.name.upper()
            raw = environ.get(var)
            if f.name == "tuning" or f.name in given or not raw:
                continue
            found[f.name] = _parse(var, f.name, raw, _default(f))
        return cls(**found, **given)


def _parse(var: str, name: str, raw: str, default: Any) -> Any:
    """A variable's value as the command line's option takes it (memtrack.cli)."""
    if isinstance(default, bool):
        if name in FLAGS:
            word = raw.strip().lower()
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
            raise CaptureError(f"{var}={raw}: expected a boolean (1, true, yes, on or 0, "
                               "false, no, off)")
        if raw not in ("on", "off"):
            raise CaptureError(f"{var}={raw}: expected on or off")
        return raw == "on"
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise CaptureError(f"{var}={raw}: expected an integer") from None
    if isinstance(default, Choice):
        return choose(type(default), raw, f"{var}={raw}")
    return raw
