"""The allocator probes of a tracker's program: each ELF file a traced process maps is
classified once per inode (its allocator functions, `allocators.py`), its probes are
placed (`placement.py`: the offset in each function, or left to the C++ runtime's
wrappers, `wrappers.py`) and recorded for the manifest, and it is linked for each
process that maps it (scope "process") or once for every process (scope "host";
`links.py` owns the links).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memtrack.capture.allocators import Probe, probes_for, pymalloc_refusal, read_elf
from memtrack.capture.choices import ProbePlacement
from memtrack.capture.links import UprobeLinks
from memtrack.capture.options import CaptureError, CaptureOptions
from memtrack.capture.parts import CONFIG_WRAPPED
from memtrack.capture.procfs import MapLine
from memtrack.capture.program import LoadError
from memtrack.capture.wrappers import Site, find_wrappers
from memtrack.elf.image import ElfReadError

WRAP_SITES = "mt_wrap_sites"  # bpf/alloc.c


@dataclass
class _Placed:
    """A classified file: the path its probes attach to, the functions still probed and
    their offsets in the function, their records in Probes.records, and the call sites
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


class Probes:
    """The files classified, their probes' records (the manifest's `probes`), and the
    files linked so far per owner (a pid, or 0 for host-wide links)."""

    def __init__(self, bpf: Any, uprobes: UprobeLinks, options: CaptureOptions, scope: str,
                 warnings: list[str]) -> None:
        """`scope`: "process" or "host" (Tracker); `warnings`: the tracker's, appended
        to (a file whose Python allocators cannot be probed, a function refused)."""
        self.bpf = bpf
        self.uprobes = uprobes
        self.options = options
        self.scope = scope
        self.warnings = warnings
        # (st_dev, st_ino) -> the file's probes (None: it has none), and per owner (a
        # pid, or 0 for host-wide links) the files linked for it
        self.classified: dict[tuple[int, int], _Placed | None] = {}
        self.linked: dict[int, set[tuple[int, int]]] = {}
        self.session_files: set[tuple[int, int]] = set()  # the files the session mapped
        self.records: list[dict[str, Any]] = []
        self.wrapping = False  # a wrapper call site is registered (mt_config[2] is on)

    def begin_session(self) -> None:
        """A new session: refused_functions counts the files its tree maps from now on."""
        self.session_files = set()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Links released meanwhile (without `wait`) are held to the tracker's finish,
        not closed: for processes gone, whose links trap nobody, at a session's end."""
        with self.uprobes.holding():
            yield

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
        self.records); None when it has none."""
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
        first = len(self.records)
        wrapping = find_wrappers(open_path, mapped_path, info, probes)
        for p in probes:
            if p.name in wrapping.unprobed:
                self._record(p, mapped_path, build_id, None, wrapping.unprobed[p.name])
        probes = [p for p in probes if p.name not in wrapping.unprobed]
        offsets = {p.name: self._place_probe(p, mapped_path, build_id, code) for p in probes}
        return _Placed(path, probes, offsets, self.records[first:], wrapping.sites)

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
        """The probe's offset in the function (recorded in self.records)."""
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
        self.records.append({
            "path": mapped_path, "build_id": build_id, "function": p.name,
            "family": p.family.name.lower(), "program": p.program if offset is not None
            else None, "vaddr": p.vaddr, "file_offset": p.file_offset,
            "probe_offset": offset, "reason": reason,
            "retprobe": offset is not None and not p.is_free,
        })

