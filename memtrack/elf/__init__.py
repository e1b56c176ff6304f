"""ELF files as memtrack reads them, for capture and process alike: one image object
(memtrack.elf.image.ElfImage) owning segments, sections, symbols, build id, DWARF
presence and debuglink, and the search for separate debug files."""

from memtrack.elf.debuglink import DEBUG_ROOTS, find_debug_file
from memtrack.elf.image import (
    ElfImage,
    ElfReadError,
    Segments,
    build_id_of_bytes,
    read_build_id,
)
from memtrack.elf.symtab import SymbolTable

__all__ = ["DEBUG_ROOTS", "ElfImage", "ElfReadError", "Segments", "SymbolTable",
           "build_id_of_bytes", "find_debug_file", "read_build_id"]
