"""`memtrack diff` names the line of the allocation whose cost changed: two builds of
fixtures/diff/moves.c captured, processed and compared through the command line. Its
one call path holds the temporaries' line (most calls) and the kept block's, which the
change moved and grew: the peak, the leak and the bytes allocated changed on the kept
block's line, the line the report of each build gives that site."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, build
from support.cli import capture_and_process, cli

pytestmark = pytest.mark.bpf

FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer")
SOURCE = FIXTURES / "diff" / "moves.c"


def line_of(marker: str) -> int:
    (n,), = [[i] for i, text in enumerate(SOURCE.read_text().splitlines(), 1)
             if text.endswith(f"/* {marker} */")]
    return n


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("moves")
    out = {}
    for name, flags in (("base", FLAGS), ("head", (*FLAGS, "-DMOVED"))):
        d = tmp / name
        d.mkdir()
        shutil.copy2(build(["diff/moves.c"], name=f"moves-{name}", flags=flags), d / "grow")
        out[name], _ = capture_and_process([str(d / "grow")], d)
    return out


def site_line(frames: list[dict]) -> tuple[str, str, int]:
    f = frames[0]
    return f["function"], Path(f["file"]).name, f["line"]


def test_diff_names_the_kept_blocks_line(runs: dict[str, Path]) -> None:
    kept, moved, temporaries = line_of("kept"), line_of("kept, moved"), line_of("temporaries")
    assert len({kept, moved, temporaries}) == 3
    d = json.loads(cli("diff", str(runs["base"]), str(runs["head"]), "--metric",
                       "allocated,peak,leaked", "--format", "json"))
    metrics = d["sections"]["sites"]["metrics"]
    for m in ("allocated", "peak", "leaked"):
        (site,) = metrics[m]["matched"]["sites"]
        assert (site["location"], site["delta"]) == ("grow", 2000), m
        (bt,) = site["backtraces"]
        assert site_line(bt["frames"]) == ("grow", "moves.c", moved), m
    # the report's line for that site, in each build
    for name, line in (("base", kept), ("head", moved)):
        r = json.loads(cli("report", str(runs[name]), "--format", "json"))
        for key in ("peak", "leaks"):
            (site,) = [s for s in r["sections"][key] if s["location"].startswith("grow")]
            assert (Path(site["file"]).name, site["line"]) == ("moves.c", line), (name, key)
    text = cli("diff", str(runs["base"]), str(runs["head"]), "--metric", "peak")
    assert f"moves.c:{moved}" in text and f"moves.c:{temporaries}" not in text
