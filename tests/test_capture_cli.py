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

from memtrack.capture.choices import (
    OnRingFull,
    ProbePlacement,
    ProbeScope,
    PythonStacks,
    UprobeAttach,
)
from memtrack.capture.options import CaptureError, CaptureOptions, Tuning
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


# (variable, value) pairs the command line takes or refuses, each side of every rule
ENV_CASES = [
    ("MEMTRACK_STACKS", "off"), ("MEMTRACK_STACKS", "ON"), ("MEMTRACK_STACKS", "1"),
    ("MEMTRACK_RSS", " off"), ("MEMTRACK_PYTHON_FRAMES", "off"),
    ("MEMTRACK_FAIL_ON_LOSS", "y"), ("MEMTRACK_FAIL_ON_LOSS", " True "),
    ("MEMTRACK_FAIL_ON_LOSS", "0"), ("MEMTRACK_FAIL_ON_LOSS", "2"),
    ("MEMTRACK_START_DISABLED", "no"), ("MEMTRACK_START_DISABLED", "maybe"),
    ("MEMTRACK_STACK_BUDGET", " 4096 "), ("MEMTRACK_STACK_BUDGET", "+4_096"),
    ("MEMTRACK_STACK_BUDGET", "4k"), ("MEMTRACK_STACK_BUDGET", "0x1000"),
    ("MEMTRACK_STACK_BUDGET", "1000"), ("MEMTRACK_EVENTS_RING_PAGES", ""),
    ("MEMTRACK_EVENTS_RING_PAGES", "3"), ("MEMTRACK_EVENTS_RING_PAGES", "abc"),
    ("MEMTRACK_PYTHON_STACKS", "mixed"), ("MEMTRACK_PYTHON_STACKS", "MIXED"),
    ("MEMTRACK_ON_RING_FULL", "drop"), ("MEMTRACK_ON_RING_FULL", "block"),
    ("MEMTRACK_PROBE_SCOPE", "host"), ("MEMTRACK_PROBE_PLACEMENT", "middle"),
    ("MEMTRACK_PROGRAM_CACHE", "off"),
]


def test_options_read_the_environment_as_the_cli_does(tmp_path: Path) -> None:
    """CaptureOptions.from_env takes exactly the values `memtrack capture` takes from
    the same variables, and names the variable of one it refuses."""
    from typer.testing import CliRunner

    from memtrack.cli import app

    fields = {"MEMTRACK_" + f.upper() for f in CaptureOptions.__dataclass_fields__} - \
        {"MEMTRACK_TUNING"}
    assert fields <= set(ENV_VARS)
    for var, value in ENV_CASES:
        r = CliRunner().invoke(app, ["capture", "-o", str(tmp_path / "x"), "--",
                                     "no-such-command"], env={var: value})
        cli_took = "cannot run no-such-command: command not found" in r.output
        assert r.exit_code == 2 and (cli_took or "no-such-command" not in r.output), r.output
        try:
            CaptureOptions.from_env({var: value})
            took = True
        except CaptureError as e:  # the variable's value, or what the CLI said of it
            took = False
            assert str(e).startswith(f"{var}={value}: expected") or str(e) in r.output, e
        assert took == cli_took, (var, value, r.output)
    env = {"MEMTRACK_STACKS": "off", "MEMTRACK_FAIL_ON_LOSS": " True ",
           "MEMTRACK_STACK_BUDGET": "+4_096", "MEMTRACK_PYTHON_STACKS": "mixed",
           "MEMTRACK_ON_RING_FULL": "drop", "MEMTRACK_EVENTS_RING_PAGES": "",
           "MEMTRACK_PROGRAM_CACHE": "off"}
    opts = CaptureOptions.from_env(env)
    assert (opts.stacks, opts.fail_on_loss, opts.stack_budget, opts.python_stacks,
            opts.on_ring_full, opts.events_ring_pages, opts.program_cache) == \
        (False, True, 4096, PythonStacks.MIXED, OnRingFull.DROP,
         CaptureOptions().events_ring_pages, "off")
    # an option given wins over its variable, as a flag does on the command line
    assert CaptureOptions.from_env(env, stacks=True, on_ring_full="pause").stacks is True
    with pytest.raises(CaptureError, match=r"^MEMTRACK_STACKS=maybe: expected on or off$"):
        CaptureOptions.from_env({"MEMTRACK_STACKS": "maybe"})
    with pytest.raises(TypeError, match="stack"):
        CaptureOptions.from_env({}, stack=False)


