"""`memtrack capture` from the command line: exit status, environment variables, loss
reporting and --fail-on-loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build

from memtrack.schema.artifact import Artifact

MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
ENV_VARS = ("MEMTRACK_OUTPUT", "MEMTRACK_FORCE", "MEMTRACK_STACKS", "MEMTRACK_STACK_BUDGET",
            "MEMTRACK_STACK_COPIES", "MEMTRACK_RSS", "MEMTRACK_TRACK_FAULTS",
            "MEMTRACK_MODULES", "MEMTRACK_START_DISABLED", "MEMTRACK_CONTROL_FIFO",
            "MEMTRACK_PROBE_PLACEMENT", "MEMTRACK_PROBE_SCOPE",
            "MEMTRACK_EVENTS_RING_PAGES",
            "MEMTRACK_STACKS_RING_PAGES", "MEMTRACK_ON_RING_FULL", "MEMTRACK_FAIL_ON_LOSS",
            "MEMTRACK_TIMEOUT", "MEMTRACK_PROGRAM_CACHE", "MEMTRACK_PYTHON_FRAMES",
            "MEMTRACK_PYTHON_STACKS", "MEMTRACK_PYTHON_ALLOCATORS",
            "MEMTRACK_PID", "MEMTRACK_DURATION")


def capture(args: list[str], env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTRACK, "capture", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_help_lists_every_env_var() -> None:
    """Every capture option has its MEMTRACK_ variable, named after its long flag, and the
    help shows each where the option is and in the list at the end."""
    import typer.main

    from memtrack.cli import app

    command = typer.main.get_command(app).commands["capture"]  # type: ignore[attr-defined]
    options = [p for p in command.params if p.param_type_name == "option"]
    got = {}
    for p in options:
        flag = max((o for o in p.opts if o.startswith("--")), key=len).split("/")[0]
        assert p.envvar == "MEMTRACK_" + flag[2:].upper().replace("-", "_"), p.opts
        got[flag] = p.envvar
    assert sorted(got.values()) == sorted(ENV_VARS)
    out = subprocess.run([*MEMTRACK, "capture", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "250"}, check=True).stdout
    table, epilog = out.split("Every option can also be set in the environment:")
    for flag, var in got.items():
        assert var in epilog, var
        line = next(ln for ln in table.splitlines() if f"{flag} " in ln or f"{flag}/" in ln)
        assert f"[env var: {var}]" in line, (flag, line)


def test_bad_options_fail_in_one_line(tmp_path: Path) -> None:
    r = capture(["-o", str(tmp_path / "x"), "--events-ring-pages", "3", "--", "true"])
    assert r.returncode == 2
    assert r.stderr.strip() == ("memtrack: --events-ring-pages 3: must be a power of two "
                                "(pages), at most 1048576 (4 GiB per CPU)")
    r = capture(["-o", str(tmp_path / "x"), "--stacks", "maybe", "--", "true"])
    assert r.returncode == 2 and "--stacks maybe" in r.stderr
    r = capture(["-o", str(tmp_path / "x"), "--stack-budget", "1000", "--", "true"])
    assert r.returncode == 2
    assert r.stderr.strip() == ("memtrack: stack budget must be a multiple of 512 between "
                                "512 and 32768 bytes, got 1000")
    r = capture(["-o", str(tmp_path / "x"), "--on-ring-full", "block", "--", "true"])
    assert r.returncode == 2
    assert r.stderr.strip() == "memtrack: --on-ring-full block: expected pause or drop"
    r = capture(["-o", str(tmp_path / "x"), "--python-stacks", "native", "--", "true"])
    assert r.returncode == 2
    assert r.stderr.strip() == "memtrack: --python-stacks native: expected python or mixed"
    # every number bounded, each in one line and before anything runs
    for args, said in ((["--events-ring-pages", str(1 << 40)], "at most 1048576"),
                       (["--stack-budget", str(10**22)], "got 10000000000000000000000"),
                       (["--timeout", "-1"], "--timeout: expected 0.001 to 10000000"),
                       (["--timeout", "nan"], "--timeout: expected 0.001 to 10000000"),
                       (["--timeout", "inf"], "--timeout: expected 0.001 to 10000000")):
        r = capture(["-o", str(tmp_path / "x"), *args, "--", "true"])
        assert r.returncode == 2 and said in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "x").exists()
    # a stack ring that cannot hold what the producers write before they stop
    r = capture(["-o", str(tmp_path / "x"), "--stacks-ring-pages", "2", "--", "true"])
    assert r.returncode == 2
    assert r.stderr.startswith("memtrack: --stacks-ring-pages 2: too small to pause the "
                               "producers in time")
    assert not (tmp_path / "x").exists()


@pytest.mark.bpf
def test_exit_status_env_options_and_info(tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    out = tmp_path / "e.memtrack"
    r = capture(["--", str(allocs), "exit3"],
                env={"MEMTRACK_OUTPUT": str(out), "MEMTRACK_STACKS": "off",
                     "MEMTRACK_RSS": "off", "MEMTRACK_MODULES": "off"})
    assert r.returncode == 3, r.stderr
    assert "exited with status 3" in r.stderr and "LOST" not in r.stderr
    art = Artifact.open(out)
    assert art.manifest.complete and art.manifest.exit_status.code == 3
    assert art.manifest.options["stacks"] is False and art.manifest.options["modules"] is False
    assert art.modules() == []
    info = json.loads(subprocess.run([*MEMTRACK, "info", "--json", str(out)],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["event_kinds"]["malloc"] == 1 and info["event_kinds"]["exit"] == 1
    assert not any(info["losses"].values())
    # an existing artifact is refused without --force
    r = capture(["-o", str(out), "--stacks", "off", "--rss", "off", "--", "true"])
    assert r.returncode == 2 and "already exists" in r.stderr


@pytest.mark.bpf
def test_ring_full_is_counted_printed_and_fails_on_loss(tmp_path: Path) -> None:
    """--on-ring-full drop: a ring too small for the program drops records, counted."""
    exe = build(["capture/threads.c"], libs=("-lpthread",))
    out = tmp_path / "l.memtrack"
    r = capture(["-o", str(out), "--stacks", "off", "--rss", "off", "--modules", "off",
                 "--events-ring-pages", "1", "--on-ring-full", "drop", "--fail-on-loss",
                 "--", str(exe)])
    assert r.returncode == 1, r.stderr
    assert "LOST events_ring_full" in r.stderr and "--fail-on-loss" in r.stderr
    art = Artifact.open(out)
    lost = art.manifest.losses["events_ring_full"]
    events = art.read("events").table.num_rows
    assert lost > 0 and events > 0
    # nothing vanishes silently: recorded + lost covers at least the 8000 heap calls
    assert events + lost >= 8000
    assert art.manifest.backpressure["mode"] == "drop"
    assert not any(art.manifest.backpressure["pauses"].values())
    assert "paused" not in r.stderr


@pytest.mark.bpf
def test_ctrl_c_stops_cmd_and_completes_the_artifact(tmp_path: Path) -> None:
    import signal
    import time

    out = tmp_path / "c.memtrack"
    p = subprocess.Popen([*MEMTRACK, "capture", "-o", str(out), "--stacks", "off", "--rss", "off",
                          "--modules", "off", "--", "sleep", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "manifest.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "killed by signal 2" in err
    art = Artifact.open(out)
    assert art.manifest.complete and art.manifest.exit_status.signal == signal.SIGINT
