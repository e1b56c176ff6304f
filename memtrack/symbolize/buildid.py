"""Build ids and separate debug files: what capture and symbolization both key modules by."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

DEBUG_ROOTS = (Path("/usr/lib/debug"),)


def read_build_id(path: str | Path) -> str | None:
    """The GNU build id of an ELF file as lowercase hex, or None (no note, not an ELF)."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            for seg in elf.iter_segments():
                if seg["p_type"] != "PT_NOTE":
                    continue
                for note in seg.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                        return str(note["n_desc"]).lower()
            sec = elf.get_section_by_name(".note.gnu.build-id")
            if sec is not None:
                for note in sec.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        return str(note["n_desc"]).lower()
    except (OSError, ELFError, struct.error, ValueError):
        return None
    return None


def build_id_of_bytes(data: bytes) -> str | None:
    """The build id of an ELF image held in memory (the vDSO)."""
    import io

    try:
        elf = ELFFile(io.BytesIO(data))
        for seg in elf.iter_segments():
            if seg["p_type"] == "PT_NOTE":
                for note in seg.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        return str(note["n_desc"]).lower()
    except (ELFError, struct.error, ValueError):
        return None
    return None


def _debuglink(elf: ELFFile) -> tuple[str, int] | None:
    sec = elf.get_section_by_name(".gnu_debuglink")
    if sec is None:
        return None
    data = sec.data()
    end = data.index(b"\0")
    name = data[:end].decode(errors="replace")
    crc_off = (end + 4) & ~3
    (crc,) = struct.unpack_from("<I", data, crc_off)
    return name, crc


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


def find_debug_file(path: str | Path, build_id: str | None = None,
                    debug_roots: tuple[Path, ...] = DEBUG_ROOTS) -> Path | None:
    """The separate debug file of `path`: by build id under each debug root
    (.build-id/xx/rest.debug), then by .gnu_debuglink next to the file, in its .debug/
    directory and under the debug roots, with the link's CRC checked."""
    path = Path(path)
    build_id = build_id or read_build_id(path)
    if build_id and len(build_id) > 2:
        for root in debug_roots:
            cand = root / ".build-id" / build_id[:2] / f"{build_id[2:]}.debug"
            if cand.is_file():
                return cand
    try:
        with open(path, "rb") as f:
            link = _debuglink(ELFFile(f))
    except (OSError, ELFError, struct.error, ValueError):
        return None
    if link is None:
        return None
    name, crc = link
    d = path.resolve().parent
    cands = [d / name, d / ".debug" / name]
    cands += [root / str(d).lstrip("/") / name for root in debug_roots]
    for cand in cands:
        if cand.is_file() and cand.resolve() != path.resolve() and _crc32(cand) == crc:
            return cand
    return None
