"""`memtrack export`: folded stacks, pprof and speedscope from a run database.

All three read one per-(stack, process) cost table (calls, bytes allocated, bytes alive
at the process's heap peak, bytes leaked) and each stack's frames from the allocation
site outward; the allocator function itself (depth 0) is left out, as in the report, so
an export's totals equal `memtrack report`'s. The loops here run over distinct stacks
and frames, never over events.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

FORMATS = ("folded", "pprof", "speedscope")
METRICS = ("allocated", "calls", "peak", "leaked")
NO_STACK = "[no stack]"


Frames = tuple[int, ...]  # a stack's physical frame ids from the allocation site outward


@dataclass
class Costs:
    """The four metrics per (frame sequence, pid): stacks whose bytes differed but that
    unwound to the same frames are one row. Plus the frames' inline levels."""

    # (frames or None where no stack was captured, pid, calls, bytes, peak allocations,
    #  peak bytes, leaked allocations, leaked bytes)
    rows: list[tuple[Frames | None, int, int, int, int, int, int, int]]
    # frame_id -> inline levels innermost first: (name, file, line, module_id)
    frames: dict[int, list[tuple[str, str | None, int | None, int | None]]]
    processes: dict[int, str]
    modules: list[tuple[int, str, str | None]]  # module_id, path, build_id

    def levels(self, key: Frames | None) -> list[tuple[str, str | None, int | None]]:
        """Logical frames (name, file, line) from the allocation site outward."""
        out = [lv[:3] for f in key or () for lv in self.frames[f]]
        return out or [(NO_STACK, None, None)]

    def names(self, key: Frames | None) -> list[str]:
        return [lv[0] for lv in self.levels(key)]


def costs(con: duckdb.DuckDBPyConnection, pid: int | None = None) -> Costs:
    where = "TRUE" if pid is None else f"pid = {int(pid)}"
    raw = con.execute(f"""
        WITH a AS (
            SELECT stack_id, pid, count(*) AS calls, sum(size) AS bytes
            FROM allocations WHERE {where} GROUP BY ALL),
        p AS (SELECT stack_id, pid, count(*) AS n, sum(size) AS bytes FROM peak
              WHERE {where} GROUP BY ALL),
        l AS (SELECT stack_id, pid, count(*) AS n, sum(size) AS bytes FROM leaks
              WHERE {where} GROUP BY ALL),
        seq AS (
            SELECT stack_id, list(frame_id ORDER BY depth) FILTER (WHERE depth > 0) AS fids
            FROM stack_frames WHERE stack_id IN (SELECT stack_id FROM a) GROUP BY stack_id)
        SELECT CASE WHEN a.stack_id IS NOT NULL THEN coalesce(s.fids, []) END AS key, a.pid,
               sum(a.calls)::BIGINT, sum(a.bytes)::BIGINT, sum(coalesce(p.n, 0))::BIGINT,
               sum(coalesce(p.bytes, 0))::BIGINT, sum(coalesce(l.n, 0))::BIGINT,
               sum(coalesce(l.bytes, 0))::BIGINT
        FROM a LEFT JOIN p ON p.stack_id IS NOT DISTINCT FROM a.stack_id AND p.pid = a.pid
               LEFT JOIN l ON l.stack_id IS NOT DISTINCT FROM a.stack_id AND l.pid = a.pid
               LEFT JOIN seq s ON s.stack_id = a.stack_id
        GROUP BY 1, 2 ORDER BY 2, 1 NULLS FIRST""").fetchall()
    rows = [(tuple(k) if k is not None else None, *rest) for k, *rest in raw]
    frames: dict[int, list[tuple[str, str | None, int | None, int | None]]] = {}
    for fid, name, file, line, mid in con.execute(f"""
            SELECT frame_id, name, file, line, module_id FROM frames
            WHERE frame_id IN (SELECT DISTINCT frame_id FROM stack_frames WHERE stack_id IN (
                SELECT DISTINCT stack_id FROM allocations WHERE {where}))
            ORDER BY frame_id, inline_depth""").fetchall():
        frames.setdefault(fid, []).append((name, file, line, mid))
    procs = {p: n or "?" for p, n in con.execute("SELECT pid, name FROM processes").fetchall()}
    modules = con.execute("SELECT module_id, path, build_id FROM modules ORDER BY 1").fetchall()
    return Costs(rows, frames, procs, modules)  # type: ignore[arg-type]


def _metric(row: tuple, metric: str) -> int:
    return {"calls": row[2], "allocated": row[3], "peak": row[5], "leaked": row[7]}[metric]


def _root(c: Costs, pid: int) -> str:
    return f"{c.processes.get(pid, '?')} ({pid})"


def folded(c: Costs, metric: str) -> str:
    """flamegraph.pl / inferno input: `process;outermost;...;site VALUE` per line."""
    acc: dict[str, int] = {}
    for row in c.rows:
        v = _metric(row, metric)
        if v <= 0:
            continue
        names = [_root(c, row[1]), *reversed(c.names(row[0]))]
        key = ";".join(n.replace(";", ":").replace("\n", " ") for n in names)
        acc[key] = acc.get(key, 0) + v
    return "".join(f"{k} {v}\n" for k, v in sorted(acc.items()))


