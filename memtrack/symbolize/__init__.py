"""Symbolization: (module build id, ELF vaddr) -> frames with names, file:line, inlines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.symbolize.cache import default_cache_dir
from memtrack.symbolize.modules import Module, ModuleStore
from memtrack.symbolize.symbolizer import FRAMES_SCHEMA, Symbolizer

__all__ = ["FRAMES_SCHEMA", "Module", "ModuleStore", "Symbolizer", "default_cache_dir",
           "symbolize"]


def symbolize(store: ModuleStore, build_ids: pa.Array, vaddrs: np.ndarray, *,
              paths: pa.Array | None = None, cache_dir: Path | None = None) -> pa.Table:
    """One row per (input row, inline level), innermost first: row, inline_depth,
    function, symbol, offset, file, line, column, reason (null when found).

    `paths` (optional, per row) names modules in `[unknown] (name+0x...)` frames and
    lets a host-modules store find files; `cache_dir` enables the per-build-id cache."""
    s = Symbolizer(store, cache_dir)
    try:
        return s.symbolize(build_ids, vaddrs, paths)
    finally:
        s.close()
