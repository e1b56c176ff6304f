"""Every record the kernel hands userspace (a ring's record, a map's value written from
Python) has one layout on both sides: each C struct of memtrack/bpf, compiled here by
gcc, has the offsets and size of the numpy dtype or ctypes structure that reads or
writes it, field by field; and the slots userspace indexes by number (a ring's, a
config switch's) are the ones the C defines name."""

from __future__ import annotations

import ctypes as ct
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from memtrack.capture import parts
from memtrack.capture.core import ATTACH_DTYPE
from memtrack.capture.pyframes import PyProc
from memtrack.capture.rss import FAULT_DTYPE, RSS_DTYPE
from memtrack.schema import EVENT_DTYPE

BPF = ROOT / "memtrack" / "bpf"
TYPES = "".join(f"typedef uint{n}_t u{n}; typedef int{n}_t s{n};\n" for n in (8, 16, 32, 64))


def layout(obj: np.dtype | type[ct.Structure]) -> tuple[int, dict[str, int]]:
    """(size, field -> offset) of a numpy dtype or a ctypes structure."""
    if isinstance(obj, np.dtype):
        return obj.itemsize, {n: obj.fields[n][1] for n in obj.names}
    return ct.sizeof(obj), {n: getattr(obj, n).offset for n, _ in obj._fields_}


def c_struct(source: str, name: str) -> str:
    m = re.search(rf"^struct {name} \{{.*?^\}};", (BPF / source).read_text(), re.S | re.M)
    assert m, f"no struct {name} in {source}"
    return m[0]


@pytest.mark.parametrize("source,name,obj", [
    ("common.h", "mt_event", EVENT_DTYPE),
    ("lifecycle.c", "mt_attach_req", ATTACH_DTYPE),
    ("rss.c", "mt_rss_rec", RSS_DTYPE),
    ("rss.c", "mt_fault_rec", FAULT_DTYPE),
    ("pyframes.h", "mt_py_proc", PyProc),
], ids=lambda v: v if isinstance(v, str) else "")
def test_struct_matches(tmp_path: Path, source: str, name: str, obj: object) -> None:
    size, fields = layout(obj)  # type: ignore[arg-type]
    prints = "".join(f'    printf("{f} %zu\\n", offsetof(struct {name}, {f}));\n'
                     for f in fields)
    prog = tmp_path / "layout.c"
    prog.write_text("#include <stddef.h>\n#include <stdint.h>\n#include <stdio.h>\n" + TYPES
                    + c_struct(source, name) + "\nint main(void) {\n"
                    f'    printf("sizeof %zu\\n", sizeof(struct {name}));\n{prints}'
                    "    return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-o", str(exe), str(prog)], check=True, capture_output=True)
    out = dict(line.split() for line in subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True).stdout.splitlines())
    assert {k: int(v) for k, v in out.items()} == {"sizeof": size, **fields}


def test_slots_match_the_c_defines() -> None:
    """common.h's MT_RING_* and the MT_CONFIG_* of every BPF source, as parts.py numbers
    them (mt_config's slot 0, the recording switch, is read as a literal 0 there)."""
    defines = {name: int(value) for source in sorted(BPF.iterdir())
               if source.suffix in (".h", ".c")
               for name, value in re.findall(r"^#define MT_((?:RING|CONFIG)_\w+) (\d+)$",
                                             source.read_text(), re.M)}
    rings = {f"RING_{n.upper()}": i for i, n in enumerate(parts.RING_NAMES)}
    assert rings == {k: getattr(parts, k) for k in rings}
    config = {k: getattr(parts, k) for k in ("CONFIG_SCOPED", "CONFIG_WRAPPED",
                                             "CONFIG_GENERATION")}
    assert defines == {**rings, **config}
    assert parts.CONFIG_ENABLED == 0
