"""What capture/modules.py imports until capture switches to memtrack.elf (then this
module goes): build ids and debug files now live there."""

from memtrack.elf import build_id_of_bytes, find_debug_file, read_build_id

__all__ = ["build_id_of_bytes", "find_debug_file", "read_build_id"]
