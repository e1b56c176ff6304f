"""The regions of a report: a synthetic run of 2,000 regions (one thread's, one
allocation each, of sizes all different) stays readable: `--top` regions, most bytes
allocated first, then a line counting the rest, in the text, the JSON and the page;
each region's RSS growth is its own, beside its process's RSS."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from support import synth
from support.page import browsing, page_data
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.report.text import human_bytes
from memtrack.schema import REGION_NAMES, RSS, EventKind

K = EventKind
N = 2000
PAGE = 4096
BEGIN = 1000  # region i runs from BEGIN + 2i to BEGIN + 2i + 1
END = BEGIN + 2 * N + 10


def size(i: int) -> int:
    return 16 * (1 + (i * 7919) % N)  # a permutation: every region's size its own


def grown(i: int) -> int:
    """The RSS region i adds to its process (every third region, a page per 1/3)."""
    return PAGE * (i // 3 % 5) if i % 3 == 0 else 0


def rss_after(i: int) -> int:
    return PAGE + sum(grown(j) for j in range(i + 1))


def write_regions_run(path: Path) -> Path:
    rows = []
    for i in range(N):
        ts = BEGIN + 2 * i
        rows += [(ts, 100, 100, K.REGION, 1, i + 1, 0, 0, 0),
                 (ts, 100, 100, K.MALLOC, 0, 0x1000 * (i + 1), 0, size(i), 11),
                 (ts + 1, 100, 100, K.REGION, 0, i + 1, 0, 0, 0)]
    events = synth.events_table(rows)
    names = pa.table({"region_id": range(1, N + 1), "name": [f"case_{i}" for i in range(N)]},
                     schema=REGION_NAMES)
    # one anon sample at each region's end (inside it): the process's RSS after it
    raw = pa.table({"ts": [BEGIN] + [BEGIN + 2 * i + 1 for i in range(N)], "pid": [100] * (N + 1),
                    "member": [1] * (N + 1), "bytes": [PAGE] + [rss_after(i) for i in range(N)],
                    "external": [False] * (N + 1)}, schema=RSS)
    synth.write_run(path, events, end_ns=END, rss=raw, region_names=names, allocators=[])
    return path


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_regions_run(tmp_path_factory.mktemp("regions") / "run.duckdb")


BY_BYTES = sorted(range(N), key=lambda i: -size(i))


def invoke(*args: str | Path) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_text_lists_the_top_regions_then_counts_the_rest(run_db: Path) -> None:
    for top in (10, 25):
        text = invoke("report", run_db, "--top", str(top))
        section = text.split("\nREGIONS")[1].split("\n\n")[0].splitlines()
        body = section[2:]
        assert [ln.split()[-1] for ln in body[:-1]] == [f"case_{i}" for i in BY_BYTES[:top]]
        assert body[-1] == f"  … and {N - top:,} more regions (--top N lists more)"
        first = body[0].split()
        i = BY_BYTES[0]
        assert (first[0], " ".join(first[1:3])) == ("1", human_bytes(size(i)))


def test_json_regions_and_rss_growth(run_db: Path) -> None:
    d = json.loads(invoke("report", run_db, "--format", "json", "--top", "30"))
    assert d["regions_total"] == N
    rows = d["regions"]
    assert [r["name"] for r in rows] == [f"case_{i}" for i in BY_BYTES[:30]]
    for r in rows:
        i = int(r["name"].removeprefix("case_"))
        assert r["allocated_bytes"] == size(i)
        # the process's RSS in the region, and what the region itself added to it
        assert (r["rss_at_begin_bytes"], r["peak_rss_bytes"]) == (
            rss_after(i - 1) if i else PAGE, rss_after(i))
        assert r["rss_growth_bytes"] == grown(i)
    assert {r["rss_growth_bytes"] for r in rows} != {0}  # some regions grew it
    # --region shows the same figures
    i = BY_BYTES[0]
    text = invoke("report", run_db, "--region", f"case_{i}")
    assert (f"RSS growth: {human_bytes(grown(i))} above its begin (its process's: "
            f"{human_bytes(rss_after(i - 1))} at its begin, peak "
            f"{human_bytes(rss_after(i))})") in text



def test_page_shows_the_top_regions_then_all(run_db: Path, tmp_path: Path) -> None:
    page = tmp_path / "regions.html"
    invoke("report", run_db, "--html", page, "--top", "12")
    data = page_data(page)["regions"]
    assert data["top"] == 12 and len(data["rows"]) == N
    with browsing(page) as b:
        shown = "[...document.querySelectorAll('#regions-table tr[data-region]')]"
        ids = b.eval(f"{shown}.map(r => +r.dataset.region)")
        assert ids == [i + 1 for i in BY_BYTES[:12]]
        more = "#regions-table td.more"
        assert b.eval(f"document.querySelector('{more}').textContent") == (
            f"… and {N - 12:,} more regions (show all)")
        b.eval(f"document.querySelector('{more}').scrollIntoView()")
        b.mouse(*b.point(more), "click")
        assert b.eval(f"{shown}.length") == N
        assert b.eval(f"document.querySelector('{more}')") is None
