"""The C++ workload against every allocator family, linked dynamically and statically:
the same exact sequence each time, recorded once per outer call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import build
from test_capture import A, F, M, run, tracker  # noqa: F401 - tracker is a fixture

from memtrack.schema import Allocator

pytestmark = pytest.mark.bpf

LIB = Path("/usr/lib/x86_64-linux-gnu")
VARIANTS = {
    "libstdc++": ((), Allocator.CXX),
    "jemalloc": (("-ljemalloc",), Allocator.JEMALLOC),
    "jemalloc-static": ((str(LIB / "libjemalloc.a"), "-lpthread", "-ldl", "-lm"),
                        Allocator.JEMALLOC),
    "mimalloc": (("-lmimalloc",), Allocator.MIMALLOC),
    "tcmalloc": (("-ltcmalloc_minimal",), Allocator.TCMALLOC),
    "tcmalloc-static": ((str(LIB / "libtcmalloc_minimal.a"), "-lpthread"), Allocator.TCMALLOC),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cxx_workload(tracker: Any, tmp_path: Path, variant: str) -> None:  # noqa: F811
    libs, family = VARIANTS[variant]
    exe = build(["capture/cxx.cc"], name=f"cxx-{variant}", libs=libs)
    r = run(tracker, tmp_path, [str(exe)], name=variant, start_disabled=True)
    assert r.result.status == 0, r.stdout
    h = r.heap()
    assert [(e["kind"], e["size"]) for e in h] == [
        (M, 44444), (M, 8), (M, 88888), (F, 0), (F, 8), (F, 88888)]
    (a,) = r.printed(r"new\[\]")
    (b,) = r.printed("new")
    (v,) = r.printed("vector")
    assert [e["addr"] for e in h] == [a, b, v, a, b, v]
    assert {e["allocator"] for e in h} == {family}
    assert r.result.nonzero_losses() == {}
    assert A not in [e["kind"] for e in h]
