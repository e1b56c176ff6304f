"""pprof profiles for the export tests: profile.proto decoded here (a minimal protobuf
wire-format reader), and `go tool pprof` run on them with its -top and -traces output
parsed."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

GO = shutil.which("go")


def _varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return n, i


def fields(b: bytes) -> list[tuple[int, int | bytes]]:
    out = []
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(b, i)
            out.append((num, v))
        elif wt == 2:
            n, i = _varint(b, i)
            out.append((num, b[i:i + n]))
            i += n
        else:
            raise AssertionError(f"unexpected wire type {wt}")
    return out


def packed(b: bytes) -> list[int]:
    vals, i = [], 0
    while i < len(b):
        v, i = _varint(b, i)
        vals.append(v)
    return vals


@dataclass
class Profile:
    sample_types: list[tuple[str, str]] = field(default_factory=list)
    # (location ids leaf first, values, {label: number})
    samples: list[tuple[list[int], list[int], dict[str, int]]] = field(default_factory=list)
    # id -> (mapping id, address, [(function name, system name, file, line)] innermost first)
    locations: dict[int, tuple[int, int, list[tuple[str, str, str, int]]]] = field(
        default_factory=dict)
    # id -> (start, limit, offset, file, build id)
    mappings: dict[int, tuple[int, int, int, str, str]] = field(default_factory=dict)
    mapping_order: list[int] = field(default_factory=list)
    default: str = ""
    comments: list[str] = field(default_factory=list)

    def total(self, sample_type: str) -> int:
        k = [t for t, _ in self.sample_types].index(sample_type)
        return sum(v[k] for _, v, _ in self.samples)

    def names(self, locs: list[int]) -> list[str]:
        """A sample's logical frames, leaf first."""
        return [ln[0] for lid in locs for ln in self.locations[lid][2]]


def decode(data: bytes) -> Profile:
    msg = fields(gzip.decompress(data))
    strings = [v.decode() for n, v in msg if n == 6]
    assert strings[0] == ""
    p = Profile()
    functions = {}
    for n, v in msg:
        if n == 5:
            f = dict(fields(v))
            functions[f[1]] = (strings[f[2]], strings[f.get(3, 0)], strings[f.get(4, 0)])
    for n, v in msg:
        if n == 1:
            f = dict(fields(v))
            p.sample_types.append((strings[f[1]], strings[f[2]]))
        elif n == 2:
            f = fields(v)
            d = dict(f)
            labels = {strings[dict(fields(x))[1]]: dict(fields(x))[3] for k, x in f if k == 3}
            p.samples.append((packed(d[1]), packed(d[2]), labels))
        elif n == 3:
            f = dict(fields(v))
            p.mappings[f[1]] = (f.get(2, 0), f.get(3, 0), f.get(4, 0), strings[f.get(5, 0)],
                                strings[f.get(6, 0)])
            p.mapping_order.append(f[1])
        elif n == 4:
            f = fields(v)
            d = dict(f)
            lines = []
            for k, x in f:
                if k == 4:
                    ln = dict(fields(x))
                    name, system, file = functions[ln[1]]
                    lines.append((name, system, file, ln.get(2, 0)))
            p.locations[d[1]] = (d.get(2, 0), d.get(3, 0), lines)
        elif n == 13:
            p.comments.append(strings[v])
        elif n == 14:
            p.default = strings[v]
    return p


def shown(name: str, system_name: str) -> str:
    """The name `go tool pprof` shows for a function by default: its demangler's
    (internal/symbolizer demangleSingleFunction, options NoParams and NoTemplateParams)
    leaves a name whose system name differs alone; otherwise, where the system name
    looks like demangled C++ to it, takes out what is in parentheses and angle
    brackets (a mangled system name it would demangle: none of the tests' is)."""
    if name and system_name != name:
        return name
    name = system_name
    if ".<" in name or "])." in name or not (any(c in name for c in "<>[]") or "::" in name):
        return name
    for start, end in ("()", "<>"):
        name = _remove_matching(name, start, end)
    return name


def _remove_matching(name: str, start: str, end: str) -> str:
    """pprof's removeMatching: every outermost start...end taken out (unbalanced: the
    name as it was)."""
    out, depth = [], 0
    for c in name:
        if c == start:
            depth += 1
        elif c == end:
            depth -= 1
            if depth < 0:
                return name
        elif depth == 0:
            out.append(c)
    return "".join(out)


def go_pprof(path: Path, *args: str) -> str:
    assert GO, "golang-go missing: run scripts/setup"
    return subprocess.run([GO, "tool", "pprof", *args, str(path)], capture_output=True,
                          text=True, check=True, timeout=120).stdout


def top(path: Path, sample_index: str, *, lines: bool = False) -> tuple[str, dict[str, int]]:
    """`go tool pprof -top`: its header and the flat value of every node (exact units)."""
    out = go_pprof(path, "-top", "-nodecount=100000", "-nodefraction=0", "-unit=B",
                   f"-sample_index={sample_index}",
                   *(["-lines"] if lines else []))
    head, _, table = out.partition("      flat  flat%")
    flat = {}
    for row in table.splitlines()[1:]:
        m = re.match(r"\s*(\d+)B?\s+\S+\s+\S+\s+\d+B?\s+\S+\s+(.*)$", row)
        assert m, row
        flat[m[2]] = flat.get(m[2], 0) + int(m[1])
    return head, flat


def traces(path: Path, sample_index: str) -> list[tuple[int | None, int, list[str]]]:
    """`go tool pprof -traces`: (pid label or None, value, functions leaf first) per
    sample."""
    out = go_pprof(path, "-traces", "-unit=B", f"-sample_index={sample_index}")
    found = []
    for block in re.split(r"^-+\+-+$", out, flags=re.M)[1:]:
        rows = [r for r in block.splitlines() if r.strip()]
        if not rows:
            continue
        label = re.match(r"\s*pid:\s+(\d+)", rows[0])
        pid = int(label[1]) if label else None
        rows = rows[1:] if label else rows
        m = re.match(r"\s*(\d+)B?\s+(.*)$", rows[0])
        found.append((pid, int(m[1]), [m[2].strip(), *(r.strip() for r in rows[1:])]))
    return found
