"""Address-space snapshots (mappings.arrow) and copies of the mapped modules.

Each snapshot reads /proc/PID/maps, attaches the build id of every file-backed
mapping (read through /proc/PID/map_files, so a deleted or replaced file still gives
the mapped one) and of the vDSO (read from /proc/PID/mem), and queues a copy of every
executable module not copied yet; `copy_pending` copies them into modules/BUILD_ID/
with their separate debug files.

A process of another mount namespace or root (a container) names its files by paths
that are its own: every file of it is read through /proc/PID/map_files or its
/proc/PID/root (procfs.process_root), never the host's file of the same path, and its
modules are copied even with `copy_modules` off when the host's file at that path is
not the mapped one (`process` could not find them on this host).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from memtrack.capture.procfs import (
    MapLine,
    in_root,
    is_mapped_file,
    map_file,
    own_vdso,
    process_root,
    read_maps,
    read_memory,
)
from memtrack.elf import build_id_of_bytes, find_debug_file, read_build_id
from memtrack.schema import MAPPINGS, VDSO_PATH
from memtrack.schema.artifact import ArtifactWriter


@dataclass
class _Copy:
    build_id: str
    path: str  # where it was mapped (the process's own path)
    sources: list[str]  # files to copy from, first readable wins
    data: bytes | None = None  # the vDSO image
    mapped: MapLine | None = None  # the mapping whose file's build id was read
    root: Path | None = None  # the process's root where it is not memtrack's


class ModuleRecorder:
    def __init__(self, writer: ArtifactWriter, *, copy_modules: bool = True) -> None:
        self.writer = writer
        self.copy_modules = copy_modules
        self._build_ids: dict[tuple[str, int], str | None] = {}
        self._queued: set[str] = set()
        self._pending: list[_Copy] = []
        self._vdso: tuple[bytes, str | None] | None = None
        self.copy_failed = 0
        self.snapshots = 0

    def build_id_of(self, pid: int, m: MapLine, root: Path | None = None) -> str | None:
        """The build id of `pid`'s mapped file: through map_files, else (unreadable
        there) of the file at its path as `pid` sees it (`root`: its process_root,
        looked up when not given)."""
        key = (m.dev, m.inode)
        if key not in self._build_ids:
            bid = read_build_id(map_file(pid, m))
            if bid is None:
                path = in_root(root if root is not None else process_root(pid), m.path)
                if os.path.exists(path):
                    bid = read_build_id(path)
            self._build_ids[key] = bid
        return self._build_ids[key]

    def _copies(self, m: MapLine, bid: str, root: Path | None) -> bool:
        """Whether the module mapped by `m` goes into the artifact: always with
        `copy_modules`, else only a file of another root whose build id the host's
        file of its path does not have (`process` reads host files in place of
        missing copies, by path and build id)."""
        if self.copy_modules:
            return True
        if root is None or is_mapped_file(m.path, m):
            return False
        return not os.path.isfile(m.path) or read_build_id(m.path) != bid

    def _vdso_build_id(self, pid: int, m: MapLine) -> str | None:
        if self._vdso is None:
            data = read_memory(pid, m.start, m.end - m.start)
            if data is None:
                # another process's memory is closed to us (kernel.yama.ptrace_scope 3
                # refuses even root): the kernel maps one vDSO image per ABI into every
                # process, memtrack's own is it where the sizes agree
                data = own_vdso(m.end - m.start)
            if data is None:
                return None
            self._vdso = (data, build_id_of_bytes(data))
        data, bid = self._vdso
        if bid and self.copy_modules and bid not in self._queued:
            self._queued.add(bid)
            self._pending.append(_Copy(bid, VDSO_PATH, [], data))
        return bid

    def snapshot(self, pid: int, ts: int) -> list[MapLine] | None:
        """Write one snapshot of `pid`'s mappings; None when the process is gone."""
        maps = read_maps(pid)
        if maps is None:
            return None
        root = process_root(pid)
        build_ids: list[str | None] = []
        for m in maps:
            bid = None
            if m.path == VDSO_PATH:
                bid = self._vdso_build_id(pid, m)
            elif m.path.startswith("/") and m.inode:
                bid = self.build_id_of(pid, m, root)
                if bid and "x" in m.perms and bid not in self._queued \
                        and self._copies(m, bid, root):
                    self._queued.add(bid)
                    # by path first (it outlives the process: the copy is made after the
                    # stop), then the mapped file itself
                    sources = [in_root(root, m.path), str(map_file(pid, m))]
                    self._pending.append(_Copy(bid, m.path, sources, mapped=m,
                                               root=root))
            build_ids.append(bid)
        n = len(maps)
        self.writer.write("mappings", pa.RecordBatch.from_pydict({
            "ts": [ts] * n,
            "pid": [pid] * n,
            "start": [m.start for m in maps],
            "end": [m.end for m in maps],
            "offset": [m.offset for m in maps],
            "perms": [m.perms for m in maps],
            "dev": [m.dev for m in maps],
            "inode": [m.inode for m in maps],
            "path": [m.path for m in maps],
            "build_id": build_ids,
        }, schema=MAPPINGS))
        self.snapshots += 1
        return maps

    def copy_pending(self) -> None:
        pending, self._pending = self._pending, []
        for c in pending:
            if c.data is not None:
                with tempfile.NamedTemporaryFile(prefix="memtrack-vdso-") as tmp:
                    tmp.write(c.data)
                    tmp.flush()
                    self.writer.add_module(c.build_id, c.path, Path(tmp.name))
                continue
            for src in c.sources:
                # the mapped file itself needs no second look at its build id
                if not (c.mapped and is_mapped_file(src, c.mapped)) \
                        and read_build_id(src) != c.build_id:
                    continue
                try:
                    self.writer.add_module(c.build_id, c.path, Path(src),
                                           find_debug_file(c.path, c.build_id, root=c.root,
                                                           elf=src))
                except OSError:
                    continue
                break
            else:
                self.copy_failed += 1
