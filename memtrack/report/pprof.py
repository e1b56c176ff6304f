"""pprof's profile.proto, gzipped, encoded by hand: only varints and length-delimited
fields (what `go tool pprof` and Pyroscope read).

Sample types: alloc_objects/alloc_space (every allocation), peak_objects/peak_space
(alive at the process's heap peak), leaked_objects/leaked_space (never freed) and
temporary_objects; `--metric` picks the default one. Every location is a real
runtime address in a mapping of the process whose stack it is (mapping 1: the traced
executable), with its function, file and line per inline level. A frame symbolization
could not name is a function of its own, `[unknown] MODULE+0xVADDR` (pprof would fold
`[unknown] (...)` into one `[unknown]`: it strips parentheses from names that look
like C++).

SYSTEM_NAMES: pprof demangles a function whose system name is its name, and a name
that looks like demangled C++ to it (`<`, `>`, `[`, `]` or `::` in it) loses what it
takes for parameters and templates: a Python `<module>` became nothing, shown as
`<unknown>`. A function's system name is therefore its ELF symbol where that is
another name (a mangled one), else none, and pprof shows every name as written."""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterable

from memtrack.report.reader import NO_STACK, TRUNCATED, Costs, Level, RunReader


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


# (type, unit, the Cost field it sums); the metric each default sample type stands for
PPROF_SAMPLE_TYPES = (
    ("alloc_objects", "count", "calls"), ("alloc_space", "bytes", "allocated"),
    ("peak_objects", "count", "peak_calls"), ("peak_space", "bytes", "peak"),
    ("leaked_objects", "count", "leaked_calls"), ("leaked_space", "bytes", "leaked"),
    ("temporary_objects", "count", "temporary"),
)  # fmt: skip
DEFAULT_SAMPLE_TYPE = {"calls": "alloc_objects", "allocated": "alloc_space",
                       "peak": "peak_space", "leaked": "leaked_space",
                       "temporary": "temporary_objects"}

Mappings = dict[tuple[int, int], tuple[int, int, int]]  # (pid, module) -> start, end, offset


def function_name(c: Costs, level: Level) -> str:
    """A level's function as pprof shows it: an unsymbolized one by module and address."""
    if level.reason is None:
        return level.name
    module = c.modules.get(level.module_id) if level.module_id is not None else None
    if module is not None and level.vaddr is not None:
        return f"[unknown] {os.path.basename(module.path)}+{level.vaddr:#x}"
    return f"[unknown] {level.name}"


