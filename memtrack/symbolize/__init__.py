"""Symbolization: (module build id, ELF vaddr) -> frames with names, file:line, inlines.
Normalization (runtime address -> module and ELF vaddr) is memtrack.addrspace.normalize."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.addrspace.modules import ModuleStore
from memtrack.symbolize.cache import default_cache_dir
from memtrack.symbolize.symbolizer import Symbolizer

__all__ = ["Symbolizer", "default_cache_dir", "symbolize", "symbolize_frames"]


def symbolize(store: ModuleStore, build_ids: pa.Array, vaddrs: np.ndarray, *,
              paths: pa.Array | None = None, cache_dir: Path | None = None) -> pa.Table:
    """One row per (input row, inline level), innermost first (SYMBOLIZED_FRAMES: row,
    inline_depth, function, symbol, offset, file, line, column, reason (null when found)).

    `paths` (optional, per row) names modules in `[unknown] (name+0x...)` frames and
    lets a host-modules store find files; `cache_dir` enables the per-build-id cache."""
    s = Symbolizer(store, cache_dir)
    try:
        return s.symbolize(build_ids, vaddrs, paths)
    finally:
        s.close()


def symbolize_frames(store: ModuleStore, stack_frames: pa.Table) -> pa.Table:
    """symbolize() of the normalized stack frames of the unwind stage
    (UNWOUND_STACK_FRAMES); `row` is the stack frame's row."""
    return symbolize(store, stack_frames.column("build_id").cast(pa.string()).combine_chunks(),
                     stack_frames.column("lookup_vaddr").fill_null(0).to_numpy()
                     .astype(np.uint64),
                     paths=stack_frames.column("path").cast(pa.string()).combine_chunks())
