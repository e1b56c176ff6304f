"""The per-build-id symbolization cache: flat tables as Parquet files.

CACHE_DIR/symbolize/v1/KEY/ (KEY.nodebug/ when no debug file was found; KEY is
Module.cache_key, the build id and a hash of the module's files)
holds the module's symbol tables (symbols.parquet, symbols_debug.parquet), its unit
index (units.parquet) and, in part files written by each run that parsed new
compilation units, those units' line rows, frame ranges, frame nodes and file names
(lines-ID.parquet, ranges-ID.parquet, nodes-ID.parquet, files-ID.parquet). The key
names the exact bytes of a module (a corrupt copy under a genuine build id has a key of
its own), so entries never go stale; a second run over the
same modules reads these files and parses no DWARF. Files are written under a
temporary name and renamed, so concurrent runs never read half a file.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memtrack.dwarf.lines import CuTables
from memtrack.elf import SymbolTable

CACHE_VERSION = "v1"
MAX_PARTS = 8


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memtrack"


def _write(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _split(cu: np.ndarray) -> dict[int, slice]:
    """Rows of each unit in a table sorted by unit offset."""
    if len(cu) == 0:
        return {}
    bounds = np.flatnonzero(cu[1:] != cu[:-1]) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(cu)]))
    return {int(cu[s]): slice(int(s), int(e)) for s, e in zip(starts, ends, strict=True)}


def _symtab_of(t: pa.Table) -> SymbolTable:
    return SymbolTable(t["start"].to_numpy().astype(np.uint64),
                       t["size"].to_numpy().astype(np.uint64),
                       t["name"].to_pylist(), t["file"].to_pylist())


class ModuleCache:
    def __init__(self, cache_dir: Path, key: str, with_debug_file: bool) -> None:
        # what a module yields depends on whether its debug file was found: the two
        # are cached apart, so a debug file installed later is not hidden by the cache
        name = key if with_debug_file else f"{key}.nodebug"
        self.dir = Path(cache_dir) / "symbolize" / CACHE_VERSION / name
        self.symtab = SymbolTable.empty()
        self.symtab_debug = SymbolTable.empty()
        self.cu_lo = self.cu_hi = np.zeros(0, dtype=np.uint64)
        self.cu_off = np.zeros(0, dtype=np.int64)
        self.has_dwarf = False
        self.cus: dict[int, CuTables] = {}

    def load(self) -> bool:
        """Read the cached tables; False when this module is not cached (or unreadable)."""
        meta = self.dir / "meta.json"
        if not meta.is_file():
            return False
        try:
            info = json.loads(meta.read_text())
            sym = pq.read_table(self.dir / "symbols.parquet")
            sym_debug = pq.read_table(self.dir / "symbols_debug.parquet")
            units = pq.read_table(self.dir / "units.parquet")
            self._load_units()
        except (OSError, ValueError, KeyError, TypeError, RecursionError, pa.ArrowException):
            return False
        self.has_dwarf = bool(info["has_dwarf"])
        self.symtab = _symtab_of(sym)
        self.symtab_debug = _symtab_of(sym_debug)
        self.cu_lo = units["lo"].to_numpy().astype(np.uint64)
        self.cu_hi = units["hi"].to_numpy().astype(np.uint64)
        self.cu_off = units["cu"].to_numpy().astype(np.int64)
        return True

    def _load_units(self) -> None:
        def read(kind: str) -> pa.Table | None:
            parts = sorted(self.dir.glob(f"{kind}-*.parquet"))
            if not parts:
                return None
            t = pa.concat_tables([pq.read_table(p) for p in parts])
            return t.sort_by([("cu", "ascending"), ("i", "ascending")])

        lines, ranges, nodes, files = (read(k) for k in ("lines", "ranges", "nodes", "files"))
        if nodes is None or lines is None or ranges is None or files is None:
            return
        cols = {
            "lines": {c: lines[c].to_numpy() for c in ("cu", "addr", "file", "line", "col")},
            "ranges": {c: ranges[c].to_numpy() for c in ("cu", "lo", "hi", "node", "enclosing")},
            "nodes": {c: nodes[c].to_numpy() for c in
                      ("cu", "parent", "inlined", "call_file", "call_line", "call_col")},
        }
        node_names = nodes["name"].to_pylist()
        file_names = files["path"].to_pylist()
        sl = {k: _split(v["cu"]) for k, v in cols.items()}
        sl_files = _split(files["cu"].to_numpy())
        empty = slice(0, 0)
        for cu in set(sl["nodes"]) | set(sl["lines"]) | set(sl["ranges"]) | set(sl_files):
            ln, rg, nd = (sl[k].get(cu, empty) for k in ("lines", "ranges", "nodes"))
            fs = sl_files.get(cu, empty)
            L, R, N = cols["lines"], cols["ranges"], cols["nodes"]
            self.cus[cu] = CuTables(
                line_addr=L["addr"][ln].astype(np.uint64), line_file=L["file"][ln],
                line_line=L["line"][ln], line_col=L["col"][ln], files=file_names[fs],
                rng_lo=R["lo"][rg].astype(np.uint64), rng_hi=R["hi"][rg].astype(np.uint64),
                rng_node=R["node"][rg], rng_enclosing=R["enclosing"][rg],
                node_parent=N["parent"][nd], node_inlined=N["inlined"][nd],
                node_call_file=N["call_file"][nd], node_call_line=N["call_line"][nd],
                node_call_col=N["call_col"][nd], node_name=node_names[nd],
            )

    def store_module(self, symtab: SymbolTable, symtab_debug: SymbolTable, cu_lo: np.ndarray,
                     cu_hi: np.ndarray, cu_off: np.ndarray, has_dwarf: bool) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for table, name in ((symtab, "symbols"), (symtab_debug, "symbols_debug")):
            _write(pa.table({"start": pa.array(table.start, pa.uint64()),
                             "size": pa.array(table.size, pa.uint64()),
                             "name": pa.array(table.names, pa.string()),
                             "file": pa.array(table.files, pa.string())}),
                   self.dir / f"{name}.parquet")
        _write(pa.table({"lo": pa.array(cu_lo, pa.uint64()), "hi": pa.array(cu_hi, pa.uint64()),
                         "cu": pa.array(cu_off, pa.int64())}), self.dir / "units.parquet")
        tmp = self.dir / f".meta.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps({"has_dwarf": has_dwarf}))
        os.replace(tmp, self.dir / "meta.json")

    def store_units(self, new: dict[int, CuTables], known: dict[int, CuTables]) -> None:
        """Write the units parsed by this run (`new`) as one new part. Once a module has
        more than MAX_PARTS parts, all units this run knows (`known`) are written as
        one part instead and the older parts removed (a concurrent run's part removed
        with them only costs that run's units a reparse later)."""
        if not new or not self.dir.is_dir():
            return
        old = sorted(self.dir.glob("lines-*.parquet"))
        compact = len(old) >= MAX_PARTS
        cus = known if compact else new
        part = uuid.uuid4().hex[:16]

        def col(get, dtype) -> np.ndarray:  # noqa: ANN001
            arrs = [np.asarray(get(t)) for t in cus.values()]
            return np.concatenate(arrs).astype(dtype) if arrs else np.zeros(0, dtype)

        def cu_col(count) -> np.ndarray:  # noqa: ANN001
            return np.concatenate([np.full(count(t), cu, dtype=np.int64)
                                   for cu, t in cus.items()])

        def idx_col(count) -> np.ndarray:  # noqa: ANN001
            return np.concatenate([np.arange(count(t), dtype=np.int64) for t in cus.values()])

        def nl(t: CuTables) -> int:
            return len(t.line_addr)

        def nr(t: CuTables) -> int:
            return len(t.rng_lo)

        def nn(t: CuTables) -> int:
            return len(t.node_parent)

        def nf(t: CuTables) -> int:
            return len(t.files)

        tables = {
            "lines": pa.table({
                "cu": cu_col(nl), "i": idx_col(nl),
                "addr": pa.array(col(lambda t: t.line_addr, np.uint64)),
                "file": col(lambda t: t.line_file, np.int32),
                "line": col(lambda t: t.line_line, np.uint32),
                "col": col(lambda t: t.line_col, np.uint32)}),
            "ranges": pa.table({
                "cu": cu_col(nr), "i": idx_col(nr),
                "lo": pa.array(col(lambda t: t.rng_lo, np.uint64)),
                "hi": pa.array(col(lambda t: t.rng_hi, np.uint64)),
                "node": col(lambda t: t.rng_node, np.int32),
                "enclosing": col(lambda t: t.rng_enclosing, np.int32)}),
            "nodes": pa.table({
                "cu": cu_col(nn), "i": idx_col(nn),
                "parent": col(lambda t: t.node_parent, np.int32),
                "inlined": col(lambda t: t.node_inlined, bool),
                "call_file": col(lambda t: t.node_call_file, np.int32),
                "call_line": col(lambda t: t.node_call_line, np.uint32),
                "call_col": col(lambda t: t.node_call_col, np.uint32),
                "name": pa.array([n for t in cus.values() for n in t.node_name], pa.string())}),
            "files": pa.table({
                "cu": cu_col(nf), "i": idx_col(nf),
                "path": pa.array([f for t in cus.values() for f in t.files], pa.string())}),
        }
        for kind, t in tables.items():
            _write(t, self.dir / f"{kind}-{part}.parquet")
        if compact:
            for p in old:
                pid = p.name[len("lines-"):]
                for kind in tables:
                    (self.dir / f"{kind}-{pid}").unlink(missing_ok=True)