def pprof(c: Costs, metric: str, mappings: Mappings, main_module: int | None = None,
          duration_ns: int = 0, time_ns: int = 0, comment: str = "", pids: bool = False
          ) -> bytes:
    """A gzipped profile.proto of every sample type, `metric`'s the default; with `pids`
    a numeric `pid` label per sample (pprof merges, and -diff_base subtracts, only
    samples whose labels are equal)."""
    s = _Strings()
    out = bytearray()
    for typ, unit, _ in PPROF_SAMPLE_TYPES:
        out += _field_bytes(1, _field_varint(1, s(typ)) + _field_varint(2, s(unit)))

    # Mappings: one per distinct placement of a module (forked processes share theirs),
    # the traced executable first.
    placements: dict[tuple[int, int, int, int], int] = {}
    mapping_of: dict[tuple[int, int], int] = {}  # (pid, module) -> mapping id
    used = sorted({(bt.pid, c.frames[f][0].module_id)
                   for bt in c.backtraces.values() for f in bt.frames
                   if c.frames.get(f) and c.frames[f][0].module_id is not None},
                  key=lambda pm: (pm[1] != main_module, pm[0], pm[1]))
    mapping_msgs = bytearray()
    for pid, mid in used:
        start, end, offset = mappings.get((pid, mid), (0, 0, 0))
        key = (mid, start, end, offset)
        if key not in placements:
            placements[key] = len(placements) + 1
            module = c.modules[mid]
            mapping_msgs += _field_bytes(3, (
                _field_varint(1, placements[key]) + _field_varint(2, start) +
                _field_varint(3, end) + _field_varint(4, offset) +
                _field_varint(5, s(module.path)) + _field_varint(6, s(module.build_id)) +
                b"".join(_field_varint(n, 1) for n in (7, 8, 9, 10))))
        mapping_of[(pid, mid)] = placements[key]

    functions: dict[tuple[str, str | None], int] = {}
    fn_msgs = bytearray()

    def function_id(level: Level, system_name: str | None) -> int:
        name = function_name(c, level)
        key = (name, level.file)
        if key not in functions:
            functions[key] = len(functions) + 1
            system = system_name if system_name != name else None  # SYSTEM_NAMES
            fn_msgs.extend(_field_bytes(5, (
                _field_varint(1, functions[key]) + _field_varint(2, s(name)) +
                _field_varint(3, s(system)) + _field_varint(4, s(level.file)))))
        return functions[key]

    def line(level: Level, system_name: str | None = None) -> bytes:
        return _field_bytes(4, _field_varint(1, function_id(level, system_name)) +
                            _field_varint(2, level.line or 0))

    locations: dict[tuple[int, int, int], int] = {}  # (pid, address, frame) -> location id
    loc_msgs = bytearray()

    def location(pid: int, address: int, frame_id: int) -> int:
        key = (pid, address, frame_id)
        if key not in locations:
            locations[key] = len(locations) + len(markers) + 1
            levels = c.frames.get(frame_id) or [Level(f"{address:#x}", None, None)]
            mid = levels[0].module_id
            msg = _field_varint(1, locations[key]) + _field_varint(3, address)
            if mid is not None and (pid, mid) in mapping_of:
                msg += _field_varint(2, mapping_of[(pid, mid)])
            # innermost first, the outermost (the symbol's own function) last
            for k, level in enumerate(levels):
                msg += line(level, level.symbol if k == len(levels) - 1 else None)
            loc_msgs.extend(_field_bytes(4, msg))
        return locations[key]

    markers: dict[str, int] = {}

    def marker(name: str) -> int:
        """A location of its own for a frame that is no code ([no stack], [truncated])."""
        if name not in markers:
            markers[name] = len(locations) + len(markers) + 1
            loc_msgs.extend(_field_bytes(4, _field_varint(1, markers[name]) +
                                         line(Level(name, None, None))))
        return markers[name]

    pid_key = s("pid") if pids else None
    fields = [field for _, _, field in PPROF_SAMPLE_TYPES]
    for row in c.rows:
        bt = c.backtraces.get(row.backtrace) if row.backtrace is not None else None
        locs = [] if bt is None else [
            location(bt.pid, a, f) for f, a in zip(bt.frames, bt.addresses, strict=True)]
        if bt is not None and bt.cut:
            locs.append(marker(TRUNCATED))
        if not locs:
            locs.append(marker(NO_STACK))
        values = [row.value(f) for f in fields]
        label = (b"" if pid_key is None else
                 _field_bytes(3, _field_varint(1, pid_key) + _field_varint(3, row.pid)))
        out += _field_bytes(2, _packed(1, locs) + _packed(2, values) + label)
    out += mapping_msgs
    out += loc_msgs
    out += fn_msgs
    if comment:
        s(comment)
    default = s(DEFAULT_SAMPLE_TYPE[metric])
    space, bytes_ = s("space"), s("bytes")
    for st in s.index:  # insertion order == index order
        out += _field_bytes(6, st.encode())
    if time_ns:
        out += _field_varint(9, time_ns)
    if duration_ns:
        out += _field_varint(10, duration_ns)
    out += _field_bytes(11, _field_varint(1, space) + _field_varint(2, bytes_))
    out += _field_varint(12, 1)
    if comment:
        out += _field_varint(13, s.index[comment])
    out += _field_varint(14, default)
    return gzip.compress(bytes(out))


def render(run: RunReader, metric: str, pids: bool = False) -> bytes:
    """The run's profile, `metric` the sample type pprof shows first."""
    start, end = run.start_ns, int(run.meta.get("end_ns", 0) or 0)
    wall = int(run.meta.get("wall_offset_ns", 0) or 0)
    return pprof(run.costs(), metric, run.module_mappings(), run.main_module(),
                 max(end - start, 0), start + wall if start else 0, run.title, pids)
