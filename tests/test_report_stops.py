"""A run's time starts at the program's first instruction after exec, not at memtrack's
own start, and the stops capture held the program for (its attach at exec, ring pauses)
are in the run database, said beside the runtime and drawn on the timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import build
from support.cli import cli
from support.page import browsing, page_data

from memtrack.schema.artifact import Artifact
from memtrack.schema.ddl import open_run

pytestmark = pytest.mark.bpf


def test_time_zero_and_stops(tmp_path: Path) -> None:
    exe = build(["capture/threads.c"], libs=("-lpthread",))
    art, db = tmp_path / "r.memtrack", tmp_path / "r.duckdb"
    # a one-page events ring: four allocating threads are paused again and again
    cli("capture", "-o", str(art), "--stacks", "off", "--events-ring-pages", "1", "--",
        str(exe), "3000")
    m = Artifact.open(art).manifest
    pauses = sum(m.backpressure["pauses"].values())
    assert pauses > 0
    cli("process", str(art), "-o", str(db), "-q")
    con = open_run(db)
    rows = con.execute("SELECT pid, reason::VARCHAR, begin_ts, end_ts FROM stops "
                       "ORDER BY begin_ts").fetchall()
    assert all(m.start_ns <= b <= e <= m.end_ns for _, _, b, e in rows)
    root = [(r, b, e) for p, r, b, e in rows if p == m.root_pid]
    assert root[0][0] == "attach"  # its exec: probes attached before it ran on
    t0 = root[0][2]
    (first_event,), = con.execute("SELECT min(ts) FROM events WHERE pid = ? AND kind <> 'exec'",
                                  [m.root_pid]).fetchall()
    assert m.start_ns < t0 <= first_event  # nothing of the program ran before time zero
    paused = [(b, e) for p, r, b, e in rows if r == "pause"]
    assert 0 < len(paused) <= pauses
    assert sum(e - b for b, e in paused) == pytest.approx(
        m.backpressure["paused_ns"], rel=0.05, abs=1e6)

    report = json.loads(cli("report", str(db), "--format", "json"))
    t = report["totals"]
    assert t["runtime_s"] == pytest.approx((m.end_ns - t0) / 1e9, abs=0.05)
    assert t["stopped"]["pause"]["count"] == len(paused)
    text = cli("report", str(db))
    assert f"ring pauses ({t['stopped']['pause']['seconds']:.3f}s)" in text.splitlines()[1]

    page = tmp_path / "r.html"
    cli("report", str(db), "--html", str(page))
    (line,) = page_data(page)["timelines"]
    assert line["heap"][0][0] >= 0 and line["stops"]
    # pauses, and attach stops after its exec (the threads' exit maps libgcc_s)
    assert "pause" in {r for _, _, r in line["stops"]} <= {"pause", "attach"}
    with browsing(page) as b:
        assert b.eval("document.querySelectorAll('#timeline rect.stop').length") >= len(
            line["stops"])
