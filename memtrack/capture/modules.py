"""Address-space snapshots (mappings.arrow) and copies of the mapped modules.

Each snapshot reads /proc/PID/maps, attaches the build id of every file-backed
mapping (read through /proc/PID/map_files, so a deleted or replaced file still gives
the mapped one) and of the vDSO (read from /proc/PID/mem), and queues a copy of every
executable module not copied yet; `copy_pending` copies them into modules/BUILD_ID/
with their separate debug files.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from memtrack.capture.procfs import MapLine, map_file, read_maps, read_memory
from memtrack.elf import build_id_of_bytes, find_debug_file, read_build_id
from memtrack.schema import MAPPINGS, VDSO_PATH
from memtrack.schema.artifact import ArtifactWriter


@dataclass
class _Copy:
    build_id: str
    path: str  # where it was mapped
    sources: list[str]  # files to copy from, first readable wins
    data: bytes | None = None  # the vDSO image
    mapped: tuple[int, int] | None = None  # (st_dev, st_ino) of the file whose id was read


def _identity(m: MapLine) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a mapping's file, from its "major:minor" and inode."""
    major, _, minor = m.dev.partition(":")
    try:
        return os.makedev(int(major, 16), int(minor, 16)), m.inode
    except ValueError:
        return None


def _is_file(path: str, identity: tuple[int, int] | None) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return identity is not None and (st.st_dev, st.st_ino) == identity


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

    def build_id_of(self, pid: int, m: MapLine) -> str | None:
        key = (m.dev, m.inode)
        if key not in self._build_ids:
            src = map_file(pid, m)
            bid = read_build_id(src)
            if bid is None and os.path.exists(m.path):
                bid = read_build_id(m.path)
            self._build_ids[key] = bid
        return self._build_ids[key]

    def _vdso_build_id(self, pid: int, m: MapLine) -> str | None:
        if self._vdso is None:
            data = read_memory(pid, m.start, m.end - m.start)
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
        build_ids: list[str | None] = []
        for m in maps:
            bid = None
            if m.path == VDSO_PATH:
                bid = self._vdso_build_id(pid, m)
            elif m.path.startswith("/") and m.inode:
                bid = self.build_id_of(pid, m)
                if bid and "x" in m.perms and self.copy_modules and bid not in self._queued:
                    self._queued.add(bid)
                    src = str(map_file(pid, m))
                    self._pending.append(_Copy(bid, m.path, [m.path, src], mapped=_identity(m)))
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
                if not _is_file(src, c.mapped) and read_build_id(src) != c.build_id:
                    continue
                try:
                    self.writer.add_module(c.build_id, c.path, Path(src),
                                           find_debug_file(c.path, c.build_id))
                except OSError:
                    continue
                break
            else:
                self.copy_failed += 1
