"""pprof's profile.proto, gzipped, encoded by hand: only varints and length-delimited
fields (what `go tool pprof` reads)."""

from __future__ import annotations

import gzip
from collections.abc import Iterable

from memtrack.report.reader import NO_STACK, Costs, RunReader


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
        locs = [f + 1 for f in row.backtrace] if row.backtrace else [no_stack_loc]
        values = (row.calls, row.allocated, row.leaked_calls, row.leaked)
        label = _field_bytes(3, _field_varint(1, pid_key) + _field_varint(3, row.pid))
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


def render(run: RunReader, metric: str) -> bytes:
    """The profile of the run (`metric` is pprof's choice, not the file's: all four
    sample types are in it)."""
    start, end = run.start_ns, int(run.meta.get("end_ns", 0) or 0)
    wall = int(run.meta.get("wall_offset_ns", 0) or 0)
    return pprof(run.costs(), max(end - start, 0), start + wall if start else 0)