def speedscope(c: Costs, metric: str, name: str = "memtrack") -> dict[str, Any]:
    """speedscope's file format: one sampled profile per metric, `metric` first."""
    frame_index: dict[tuple[str, str | None, int | None], int] = {}
    shared: list[dict[str, Any]] = []

    def idx(key: tuple[str, str | None, int | None]) -> int:
        if key not in frame_index:
            frame_index[key] = len(shared)
            entry: dict[str, Any] = {"name": key[0]}
            if key[1]:
                entry["file"] = key[1]
            if key[2]:
                entry["line"] = key[2]
            shared.append(entry)
        return frame_index[key]

    stacks = []
    for row in c.rows:
        outer_first = [(_root(c, row[1]), None, None), *reversed(c.levels(row[0]))]
        stacks.append([idx(k) for k in outer_first])
    profiles = []
    for m in (metric, *[x for x in METRICS if x != metric]):
        samples, weights = [], []
        for row, st in zip(c.rows, stacks, strict=True):
            v = _metric(row, m)
            if v > 0:
                samples.append(st)
                weights.append(v)
        total = sum(weights)
        profiles.append({
            "type": "sampled", "name": f"{name}: {m}",
            "unit": "none" if m == "calls" else "bytes",
            "startValue": 0, "endValue": total, "samples": samples, "weights": weights,
        })
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": shared},
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": "memtrack",
    }


# --- pprof (profile.proto), encoded by hand: only varints and length-delimited fields.

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_varint(num: int, n: int) -> bytes:
    return _varint(num << 3) + _varint(n)


def _field_bytes(num: int, data: bytes) -> bytes:
    return _varint((num << 3) | 2) + _varint(len(data)) + data


def _packed(num: int, values: Iterable[int]) -> bytes:
    return _field_bytes(num, b"".join(_varint(v) for v in values))


class _Strings:
    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}

    def __call__(self, s: str | None) -> int:
        s = s or ""
        if s not in self.index:
            self.index[s] = len(self.index)
        return self.index[s]


PPROF_SAMPLE_TYPES = (("alloc_objects", "count"), ("alloc_space", "bytes"),
                      ("inuse_objects", "count"), ("inuse_space", "bytes"))


def pprof(c: Costs, duration_ns: int = 0, time_ns: int = 0) -> bytes:
    """A gzipped profile.proto: sample types alloc_objects, alloc_space, inuse_objects,
    inuse_space (inuse = still allocated when the process ended: the leaks), with a
    numeric `pid` label per sample."""
    s = _Strings()
    out = bytearray()
    for typ, unit in PPROF_SAMPLE_TYPES:
        out += _field_bytes(1, _field_varint(1, s(typ)) + _field_varint(2, s(unit)))
    functions: dict[tuple[str, str | None], int] = {}
    fn_msgs = bytearray()

    def function_id(name: str, file: str | None) -> int:
        key = (name, file)
        if key not in functions:
            fid = len(functions) + 1
            functions[key] = fid
            msg = (_field_varint(1, fid) + _field_varint(2, s(name)) +
                   _field_varint(3, s(name)) + _field_varint(4, s(file)))
            fn_msgs.extend(_field_bytes(5, msg))
        return functions[key]

    no_stack_loc = max(c.frames, default=-1) + 2  # after every frame_id + 1
    locations = bytearray()
    for fid in sorted(c.frames):
        levels = c.frames[fid]
        msg = _field_varint(1, fid + 1)
        mid = levels[0][3]
        if mid is not None:
            msg += _field_varint(2, mid + 1)
        for name, file, line, _ in levels:  # innermost first, callers last
            msg += _field_bytes(4, _field_varint(1, function_id(name, file)) +
                                _field_varint(2, line or 0))
        locations += _field_bytes(4, msg)
    locations += _field_bytes(4, _field_varint(1, no_stack_loc) + _field_bytes(
        4, _field_varint(1, function_id(NO_STACK, None))))
    pid_key = s("pid")
    for row in c.rows:
        locs = [f + 1 for f in row[0]] if row[0] else [no_stack_loc]
        values = (row[2], row[3], row[6], row[7])
        label = _field_bytes(3, _field_varint(1, pid_key) + _field_varint(3, row[1]))
        out += _field_bytes(2, _packed(1, locs) + _packed(2, values) + label)
    for mid, path, build_id in c.modules:
        msg = (_field_varint(1, mid + 1) + _field_varint(5, s(path)) +
               _field_varint(6, s(build_id)) + _field_varint(7, 1) + _field_varint(8, 1))
        out += _field_bytes(3, msg)
    out += locations
    out += fn_msgs
    strings = list(s.index)  # insertion order == index order
    for st in strings:
        out += _field_bytes(6, st.encode())
    if time_ns:
        out += _field_varint(9, time_ns)
    if duration_ns:
        out += _field_varint(10, duration_ns)
    out += _field_bytes(11, _field_varint(1, s.index["alloc_space"]) +
                        _field_varint(2, s.index["bytes"]))
    out += _field_varint(14, s.index["alloc_space"])
    return gzip.compress(bytes(out))


def export_run(
    con: duckdb.DuckDBPyConnection, fmt: str, output: Path, *, metric: str = "allocated",
    pid: int | None = None,
) -> None:
    """Write the run in `fmt` (one of FORMATS) to `output`."""
    c = costs(con, pid)
    meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    start, end = int(meta.get("start_ns", 0) or 0), int(meta.get("end_ns", 0) or 0)
    wall = int(meta.get("wall_offset_ns", 0) or 0)
    if fmt == "folded":
        output.write_text(folded(c, metric))
    elif fmt == "speedscope":
        name = " ".join(json.loads(meta.get("command", "[]"))) or "memtrack"
        output.write_text(json.dumps(speedscope(c, metric, name)))
    elif fmt == "pprof":
        output.write_bytes(pprof(c, max(end - start, 0), start + wall if start else 0))
    else:
        raise ValueError(f"unknown export format {fmt!r}")
