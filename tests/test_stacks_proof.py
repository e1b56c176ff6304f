"""Stack records are exact, proven on every fixture program (and on Debian's sqlite3 and
python3): captured with --stack-copies, each allocation's own raw copy unwinds to the
frames of the record its hash names (tests/stack_proof.py), while the records stay few."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from conftest import FIXTURES, build
from support.capture import spawn
from support.snaps import VARIANTS, build_fixture
from support.stackproof import prove

from memtrack.capture.options import CaptureOptions
from memtrack.schema import EventKind
from memtrack.schema.artifact import Artifact

pytestmark = pytest.mark.bpf

SQL = "".join(["CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT);\nBEGIN;\n"] +
              [f"INSERT INTO t(name) VALUES ('n{i * 7919 % 1009}');\n" for i in range(150)] +
              ["COMMIT;\nSELECT count(*) FROM t;\n"])


def _cases(tmp: Path) -> dict[str, Callable[[], list[str]]]:
    def chain(variant: str) -> list[str]:
        exe = build_fixture(["unwind/chain.c"], (*VARIANTS[variant], "-DSNAP=malloc"),
                            f"chain-malloc-{variant}")
        return [str(exe)]

    def cases(mode: str) -> list[str]:
        exe = build_fixture(["unwind/cases.c"], VARIANTS["O2"], "cases-O2",
                            libs=("-lpthread",))
        plugin = build_fixture(["unwind/plugin.c"], VARIANTS["O2"], "plugin-O2", shared=True)
        return [str(exe), mode, str(plugin)]

    def sqlite() -> list[str]:
        sql = tmp / "ins.sql"
        sql.write_text(SQL)
        return ["/usr/bin/sqlite3", ":memory:", "-init", "/dev/null", "-cmd",
                f".read {sql}", ".quit"]

    out: dict[str, Callable[[], list[str]]] = {
        "two_paths": lambda: [str(build(["stacks/two_paths.c"], flags=("-O0",))), "300"],
        "churn": lambda: [str(build(["stacks/churn.c"], flags=("-O1", "-pthread"))), "64",
                          "3"],
        "new_caller": lambda: [str(build(["stacks/new_caller.cc"], flags=("-O1",)))],
        "cxxmap": lambda: [str(build(["stacks/cxxmap.cc"], flags=("-O2", "-g"))), "300"],
        "demo": lambda: [str(build(["demo/demo.c"]))],
        "fork": lambda: [str(build(["capture/fork.c"]))],
        "threads": lambda: [str(build(["capture/threads.c"], libs=("-lpthread",)))],
        "cxx": lambda: [str(build(["capture/cxx.cc"], name="cxx-libstdc++"))],
        "tree": lambda: [str(build(["placement/tree.c"])), "9"],
        "shell": lambda: ["sh", str(FIXTURES / "capture" / "run_allocs.sh"),
                          str(build(["capture/allocs.c"])), "misc"],
        "sqlite3": sqlite,
        "python3": lambda: [str(Path("/usr/bin/python3").resolve()), "-c",
                            "x = [bytearray(100 + i) for i in range(200)]"],
        # 40 Python frames deep, each allocating (bytearrays over pymalloc's 512 bytes)
        "python3-deep": lambda: [str(Path("/usr/bin/python3").resolve()), "-c",
                                 "def f(n): return [bytearray(600 + n)] + (f(n - 1) if n "
                                 "else [])\nx = [f(40) for _ in range(20)]"],
    }
    for mode in ("many_allocs", "realloc", "posix_memalign", "calloc"):
        out[f"allocs-{mode}"] = lambda m=mode: [str(build(["capture/allocs.c"])), m]
    for variant in sorted(VARIANTS):
        out[f"chain-{variant}"] = lambda v=variant: chain(v)
    for mode in ("thread", "signal", "signal-raw", "realign", "recursion", "dlopen"):
        out[f"cases-{mode}"] = lambda m=mode: cases(m)
    return out


CASES = sorted(_cases(Path("/nonexistent")))


@pytest.fixture(scope="module")
def tracker() -> Any:
    from memtrack.capture.tracker import Tracker

    # every capture's copy crosses the ring: sqlite3's start-up alone is ~50 MB of them
    opts = CaptureOptions(stack_copies=True, rss=False, modules=False,
                          stacks_ring_pages=1 << 15)
    with Tracker(opts) as t:
        yield t


@pytest.mark.parametrize("name", CASES)
def test_every_allocation_unwinds_as_its_record(tracker: Any, name: str,
                                                tmp_path: Path) -> None:
    cmd = _cases(tmp_path)[name]()
    out = tmp_path / f"{name}.memtrack"
    result = spawn(tracker, cmd, out, tmp_path / "stdout", timeout=120,
                   start_disabled=name == "cxx")
    assert result.status == 0
    assert result.nonzero_losses() == {}
    art = Artifact.open(out)
    ev = art.read("events").table
    allocs = ev.filter(pc.is_in(ev.column("kind"), value_set=pc.cast(
        [int(k) for k in (EventKind.MALLOC, EventKind.CALLOC, EventKind.REALLOC,
                          EventKind.ALIGNED_ALLOC)], "uint8")))
    proof = prove(out)
    # every capture was compared (failed calls are captured but emit no event)
    assert proof.copies >= allocs.num_rows > 0
    assert proof.mismatches[:3] == [] and proof.incomplete_mismatches == 0
    assert proof.records <= proof.copies
