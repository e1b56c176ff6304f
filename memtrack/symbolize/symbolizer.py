"""(module, ELF vaddr) -> frames: function, file:line, inline chain, innermost first.

The answer follows llvm-symbolizer --inlines: the compilation unit of an address comes
from .debug_aranges (or unit ranges), the innermost frame's file:line from that unit's
line table (last row at or before the address), each outer frame's file:line from the
call site of the inlined subroutine below it, names from linkage names (demangled) else
DW_AT_name, following abstract origins and specifications; the outermost frame takes
the ELF symbol's name where a symbol covers the address. Anything that cannot be
answered becomes `[unknown] (module+0xVADDR)` with a reason, never an exception.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from memtrack.addrspace.modules import Module, ModuleError, ModuleStore
from memtrack.dwarf.lines import CuTables, Dwarf, DwarfError
from memtrack.elf import ElfImage, ElfReadError, SymbolTable
from memtrack.schema.enums import Unresolved, names
from memtrack.schema.stages import SYMBOLIZED_FRAMES
from memtrack.symbolize.cache import ModuleCache
from memtrack.symbolize.demangle import demangle

# Why a frame is unknown (the `reason` column); each is also counted.
NO_MODULE = names(Unresolved)[Unresolved.NO_MODULE]
CORRUPT_ELF = names(Unresolved)[Unresolved.CORRUPT_ELF]
STRIPPED = names(Unresolved)[Unresolved.STRIPPED]
NO_SYMBOL = names(Unresolved)[Unresolved.NO_SYMBOL]

_DWARF_ERRORS = (DwarfError, ElfReadError, IndexError, KeyError, ValueError, struct.error,
                 UnicodeDecodeError, OverflowError)


@dataclass
class Levels:
    """The inline levels of a batch of unique addresses of one module (parallel
    columns, one entry per (address, level))."""

    addr_index: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    function: list[str] = field(default_factory=list)
    symbol: list[str | None] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    file: list[str | None] = field(default_factory=list)
    line: list[int] = field(default_factory=list)
    column: list[int] = field(default_factory=list)
    reason: list[str | None] = field(default_factory=list)

    def add(self, ai: int, depth: int, function: str, symbol: str | None, offset: int,
            file: str | None, line: int, column: int, reason: str | None) -> None:
        self.addr_index.append(ai)
        self.depth.append(depth)
        self.function.append(function)
        self.symbol.append(symbol)
        self.offset.append(offset)
        self.file.append(file)
        self.line.append(line)
        self.column.append(column)
        self.reason.append(reason)


def unknown_name(module: str, vaddr: int) -> str:
    return f"[unknown] ({module}+{vaddr:#x})"


class ModuleSymbolizer:
    """Symbol table, unit index and per-unit tables of one module, parsed lazily and
    kept in the per-build-id cache."""

    def __init__(self, module: Module, cache: ModuleCache | None,
                 counters: dict[str, int]) -> None:
        self.module = module
        self.cache = cache
        self.counters = counters
        self.error: str | None = None  # why the module is unusable (reason), if it is
        self.problems: list[str] = []
        self._images: list[ElfImage] = []
        self._dwarf: Dwarf | None = None
        self._dwarf_image: ElfImage | None = None
        # the module's own symbols (.symtab, else .dynsym): they name the outermost
        # frame, as in llvm-symbolizer; the debug file's full .symtab names what
        # neither they nor DWARF cover (static functions of a stripped module)
        self.symtab = SymbolTable.empty()
        self.symtab_debug = SymbolTable.empty()
        self.cu_lo = self.cu_hi = np.zeros(0, dtype=np.uint64)
        self.cu_off = np.zeros(0, dtype=np.int64)
        self.cus: dict[int, CuTables] = {}
        self._new_cus: dict[int, CuTables] = {}
        self._failed_cus: set[int] = set()
        self.has_dwarf = False
        self._open()

    # ---- loading -------------------------------------------------------------------
    def _open(self) -> None:
        if self.cache is not None and self.cache.load():
            c = self.cache
            self.symtab = c.symtab
            self.symtab_debug = c.symtab_debug
            self.cu_lo, self.cu_hi, self.cu_off = c.cu_lo, c.cu_hi, c.cu_off
            self.cus = dict(c.cus)
            self.has_dwarf = c.has_dwarf
            return
        try:
            elf = ElfImage(self.module.elf_path)
        except ElfReadError as e:
            self.error = CORRUPT_ELF
            self.problems.append(str(e))
            return
        self._images.append(elf)
        dbg = None
        if self.module.debug_path is not None:
            try:
                dbg = ElfImage(self.module.debug_path)
                self._images.append(dbg)
            except ElfReadError as e:
                self.problems.append(f"{e}; using the module's own symbols")
        for img, attr in ((elf, "symtab"), (dbg, "symtab_debug")):
            if img is None:
                continue
            try:
                table, src = img.symbol_table()
            except ElfReadError as e:
                self.problems.append(str(e))
                continue
            if src:
                setattr(self, attr, table)
        # DWARF: from the file Module.dwarf_path names (the debug file, else the module)
        self._dwarf_image = next((img for img in (dbg, elf) if img is not None
                                  and img.path == self.module.dwarf_path), None)
        if self._dwarf_image is not None:
            try:
                self._dwarf = Dwarf(self._dwarf_image.dwarf_sections(), elf.exec_ranges())
                self.cu_lo, self.cu_hi, self.cu_off = self._dwarf.cu_index()
                self.has_dwarf = True
                self.problems.extend(self._dwarf.problems)
            except _DWARF_ERRORS as e:
                self.counters["bad_dwarf"] = self.counters.get("bad_dwarf", 0) + 1
                self.problems.append(f"{self._dwarf_image.path}: DWARF unreadable ({e})")
                self._dwarf = None
        if self.cache is not None:
            try:
                self.cache.store_module(self.symtab, self.symtab_debug, self.cu_lo, self.cu_hi,
                                        self.cu_off, self.has_dwarf)
            except OSError as e:
                self._cache_failed(e)

    def _cache_failed(self, e: OSError) -> None:
        assert self.cache is not None
        self.problems.append(f"{self.cache.dir}: cannot write the symbolization cache "
                             f"({e.strerror or e}); continuing without it")
        self.counters["cache_write_failed"] = self.counters.get("cache_write_failed", 0) + 1
        self.cache = None

    def _dwarf_reader(self) -> Dwarf | None:
        """The DWARF reader, opened on demand when the cache lacks a unit."""
        if self._dwarf is None and self.has_dwarf and not self._images:
            try:
                elf = ElfImage(self.module.elf_path)
                self._images.append(elf)
                dwarf_path = self.module.dwarf_path
                img = elf
                if dwarf_path is not None and dwarf_path != elf.path:
                    img = ElfImage(dwarf_path)
                    self._images.append(img)
                self._dwarf = Dwarf(img.dwarf_sections(), elf.exec_ranges())
            except (*_DWARF_ERRORS, ElfReadError) as e:
                self.problems.append(f"{self.module.elf_path}: DWARF unreadable ({e})")
                self.has_dwarf = False
        return self._dwarf

    def cu(self, offset: int) -> CuTables | None:
        t = self.cus.get(offset)
        if t is not None or offset in self._failed_cus:
            return t
        dw = self._dwarf_reader()
        if dw is None:
            return None
        try:
            t = dw.cu_tables(offset)
        except _DWARF_ERRORS as e:
            self._failed_cus.add(offset)
            self.counters["bad_dwarf_units"] = self.counters.get("bad_dwarf_units", 0) + 1
            self.problems.append(f"{self.module.name}: unit at .debug_info+{offset:#x} "
                                 f"unreadable ({e}); symbols only there")
            return None
        self.cus[offset] = t
        self._new_cus[offset] = t
        return t

    def close(self) -> None:
        if self.cache is not None and self._new_cus:
            try:
                self.cache.store_units(self._new_cus, self.cus)
            except OSError as e:
                self._cache_failed(e)
            self._new_cus = {}
        for img in self._images:
            img.close()
        self._images = []

    # ---- lookups -------------------------------------------------------------------
    def symbolize(self, vaddrs: np.ndarray) -> Levels:
        """Frames of each (unique) address; addr_index refers to the input position."""
        v = np.asarray(vaddrs, dtype=np.uint64)
        out = Levels()
        name = self.module.name
        if self.error is not None:
            for i, a in enumerate(v.tolist()):
                out.add(i, 0, unknown_name(name, a), None, a, None, 0, 0, self.error)
            return out
        sym = self.symtab.lookup(v)
        sym_dbg = self.symtab_debug.lookup(v)
        # innermost-first frames per address: (function raw name, file, line, col)
        chains: list[list[tuple[str | None, str | None, int, int]]] = [[] for _ in range(len(v))]
        if len(self.cu_lo):
            ci = np.searchsorted(self.cu_lo, v, side="right").astype(np.int64) - 1
            cic = np.where(ci >= 0, ci, 0)
            in_cu = (ci >= 0) & (v < self.cu_hi[cic])
            cu_of = np.where(in_cu, self.cu_off[cic], -1)
            for off in np.unique(cu_of[in_cu]).tolist():
                sel = np.flatnonzero(cu_of == off)
                t = self.cu(off)
                if t is not None:
                    _unit_frames(t, v[sel], sel, chains)
        any_symbols = bool(len(self.symtab.start) or len(self.symtab_debug.start))
        for i, a in enumerate(v.tolist()):
            chain = chains[i] or [(None, None, 0, 0)]
            last = len(chain) - 1
            # name of the outermost frame: the module's own symbol, else DWARF's, else
            # the debug file's symbol; offset: from whichever symbol covers the address
            table, s = self.symtab, int(sym[i])
            if s < 0:
                table, s = self.symtab_debug, int(sym_dbg[i])
            offset = a - int(table.start[s]) if s >= 0 else a
            use_symbol = s >= 0 and (table is self.symtab or chain[last][0] is None)
            sym_name = table.names[s] if use_symbol else None
            for d, (raw, file, line, col) in enumerate(chain):
                if d == last and sym_name is not None:
                    raw = sym_name
                    if file is None:
                        file = table.files[s]
                    sd = int(sym_dbg[i])
                    if file is None and sd >= 0 and self.symtab_debug.start[sd] == table.start[s]:
                        file = self.symtab_debug.files[sd]  # strip --strip-debug drops STT_FILE
                if raw is None:
                    reason = NO_SYMBOL if any_symbols or self.has_dwarf else STRIPPED
                    out.add(i, d, unknown_name(name, a), None, offset, file, line, col, reason)
                else:
                    out.add(i, d, demangle(raw), raw, offset, file, line, col, None)
        return out


def _unit_frames(t: CuTables, v: np.ndarray, sel: np.ndarray,
                 chains: list[list[tuple[str | None, str | None, int, int]]]) -> None:
    """Fill the inline chains of addresses `v` (input positions `sel`) in one unit."""
    # innermost file:line from the line table: last row at or before the address
    if len(t.line_addr):
        j = np.searchsorted(t.line_addr, v, side="right").astype(np.int64) - 1
        jc = np.where(j >= 0, j, 0)
        has_line = (j >= 0) & (t.line_file[jc] >= 0)
    else:
        jc = np.zeros(len(v), dtype=np.int64)
        has_line = np.zeros(len(v), dtype=bool)
    # innermost frame node: the latest-starting range at or before the address, then
    # out through enclosing ranges until one contains it
    if len(t.rng_lo):
        k = np.searchsorted(t.rng_lo, v, side="right").astype(np.int64) - 1
        while True:
            kc = np.where(k >= 0, k, 0)
            bad = (k >= 0) & (t.rng_hi[kc] <= v)
            if not bad.any():
                break
            k[bad] = t.rng_enclosing[k[bad]]
        node = np.where(k >= 0, t.rng_node[np.where(k >= 0, k, 0)], -1)
    else:
        node = np.full(len(v), -1, dtype=np.int64)
    files = t.files
    nfiles = len(files)
    for pos, i in enumerate(sel.tolist()):
        if has_line[pos]:
            r = int(jc[pos])
            fi = int(t.line_file[r])
            file = files[fi] if fi < nfiles else None
            line, col = int(t.line_line[r]), int(t.line_col[r])
        else:
            file, line, col = None, 0, 0
        n = int(node[pos])
        chain = chains[i]
        if n < 0:
            chain.append((None, file, line, col))
            continue
        while n >= 0:
            chain.append((t.node_name[n], file, line, col))
            if not t.node_inlined[n]:
                break
            cf = int(t.node_call_file[n])
            file = files[cf] if 0 <= cf < nfiles else None
            line, col = int(t.node_call_line[n]), int(t.node_call_col[n])
            n = int(t.node_parent[n])


class Symbolizer:
    """Symbolizes (build id, vaddr) batches against a ModuleStore, with a cache."""

    def __init__(self, store: ModuleStore, cache_dir: Path | None = None) -> None:
        self.store = store
        self.cache_dir = cache_dir
        self.counters: dict[str, int] = {}  # modules' problems (cache, DWARF), counted
        self.reasons: dict[str, int] = {}  # frames left [unknown], by reason
        self._mods: dict[str, ModuleSymbolizer | None] = {}

    @property
    def problems(self) -> list[str]:
        out = list(self.store.problems)
        for m in self._mods.values():
            if m is not None:
                out.extend(m.problems)
        return out

    def module(self, build_id: str, path_hint: str | None = None) -> ModuleSymbolizer | None:
        if build_id in self._mods:
            return self._mods[build_id]
        mod = self.store.get(build_id, path_hint)
        ms = None
        if mod is not None:
            cache = None
            key = mod.cache_key if self.cache_dir else None  # None for `path:` keys
            if key is not None:
                cache = ModuleCache(self.cache_dir, key, mod.debug_path is not None)
            try:
                ms = ModuleSymbolizer(mod, cache, self.counters)
            except ModuleError as e:
                self.store.problems.append(str(e))
        self._mods[build_id] = ms
        return ms

    def close(self) -> None:
        for m in self._mods.values():
            if m is not None:
                m.close()

    def symbolize(self, build_ids: pa.Array, vaddrs: np.ndarray,
                  paths: pa.Array | None = None) -> pa.Table:
        """One row per (input row, inline level); see SYMBOLIZED_FRAMES."""
        v = np.asarray(vaddrs, dtype=np.uint64)
        n = len(v)
        bid = pa.array(build_ids, type=pa.string()) if not isinstance(
            build_ids, pa.Array | pa.ChunkedArray) else build_ids
        if isinstance(bid, pa.ChunkedArray):
            bid = bid.combine_chunks()
        if len(bid) != n:
            raise ValueError(f"{len(bid)} build ids for {n} addresses")
        enc = bid.dictionary_encode()
        codes = enc.indices.to_numpy(zero_copy_only=False)
        codes = np.where(enc.indices.is_null().to_numpy(zero_copy_only=False), -1,
                         np.nan_to_num(codes, nan=-1)).astype(np.int64)
        dict_ids = enc.dictionary.to_pylist()
        path_list = paths.to_pylist() if paths is not None else None
        parts: list[tuple[np.ndarray, Levels]] = []  # (input rows of each unique addr, frames)
        for g in np.unique(codes).tolist():
            rows = np.flatnonzero(codes == g)
            uniq, inv = np.unique(v[rows], return_inverse=True)
            hint = path_list[int(rows[0])] if path_list is not None else None
            ms = self.module(dict_ids[g], hint) if g >= 0 else None
            if ms is None:
                fr = Levels()
                label = Path(hint).name if hint else (dict_ids[g][:12] if g >= 0 else "?")
                for i, a in enumerate(uniq.tolist()):
                    fr.add(i, 0, unknown_name(label, a), None, a, None, 0, 0, NO_MODULE)
            else:
                fr = ms.symbolize(uniq)
            parts.append((_rows_by_unique(rows, inv, len(uniq)), fr))
        for _, fr in parts:
            for r in fr.reason:
                if r is not None:
                    self.reasons[r] = self.reasons.get(r, 0) + 1
        return _expand(parts)


def _rows_by_unique(rows: np.ndarray, inv: np.ndarray, nuniq: int) -> np.ndarray:
    """Object array: for each unique address, the input rows holding it."""
    order = np.argsort(inv, kind="stable")
    bounds = np.searchsorted(inv[order], np.arange(1, nuniq))
    out = np.empty(nuniq, dtype=object)
    out[:] = np.split(rows[order], bounds)
    return out


def _expand(parts: list[tuple[np.ndarray, Levels]]) -> pa.Table:
    """Frames of unique addresses -> one row per (input row, inline level), sorted."""
    tables = []
    for by_u, fr in parts:
        if not fr.addr_index:
            continue
        ft = pa.table(
            {
                "function": pa.array(fr.function, pa.string()),
                "symbol": pa.array(fr.symbol, pa.string()),
                "offset": pa.array(fr.offset, pa.uint64()),
                "file": pa.array(fr.file, pa.string()),
                "line": pa.array(fr.line, pa.uint32()),
                "column": pa.array(fr.column, pa.uint32()),
                "reason": pa.array(fr.reason, pa.string()),
            }
        )
        ai = np.asarray(fr.addr_index, dtype=np.int64)
        counts = np.array([len(r) for r in by_u], dtype=np.int64)
        reps = counts[ai]
        take = np.repeat(np.arange(len(ai)), reps)
        rows = np.concatenate([by_u[a] for a in ai.tolist()]) if len(ai) else np.zeros(0, int)
        t = ft.take(pa.array(take))
        t = t.add_column(0, "row", pa.array(rows.astype(np.uint32)))
        t = t.add_column(1, "inline_depth", pa.array(
            np.repeat(np.asarray(fr.depth, dtype=np.uint8), reps)))
        tables.append(t)
    if not tables:
        return SYMBOLIZED_FRAMES.empty_table()
    out = pa.concat_tables(tables).cast(SYMBOLIZED_FRAMES)
    return out.sort_by([("row", "ascending"), ("inline_depth", "ascending")])
