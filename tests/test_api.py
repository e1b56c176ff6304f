"""The Python API at the package root (memtrack.capture, memtrack.process,
memtrack.open_run): the command line's paths, giving what the command line prints."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import build
from support.cli import MEMTRACK

import memtrack
from memtrack.capture.tracker import CaptureError
from memtrack.schema.artifact import Artifact


def test_the_packages_stay_packages() -> None:
    import memtrack.capture.tracker
    import memtrack.process.pipeline  # noqa: F401

    assert callable(memtrack.capture) and callable(memtrack.process)
    assert memtrack.capture.tracker.Tracker and memtrack.process.pipeline.process


def test_options_are_checked_as_the_cli_checks_them(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="unexpected keyword argument 'stack'"):
        memtrack.capture(["/bin/true"], tmp_path / "r.memtrack", stack=False)
    with pytest.raises(CaptureError, match="--on-ring-full sometimes"):
        memtrack.capture(["/bin/true"], tmp_path / "r.memtrack", on_ring_full="sometimes")
    with pytest.raises(CaptureError, match="no-such-command"):
        memtrack.capture(["no-such-command"], tmp_path / "r.memtrack")


def test_options_read_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MEMTRACK_<NAME> variables set the options, as for the command line; one the
    command line would refuse is refused by name, unless the option is given."""
    monkeypatch.setenv("MEMTRACK_ON_RING_FULL", "sometimes")
    with pytest.raises(CaptureError, match="^MEMTRACK_ON_RING_FULL=sometimes: expected "
                                           "pause or drop$"):
        memtrack.capture(["/bin/true"], tmp_path / "r.memtrack")
    monkeypatch.setenv("MEMTRACK_STACK_BUDGET", "1000")
    with pytest.raises(CaptureError, match="^stack budget must be a multiple of 512 "):
        memtrack.capture(["/bin/true"], tmp_path / "r.memtrack", on_ring_full="drop")
    with pytest.raises(CaptureError, match="no-such-command"):
        memtrack.capture(["no-such-command"], tmp_path / "r.memtrack", on_ring_full="drop",
                         stacks=False)
    assert not (tmp_path / "r.memtrack").exists()


@pytest.mark.bpf
def test_capture_process_open_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = build(["capture/threads.c"], libs=("-lpthread",))
    art, db = tmp_path / "r.memtrack", tmp_path / "r.duckdb"
    monkeypatch.setenv("MEMTRACK_PROBE_PLACEMENT", "entry")
    monkeypatch.setenv("MEMTRACK_RSS", "on")  # the keyword wins
    result = memtrack.capture([str(exe), "500"], art, stacks=False, rss=False)
    assert result.status == 0 and result.nonzero_losses() == {}
    manifest = Artifact.open(art).manifest
    assert manifest.options["probe_placement"] == "entry" and manifest.options["rss"] is False
    assert manifest.probes and {p["probe_offset"] for p in manifest.probes} <= {0, None}
    summary = memtrack.process(art, db, jobs=1)
    assert summary.allocations >= 4 * 500
    run = memtrack.open_run(db)
    totals = run.totals()
    (calls,), = run.con.execute("SELECT count(*) FROM allocations WHERE size BETWEEN 1000 "
                                "AND 1003").fetchall()
    assert calls == 4 * 500
    report = subprocess.run([*MEMTRACK, "report", str(db), "--format", "json"],
                            capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(report.stdout)["totals"] == json.loads(json.dumps(totals))
    assert run.con.execute("SELECT current_setting('enable_external_access')").fetchone() \
        == (False,)
