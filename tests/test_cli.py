"""The command line a user trusts: one spelling for every on/off switch, --force for every
output, one-line advice for the common mistakes, --version, -h, shell completion, `info`
printing program text as it is, outputs given to the invoking user under sudo, and
capture/doctor saying what privilege is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import typer.main
from support.synth import write_artifact, write_run
from typer.testing import CliRunner

from memtrack.cli import app

runner = CliRunner()
MEMTRACK = Path(sys.executable).parent / "memtrack"  # the installed launcher


def invoke(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("memtrack: "), err
    return err.strip()


def test_every_switch_takes_on_or_off() -> None:
    """No --x/--no-x pairs anywhere: a switch takes its value (on|off), so no switch
    can leave its value to be read as CMD."""
    switches, chosen = [], []  # chosen: a default that depends on the run (cli.switch)
    for name, command in typer.main.get_command(app).commands.items():  # type: ignore[attr-defined]
        for p in command.params:
            assert not p.secondary_opts, (name, p.opts)
            if p.metavar == "on|off":
                switches.append(f"{name} {p.opts[0]}")
                assert p.default in ("on", "off", None) and not p.is_flag
                if p.default is None:
                    chosen.append(f"{name} {p.opts[0]}")
    assert sorted(chosen) == ["process --host-modules", "unwind --host-modules"]
    assert sorted(switches) == [
        "capture --modules", "capture --python-allocators", "capture --python-frames",
        "capture --rss",
        "capture --stack-copies", "capture --stacks", "capture --track-faults",
        "export --pids", "process --cache", "process --host-modules", "process --python-frames",
        "symbolize --cache", "unwind --host-modules"]


def test_capture_switch_values_are_not_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrack.commands import capture

    seen: dict[str, Any] = {}

    def fake(cmd: list[str], output: Path, **kw: Any) -> int:
        seen.update(kw, cmd=cmd)
        return 0

    monkeypatch.setattr(capture, "run", fake)
    code, _, err = invoke("capture", "-o", "x.memtrack", "--rss", "off", "--modules", "off",
                          "--track-faults", "on", "--stacks", "off", "--", "off")
    assert code == 0, err
    assert seen["cmd"] == ["off"]
    assert (seen["rss"], seen["modules"], seen["track_faults"], seen["stacks"]) == (
        False, False, True, False)
    code, _, err = invoke("capture", "-o", "x.memtrack", "--rss", "maybe", "--", "true")
    assert code == 2 and one_line(err) == "memtrack: --rss maybe: expected on or off"
    code, _, err = invoke("capture", "-o", "x.memtrack", "--rss", "--", "true")
    assert code == 2 and one_line(err) == "memtrack: --rss --: expected on or off"
    monkeypatch.setenv("MEMTRACK_RSS", "off")
    assert invoke("capture", "-o", "x.memtrack", "--", "true")[0] == 0
    assert seen["rss"] is False


def test_version_help_and_completion() -> None:
    from memtrack.schema.manifest import Manifest

    r = subprocess.run([MEMTRACK, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == f"memtrack {Manifest().memtrack_version}\n"
    for args in (["-h"], ["capture", "-h"], ["process", "-h"]):
        r = subprocess.run([MEMTRACK, *args], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 0 and "Usage: memtrack" in r.stdout, args
        assert r.stdout == subprocess.run([MEMTRACK, *args[:-1], "--help"], text=True,
                                          capture_output=True,
                                          env={**os.environ, "COLUMNS": "200"}).stdout
    env = {**os.environ, "_MEMTRACK_COMPLETE": "complete_bash"}
    r = subprocess.run([MEMTRACK], capture_output=True, text=True,
                       env={**env, "COMP_WORDS": "memtrack rep", "COMP_CWORD": "1"})
    assert r.stdout.split() == ["report"]
    r = subprocess.run([MEMTRACK], capture_output=True, text=True,
                       env={**env, "COMP_WORDS": "memtrack process --h", "COMP_CWORD": "2"})
    assert r.stdout.split() == ["--host-modules", "--help"]
    r = subprocess.run([MEMTRACK], capture_output=True, text=True,
                       env={**env, "COMP_WORDS": "memtrack capture --rss ", "COMP_CWORD": "3"})
    assert r.stdout.split() == ["on", "off"]
    r = subprocess.run([MEMTRACK, "--show-completion", "bash"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "_MEMTRACK_COMPLETE=complete_bash" in r.stdout


def test_usage_errors_are_one_line() -> None:
    for args, want in (
            (["process"], "Missing argument 'artifact'. (`memtrack process -h` for help)"),
            (["capture", "--rs", "off", "--", "true"],
             "No such option: --rs (Possible options: --rss) (`memtrack capture -h` for help)"),
            (["bogus"], "No such command 'bogus'. (`memtrack -h` for help)")):
        r = subprocess.run([MEMTRACK, *args], capture_output=True, text=True)
        assert r.returncode == 2 and one_line(r.stderr) == "memtrack: " + want, args


def test_force_for_every_output(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "run.memtrack")
    db, meta = tmp_path / "run.duckdb", tmp_path / "run.memory_metadata.json"
    assert invoke("process", str(art), "-o", str(db), "-q")[0] == 0
    assert meta.is_file()
    before = db.read_bytes()
    code, _, err = invoke("process", str(art), "-o", str(db), "-q")
    assert code == 2 and one_line(err) == (
        f"memtrack: {db}: already exists (use --force to replace it)")
    assert db.read_bytes() == before
    db.unlink()  # the metadata left behind is an output too
    code, _, err = invoke("process", str(art), "-o", str(db), "-q")
    assert code == 2 and one_line(err) == (
        f"memtrack: {meta}: already exists (use --force to replace it)")
    assert invoke("process", str(art), "-o", str(db), "-q", "--force")[0] == 0
    # a file that is not a run database is never replaced
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    code, _, err = invoke("process", str(art), "-o", str(notes), "--force", "-q")
    assert code == 2 and "is not a run database: not replaced, even with --force" in err
    assert notes.read_text() == "mine\n"
    # a Parquet directory with files in it
    pq = tmp_path / "pq"
    pq.mkdir()
    (pq / "x").write_text("")
    code, _, err = invoke("process", str(art), "-o", str(tmp_path / "b.duckdb"), "-q",
                          "--parquet", str(pq))
    assert code == 2 and one_line(err).startswith(f"memtrack: {pq}: already exists")
    # report --html and export
    run = write_run(tmp_path / "synth.duckdb")
    for args in (["report", str(run), "--html"], ["export", str(run), "--format", "pprof",
                                                  "-o"]):
        out = tmp_path / "out.file"
        out.write_text("keep")
        code, _, err = invoke(*args, str(out))
        assert code == 2 and one_line(err) == (
            f"memtrack: {out}: already exists (use --force to replace it)"), args
        assert out.read_text() == "keep"
        assert invoke(*args, str(out), "--force")[0] == 0
        assert out.read_bytes() != b"keep"
        out.unlink()


def test_two_runs_in_one_directory_keep_their_metadata(tmp_path: Path) -> None:
    for name, comm in (("a", "first"), ("b", "second")):
        art = write_artifact(tmp_path / f"{name}.memtrack", comm=comm)
        assert invoke("process", str(art), "-o", str(tmp_path / f"{name}.duckdb"), "-q")[0] == 0
    import json

    names = {n: [p["comm"] for p in json.loads(
        (tmp_path / f"{n}.memory_metadata.json").read_text())["processes"] if p["pid"] == 100]
        for n in "ab"}
    assert names == {"a": ["first"], "b": ["second"]}
    assert not (tmp_path / "memory_metadata.json").exists()


def test_missing_directory_is_one_line_and_not_created(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "run.memtrack")
    run = write_run(tmp_path / "synth.duckdb")
    missing = tmp_path / "nonexistent-dir"
    for args in (["process", str(art), "-o"], ["report", str(run), "--html"],
                 ["export", str(run), "--format", "folded", "-o"],
                 ["capture", "--stacks", "off", "-o"]):
        out = missing / "x.out"
        extra = ["--", "true"] if args[0] == "capture" else []
        r = subprocess.run([MEMTRACK, *args, str(out), *extra], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        if os.geteuid() == 0 or args[0] != "capture":
            assert one_line(r.stderr) == f"memtrack: {out}: no such directory {missing}"
        assert not missing.exists(), args


def test_a_run_command_given_an_artifact_says_process_it_first(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "run.memtrack")
    want = (f"memtrack: {art} is a capture artifact, not a run database: run "
            f"`memtrack process {art} -o {tmp_path / 'run.duckdb'}` first")
    for args in (["report", str(art)], ["query", str(art), "SELECT 1"],
                 ["export", str(art), "--format", "folded", "-o", str(tmp_path / "f")]):
        code, out, err = invoke(*args)
        assert code == 2 and out == "" and one_line(err) == want, args


def test_info_prints_program_text_as_it_is(tmp_path: Path) -> None:
    command = ("python3", "-c", "[i]*(i % 40) [bold]x[/bold] :thumbs_up:")
    art = write_artifact(tmp_path / "run.memtrack", command=command, comm="ev\x1b[31mil\x07")
    r = subprocess.run([MEMTRACK, "info", str(art)], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("command"))
    assert line.startswith("command   " + " ".join(command) + "  (pid 100")
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "ev\\x1b[31mil\\x07" in r.stdout


def nobody(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           "--", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or "/", timeout=120)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become nobody")


@needs_root
def test_capture_and_doctor_as_non_root_say_what_is_missing() -> None:
    r = nobody(MEMTRACK, "capture", "-o", "/tmp/never.memtrack", "--", "true")
    assert r.returncode == 2 and one_line(r.stderr) == (
        "memtrack: capture needs root: loading BPF programs and attaching uprobes takes "
        "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN), and this process has none: run "
        "`sudo memtrack capture -o OUT.memtrack -- CMD...`")
    assert not Path("/tmp/never.memtrack").exists()
    r = nobody(MEMTRACK, "doctor")
    assert r.returncode == 2 and one_line(r.stderr).endswith("run `sudo memtrack doctor`")


@needs_root
def test_process_under_sudo_gives_the_outputs_to_the_user(tmp_path: Path,
                                                          request: pytest.FixtureRequest
                                                          ) -> None:
    import pwd

    pw = pwd.getpwnam("nobody")
    art = write_artifact(tmp_path / "run.memtrack")
    out = Path(tempfile.mkdtemp(prefix="memtrack-sudo-"))  # where nobody reaches it
    request.addfinalizer(lambda: shutil.rmtree(out))
    out.chmod(0o755)
    r = subprocess.run([MEMTRACK, "process", art, "-o", out / "run.duckdb", "-q",
                        "--parquet", out / "pq"], capture_output=True, text=True,
                       env={**os.environ, "SUDO_UID": str(pw.pw_uid),
                            "SUDO_GID": str(pw.pw_gid)})
    assert r.returncode == 0, r.stderr
    written = [out / "run.duckdb", out / "run.memory_metadata.json", out / "pq",
               *(out / "pq").rglob("*")]
    assert len(written) > 10
    for p in written:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (pw.pw_uid, pw.pw_gid), p
    # the user reads and replaces what is theirs (the directory is root's: the page
    # goes to one of theirs)
    (out / "mine").mkdir()
    os.chown(out / "mine", pw.pw_uid, pw.pw_gid)
    r = nobody(MEMTRACK, "report", out / "run.duckdb", "--html", out / "mine" / "run.html")
    assert r.returncode == 0, r.stderr
    assert "peak heap" in r.stdout
    # where the user may not look, a one-line error
    r = nobody(MEMTRACK, "report", tmp_path / "x.duckdb", "--html", tmp_path / "x.html")
    assert r.returncode == 2 and one_line(r.stderr) == (
        f"memtrack: {tmp_path / 'x.html'}: permission denied")


@needs_root
@pytest.mark.bpf
def test_capture_under_sudo_gives_the_artifact_to_the_user(request: pytest.FixtureRequest
                                                           ) -> None:
    """Every file of the artifact (manifest, tables, module copies) is the invoking
    user's and readable by them: they run info and process on it without root."""
    import pwd

    pw = pwd.getpwnam("nobody")
    top = Path(tempfile.mkdtemp(prefix="memtrack-sudo-"))
    request.addfinalizer(lambda: shutil.rmtree(top))
    top.chmod(0o755)
    art = top / "run.memtrack"
    r = subprocess.run([MEMTRACK, "capture", "-o", art, "--rss", "off", "--", "true"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "SUDO_UID": str(pw.pw_uid),
                            "SUDO_GID": str(pw.pw_gid)})
    assert r.returncode == 0, r.stderr
    files = [art, *art.rglob("*")]
    assert art / "manifest.json" in files and any(p.parent.name == "modules" for p in files)
    for p in files:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (pw.pw_uid, pw.pw_gid), p
    (top / "mine").mkdir()
    os.chown(top / "mine", pw.pw_uid, pw.pw_gid)
    r = nobody(MEMTRACK, "info", art)
    assert r.returncode == 0 and "command   true" in r.stdout, r.stderr
    r = nobody(MEMTRACK, "process", art, "-o", top / "mine" / "run.duckdb", "-q",
               "--cache", "off")
    assert r.returncode == 0, r.stderr
