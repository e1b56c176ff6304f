"""`memtrack symbolize --module PATH ADDR...`: frames printed like llvm-symbolizer
--inlines."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

import numpy as np
import pyarrow as pa

from memtrack.addrspace.modules import ModuleError, ModuleStore
from memtrack.commands import CommandError
from memtrack.symbolize import default_cache_dir
from memtrack.symbolize.symbolizer import Symbolizer


def parse_address(text: str) -> int:
    """An ELF virtual address: 0x-prefixed hex, or decimal; ValueError otherwise."""
    t = text.strip().lower()
    try:
        value = int(t, 16) if t.startswith("0x") else int(t, 10)
    except ValueError:
        raise ValueError(f"{text!r} is not an address (use 0x... hex or decimal)") from None
    if not 0 <= value < 1 << 64:
        raise ValueError(f"{text!r} is out of range for a 64-bit address")
    return value


def run(module: Path, addresses: list[str], cache_dir: Path | None, no_cache: bool,
        out: TextIO, err: TextIO) -> int:
    cache = None if no_cache else (cache_dir or default_cache_dir())
    try:
        return run_symbolize(module, addresses, cache, out, err)
    except ValueError as e:
        raise CommandError(f"symbolize: {e}") from None


def run_symbolize(module: Path, addresses: list[str], cache_dir: Path | None,
                  out: TextIO, err: TextIO) -> int:
    """Print each address's frames (function, then file:line:column), innermost first,
    a blank line after each address. Returns the exit status."""
    vaddrs = np.array([parse_address(a) for a in addresses], dtype=np.uint64)
    store = ModuleStore(None)
    try:
        mod = store.add_file(module)
    except ModuleError as e:
        raise ValueError(str(e)) from None
    sym = Symbolizer(store, cache_dir)
    try:
        table = sym.symbolize(pa.array([mod.build_id] * len(vaddrs), pa.string()), vaddrs)
    finally:
        sym.close()
    for r in table.to_pylist():
        if r["inline_depth"] == 0 and r["row"]:
            out.write("\n")
        out.write(f"{r['function']}\n{r['file'] or '??'}:{r['line']}:{r['column']}\n")
    out.write("\n")
    for p in sym.problems:
        err.write(f"memtrack: {p}\n")
    return 0
