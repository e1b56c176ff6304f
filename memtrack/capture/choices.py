"""The values of capture's options that take one of a few (memtrack.capture.options):
standard library only, so that the command line shows and completes them at no cost
to its start (a dataclass costs its generated methods' compile)."""

from __future__ import annotations

import enum


class Choice(enum.StrEnum):
    """An option with a few values; a member is its value (the manifest records it as
    that string)."""

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]

    @classmethod
    def expected(cls) -> str:
        """"python or mixed": what an error says was expected."""
        return " or ".join(cls.values())


class PythonStacks(Choice):
    """--python-stacks: PYTHON: a thread running Python code keeps the allocator and its
    caller of the native stack, its Python frames stand for the rest (one record per
    Python call path); MIXED: the whole native stack, Python frames merged in."""

    PYTHON = "python"
    MIXED = "mixed"


class ProbePlacement(Choice):
    """--probe-placement: AUTO: a cheap instruction (capture/placement.py); ENTRY:
    offset 0."""

    AUTO = "auto"
    ENTRY = "entry"


class ProbeScope(Choice):
    """--probe-scope: AUTO: each traced process's own probes where the kernel has
    uprobe_multi links; HOST: every process on the machine."""

    AUTO = "auto"
    HOST = "host"


class OnRingFull(Choice):
    """--on-ring-full: PAUSE: stop the producer until the ring drained; DROP: count what
    a full ring drops."""

    PAUSE = "pause"
    DROP = "drop"


class UprobeAttach(Choice):
    """How allocator probes reach the kernel (capture/links.py): AUTO takes uprobe_multi
    links where the kernel has them."""

    AUTO = "auto"
    UPROBE_MULTI = "uprobe_multi"
    PERF_EVENT = "perf_event"

    @property
    def multi(self) -> bool | None:
        """UprobeLinks' `multi`: None lets it find out."""
        return {"auto": None, "uprobe_multi": True, "perf_event": False}[self.value]
