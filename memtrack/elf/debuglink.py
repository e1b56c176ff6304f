"""Separate debug files: by build id under the debug roots, else by .gnu_debuglink."""

from __future__ import annotations

import zlib
from pathlib import Path

from memtrack.elf.image import ElfImage, ElfReadError, read_build_id

DEBUG_ROOTS = (Path("/usr/lib/debug"),)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


def find_debug_file(path: str | Path, build_id: str | None = None,
                    debug_roots: tuple[Path, ...] = DEBUG_ROOTS,
                    artifact: Path | None = None, *, root: Path | None = None,
                    elf: str | Path | None = None) -> Path | None:
    """The separate debug file of `path`: by build id under each debug root
    (.build-id/xx/rest.debug), then by .gnu_debuglink next to the file, in its .debug/
    directory and under the debug roots, with the link's CRC checked. `artifact`: `path`
    is a module copy of this artifact, and a file beside it is one of the artifact's
    (memtrack.schema.artifact.artifact_file: no symlink out, a regular file) or none.
    `root`: `path` is a traced process's own path and this its root (a container's
    /proc/PID/root): the debug roots and the link's directories are looked up inside
    it first (the host's debug roots after, by build id or CRC), and `path` is not
    resolved (a /proc/PID/maps path names the file itself). `elf`: the file to read
    the link from, where it is not `path` (/proc/PID/map_files/...)."""
    path = Path(path)
    elf = Path(elf) if elf is not None else (path if root is None else
                                             root / str(path).lstrip("/"))
    if root is not None:
        debug_roots = (*(root / str(r).lstrip("/") for r in debug_roots), *debug_roots)
    build_id = build_id or read_build_id(elf)
    if build_id and len(build_id) > 2:
        for droot in debug_roots:
            cand = droot / ".build-id" / build_id[:2] / f"{build_id[2:]}.debug"
            if cand.is_file():
                return cand
    try:
        with ElfImage(elf) as img:
            link = img.debuglink()
    except ElfReadError:
        return None
    if link is None:
        return None
    name, crc = link
    if "/" in name or name in ("", ".", ".."):
        return None  # the link names a file beside the module, never a path
    d = path.resolve().parent if root is None else path.parent
    beside = [(name,), (".debug", name)]
    if root is not None:
        cands = [root.joinpath(str(d).lstrip("/"), *names) for names in beside]
    elif artifact is None:
        cands = [d.joinpath(*names) for names in beside]
    else:
        from memtrack.schema.artifact import ArtifactError, artifact_file

        inner = d.relative_to(Path(artifact).resolve()).parts
        cands = []
        for names in beside:
            try:
                cands.append(artifact_file(Path(artifact), *inner, *names))
            except (ArtifactError, OSError):
                continue
    cands += [droot / str(d).lstrip("/") / name for droot in debug_roots]
    for cand in cands:
        if cand.is_file() and cand.resolve() != elf.resolve() and _crc32(cand) == crc:
            return cand
    return None