def test_options_are_typed_and_recorded_as_strings() -> None:
    """A choice is its enum whatever it was given as, the manifest records its value,
    and a value of the wrong type or outside its choices is refused in one line."""
    opts = CaptureOptions(python_stacks="mixed", probe_scope=ProbeScope.HOST,
                          probe_placement="entry", on_ring_full="drop",
                          tuning=Tuning(uprobe_attach="perf_event", thread_slots=2))
    assert opts.python_stacks is PythonStacks.MIXED and opts.probe_scope is ProbeScope.HOST
    assert opts.probe_placement is ProbePlacement.ENTRY
    assert opts.tuning.uprobe_attach is UprobeAttach.PERF_EVENT
    assert opts.tuning.uprobe_attach.multi is False and UprobeAttach.AUTO.multi is None
    record = json.loads(json.dumps(opts.record()))
    assert record == opts.record()
    assert (record["python_stacks"], record["probe_scope"], record["probe_placement"],
            record["on_ring_full"]) == ("mixed", "host", "entry", "drop")
    assert record["tuning"] == {"thread_slots": 2, "uprobe_attach": "perf_event",
                                "rss_ring_pages": 2048, "rss_events_ring_pages": 256,
                                "faults_ring_pages": 4096}
    assert "extra" not in record
    default = CaptureOptions().record()
    assert (default["python_stacks"], default["probe_scope"], default["probe_placement"],
            default["on_ring_full"]) == ("python", "auto", "auto", "pause")
    for kwargs, said in (({"probe_scope": "tree"}, "--probe-scope tree: expected auto or host"),
                         ({"on_ring_full": "Pause"}, "--on-ring-full Pause: expected pause or "
                                                     "drop"),
                         ({"stacks": "off"}, "--stacks 'off': expected bool"),
                         ({"stack_budget": True}, "--stack-budget True: expected int"),
                         ({"events_ring_pages": 3000}, "--events-ring-pages 3000: must be a "
                                                       "power of two"),
                         ({"tuning": {"thread_slots": 2}}, "--tuning {'thread_slots': 2}: "
                                                          "expected Tuning")):
        with pytest.raises(CaptureError, match="^" + said.replace("(", r"\(")[:40]):
            CaptureOptions(**kwargs)
    for kwargs, said in (({"thread_slots": 3}, "thread slots 3: expected a power of two"),
                         ({"uprobe_attach": "ptrace"}, "uprobe_attach ptrace: expected auto "
                                                       "or uprobe_multi or perf_event"),
                         ({"faults_ring_pages": 0}, "faults_ring_pages 0: must be a power")):
        with pytest.raises(CaptureError, match="^" + said):
            Tuning(**kwargs)


@pytest.mark.bpf
def test_exit_status_env_options_and_info(tmp_path: Path) -> None:
    allocs = build(["capture/allocs.c"])
    out = tmp_path / "e.memtrack"
    env = {"MEMTRACK_STACKS": "off", "MEMTRACK_RSS": "off", "MEMTRACK_MODULES": "off",
           "MEMTRACK_PROBE_PLACEMENT": "entry", "MEMTRACK_ON_RING_FULL": "drop",
           "MEMTRACK_EVENTS_RING_PAGES": "+2048", "MEMTRACK_FAIL_ON_LOSS": "y"}
    r = capture(["--", str(allocs), "exit3"], env={"MEMTRACK_OUTPUT": str(out), **env})
    assert r.returncode == 3, r.stderr
    assert "exited with status 3" in r.stderr and "LOST" not in r.stderr
    art = Artifact.open(out)
    assert art.manifest.complete and art.manifest.exit_status.code == 3
    assert art.manifest.options["stacks"] is False and art.manifest.options["modules"] is False
    # what the command line read is what CaptureOptions.from_env reads
    assert art.manifest.options == CaptureOptions.from_env(env).record()
    assert art.manifest.options["events_ring_pages"] == 2048
    assert art.manifest.backpressure["mode"] == "drop"
    assert art.manifest.probes and {p["probe_offset"] for p in art.manifest.probes} <= {0, None}
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
