"""Modules: the ELF files that symbolization and unwinding read, found by build id.

A module comes from an artifact's `modules/BUILD_ID/` copy (module.json says which file
is the ELF and which its separate debug file), or, with `host_modules=True`, from the
path it was mapped from on this host once it is known to be a regular file of a bounded
size whose build id is the mapping's (`process`'s default only for a run captured on
this host, memtrack.schema.manifest.Host.captured_here). Its debug file is the
artifact's copy, else the host's `/usr/lib/debug/.build-id/` file of the same build id
(or a .gnu_debuglink with a matching CRC).

Address normalization: a runtime address becomes a file offset through its mapping
(`addr - start + offset`), and a file offset becomes an ELF virtual address through the
PT_LOAD segment holding it (`Module.file_offset_to_vaddr`, memtrack.elf.Segments).
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memtrack.elf import (
    DEBUG_ROOTS,
    ElfImage,
    ElfReadError,
    Segments,
    find_debug_file,
    read_build_id,
)
from memtrack.schema import VDSO_PATH
from memtrack.schema.artifact import BUILD_ID, module_copies
from memtrack.schema.manifest import Host

# the largest host file read as a module (libLLVM is ~150 MiB; a debug file can be GiBs)
MAX_HOST_MODULE_BYTES = 4 << 30


def host_modules_for(host: Host, asked: bool | None) -> tuple[bool, str]:
    """Whether host files stand in for modules an artifact lacks: as `asked`, else only
    for a run captured on this machine in this boot (`host`, the manifest's); and the
    note that says they are off and how to force them ("" when none)."""
    if asked is not None or host.captured_here():
        return asked is not False, ""
    return False, ("host modules off: the run was not captured on this machine in this "
                   "boot (machine id and boot id); only the artifact's module copies are "
                   "read (--host-modules on reads this host's files at the mapped paths)")


class ModuleError(Exception):
    """A module file that cannot be read as an ELF (worded for one line)."""


@dataclass(eq=False)
class Module:
    """One ELF module as symbolization and unwinding see it (hashable by identity)."""

    build_id: str
    path: str  # where it was mapped on the traced host ("[vdso]" for the vDSO)
    elf_path: Path  # the file to read (artifact copy or host file)
    debug_path: Path | None = None  # separate debug file, if any
    _segments: Segments | None = field(default=None, repr=False)
    _dwarf_path: Path | None | bool = field(default=False, repr=False)  # False: not asked
    _digest: str = field(default="", repr=False)

    @property
    def is_vdso(self) -> bool:
        return self.path == VDSO_PATH

    @property
    def name(self) -> str:
        """Short name for messages: the mapped path's basename, `[vdso]` as is."""
        return self.path if self.path.startswith("[") else Path(self.path).name or self.path

    @property
    def segments(self) -> Segments:
        if self._segments is None:
            try:
                with ElfImage(self.elf_path) as img:
                    self._segments = img.segments
            except ElfReadError as e:
                raise ModuleError(str(e)) from None
        return self._segments

    @property
    def cache_key(self) -> str | None:
        """What names this module's entries in the symbol and CFI caches: its build id
        and a hash of the bytes of its files (an artifact's copy can be corrupt or forged
        under a genuine build id: its rows must never serve, or be served by, another
        file's), or None where the build id is not hex (`path:` keys) or a file cannot
        be read."""
        if not BUILD_ID.fullmatch(self.build_id):
            return None
        if not self._digest:
            h = hashlib.blake2b(digest_size=16)
            try:
                for p in (self.elf_path, self.debug_path):
                    if p is not None:
                        with open(p, "rb") as f:
                            h.update(hashlib.file_digest(f, "blake2b").digest())
            except OSError:
                return None
            self._digest = h.hexdigest()
        return f"{self.build_id}-{self._digest}"

    @property
    def dwarf_path(self) -> Path | None:
        """The file that holds the module's DWARF: its debug file where that has it,
        else the module file itself where it has it, else None."""
        if self._dwarf_path is False:
            self._dwarf_path = None
            for path in (self.debug_path, self.elf_path):
                if path is None:
                    continue
                try:
                    with ElfImage(path) as img:
                        if img.has_dwarf:
                            self._dwarf_path = path
                            break
                except ElfReadError:
                    continue
        return self._dwarf_path  # type: ignore[return-value]

    def file_offset_to_vaddr(self, offsets: np.ndarray) -> np.ndarray:
        """ELF virtual addresses (int64) of file offsets, via the PT_LOAD holding each
        offset (within p_filesz); -1 where no segment holds it."""
        return self.segments.file_offset_to_vaddr(offsets)

    def runtime_to_vaddr(
        self, addrs: np.ndarray, map_start: int | np.ndarray, map_offset: int | np.ndarray
    ) -> np.ndarray:
        """ELF virtual addresses of runtime addresses inside a mapping of this module."""
        a = np.asarray(addrs, dtype=np.uint64)
        off = a - np.asarray(map_start, dtype=np.uint64) + np.asarray(map_offset, dtype=np.uint64)
        return self.file_offset_to_vaddr(off)


class ModuleStore:
    """Finds modules by build id: the artifact's copies first, then (with
    `host_modules`) the host file at the mapped path if its build id matches."""

    def __init__(
        self,
        artifact_path: Path | None,
        host_modules: bool = False,
        debug_roots: tuple[Path, ...] = DEBUG_ROOTS,
    ) -> None:
        self.artifact_path = Path(artifact_path) if artifact_path is not None else None
        self.host_modules = host_modules
        self.debug_roots = debug_roots
        self._modules: dict[str, Module] = {}
        self._missing: set[tuple[str, str | None]] = set()
        self.problems: list[str] = []  # one line per module that could not be used
        if self.artifact_path is not None:
            self._scan_artifact(self.artifact_path)

    def _scan_artifact(self, root: Path) -> None:
        """The artifact's module copies (memtrack.schema.artifact validates their
        module.json and paths), each used only if its ELF's own build-id note is the
        build id it is filed under: a copy that is not what it claims gives wrong frames."""
        copies, problems = module_copies(root)
        self.problems.extend(problems)
        for c in copies:
            try:
                with ElfImage(c.elf_path) as img:
                    own = img.build_id
            except ElfReadError:
                own = c.build_id  # unreadable: every frame in it says corrupt-elf
            if own != c.build_id:
                self.problems.append(f"{c.elf_path}: its build id is {own}, not the "
                                     f"{c.build_id} it is filed under; module skipped")
                continue
            debug_path = c.debug_path or self._host_debug(c.elf_path, c.build_id, root)
            self._modules[c.build_id] = Module(c.build_id, c.path or str(c.elf_path),
                                               c.elf_path, debug_path)

    def _host_debug(self, elf_path: Path, build_id: str | None,
                    artifact: Path | None = None) -> Path | None:
        """`artifact`: the one `elf_path` is a copy in (find_debug_file)."""
        if build_id is not None and not BUILD_ID.fullmatch(build_id):
            build_id = None  # a build id names a file under the debug roots: hex only
        found = find_debug_file(elf_path, build_id, self.debug_roots, artifact)
        if found is None or found.resolve() == elf_path.resolve():
            return None
        return found

    def __contains__(self, build_id: str) -> bool:
        return build_id in self._modules

    def __iter__(self):  # noqa: ANN204
        return iter(self._modules.values())

    def get(self, build_id: str, path_hint: str | None = None) -> Module | None:
        """The module of this build id, or None when neither the artifact nor (with
        host_modules) the host file at `path_hint` has it."""
        build_id = build_id.lower()
        mod = self._modules.get(build_id)
        if mod is not None:
            return mod
        if not self.host_modules or not path_hint or (build_id, path_hint) in self._missing:
            return None
        mod = self._host_module(build_id, path_hint)
        if mod is None:
            self._missing.add((build_id, path_hint))
            return None
        self._modules[build_id] = mod
        return mod

    def _host_module(self, build_id: str, path_hint: str) -> Module | None:
        """The host file at `path_hint` if it is a regular file of at most
        MAX_HOST_MODULE_BYTES whose build id is `build_id`. It is opened with O_PATH
        first (which reads nothing and cannot block: a FIFO or a device there is refused
        from its fstat) and its build-id note is the first thing read of it."""
        if path_hint == VDSO_PATH or not path_hint.startswith("/"):
            return None  # the host's vDSO is not the traced one; only the artifact has it
        p = Path(path_hint)
        try:
            fd = os.open(p, os.O_PATH | os.O_CLOEXEC)
        except (OSError, ValueError):
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_HOST_MODULE_BYTES:
                self.problems.append(f"{p}: not a regular file of at most "
                                     f"{MAX_HOST_MODULE_BYTES:,} bytes; host module not read")
                return None
            own = read_build_id(f"/proc/self/fd/{fd}")  # the file fstat saw, not a new one
        finally:
            os.close(fd)
        if own != build_id:
            self.problems.append(f"{p}: build id differs from the traced module {build_id}")
            return None
        return Module(build_id, path_hint, p, self._host_debug(p, build_id))

    def add_file(self, path: Path | str, mapped_path: str | None = None) -> Module:
        """Register a file directly (the `symbolize --module` command); keyed by its
        build id, or by `path:ABSPATH` when it has none."""
        p = Path(path)
        if not p.is_file():
            raise ModuleError(f"{p}: no such file")
        build_id = read_build_id(p)
        key = build_id or f"path:{p.resolve()}"
        mod = Module(key, mapped_path or str(p), p, self._host_debug(p, build_id))
        mod.segments  # noqa: B018 - fail now, with the path, if it is not an ELF
        self._modules[key] = mod
        return mod
