"""Exports of a synthetic run: folded, pprof (decoded here and read by `go tool pprof`)
and speedscope carry the same totals, sites and stacks as `memtrack report`."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from support import pprof
from support.synth import (
    BUILD_ID,
    LEAKS,
    MAPPED,
    PEAK,
    SIZES,
    return_address,
    vaddr_of,
    write_run,
)
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.report.text import report_data
from memtrack.schema.ddl import open_run

runner = CliRunner()


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("exp") / "run.duckdb")


def export(run_db: Path, tmp: Path, fmt: str, *extra: str) -> Path:
    out = tmp / f"out.{fmt}"
    r = runner.invoke(app, ["export", str(run_db), "--format", fmt, "-o", str(out), "--force",
                            *extra])
    assert r.exit_code == 0, r.output
    return out


def test_folded(run_db: Path, tmp_path: Path) -> None:
    text = export(run_db, tmp_path, "folded", "--pids", "on").read_text()
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines())
    assert lines["parent (100);main;work;make_small"] == str(512 + 1000)
    assert lines["parent (100);main;grow"] == str(4096 + 512)
    assert lines["child (200);[no stack]"] == "128"
    # stacks cut short hang from [truncated], not from their outermost frame
    assert lines["parent (100);[truncated];thread_fn"] == "300"
    assert lines["child (200);[truncated];thread_fn"] == "64"
    assert sum(int(v) for v in lines.values()) == sum(SIZES)
    # by default a process is its name: the two processes of pid 200 (child, child2) and
    # another run's processes match
    plain = dict(ln.rsplit(" ", 1) for ln in export(run_db, tmp_path, "folded")
                 .read_text().splitlines())
    assert {k.replace(" (100)", "").replace(" (200)", ""): v for k, v in lines.items()} == plain
    leaked = export(run_db, tmp_path, "folded", "--metric", "leaked").read_text()
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in leaked.splitlines()) == sum(
        s for _, s in LEAKS.values())


PPROF_TYPES = [("alloc_objects", "count"), ("alloc_space", "bytes"), ("peak_objects", "count"),
               ("peak_space", "bytes"), ("leaked_objects", "count"), ("leaked_space", "bytes"),
               ("temporary_objects", "count")]


def test_pprof_profile(run_db: Path, tmp_path: Path) -> None:
    plain = pprof.decode(export(run_db, tmp_path, "pprof").read_bytes())
    assert {tuple(labels) for _, _, labels in plain.samples} == {()}  # no pid: --pids on
    prof = pprof.decode(export(run_db, tmp_path, "pprof", "--pids", "on").read_bytes())
    assert prof.sample_types == PPROF_TYPES
    assert prof.default == "alloc_space"
    assert prof.comments == ["p -x"]
    t = report_data(open_run(run_db))["totals"]
    assert [prof.total(k) for k, _ in PPROF_TYPES] == [
        t["calls"], t["allocated_bytes"], 3 + 1, PEAK["bytes"] + 128,
        t["leaked_allocations"], t["leaked_bytes"], t["temporary"]]
    assert prof.total("alloc_space") == sum(SIZES)
    # the traced executable is the main mapping; every frame a real address in it
    (mid, (start, limit, offset, file, build_id)), = prof.mappings.items()
    assert (start, limit, offset, file, build_id) == (*MAPPED, 0, "/bin/p", BUILD_ID)
    by_site: dict[tuple[str, int], int] = {}
    for locs, values, labels in prof.samples:
        assert labels["pid"] in (100, 200)
        mapping, address, lines = prof.locations[locs[0]]
        if lines[0][0] != "[no stack]":
            assert mapping == mid and start <= address < limit
            assert address == return_address(lines[0][0] if lines[0][3] != 31
                                             else "make_big:31")
        site = (lines[0][0], lines[0][3])
        by_site[site] = by_site.get(site, 0) + values[1]
        names = prof.names(locs)
        assert (names[-1] == "[truncated]") == (names[0] == "thread_fn")
    assert by_site == {("make_small", 13): 1512, ("make_big", 12): 1024,
                       ("make_big", 31): 2048, ("thread_fn", 16): 364, ("grow", 10): 4608,
                       ("[no stack]", 0): 128}


@pytest.mark.parametrize("metric,sample_type", [
    ("allocated", "alloc_space"), ("calls", "alloc_objects"), ("peak", "peak_space"),
    ("leaked", "leaked_space"), ("temporary", "temporary_objects")])
def test_pprof_metric_is_the_default_sample_type(run_db: Path, tmp_path: Path, metric: str,
                                                 sample_type: str) -> None:
    out = export(run_db, tmp_path, "pprof", "--metric", metric)
    assert pprof.decode(out.read_bytes()).default == sample_type
    if pprof.GO:
        head, _ = pprof.top(out, sample_type)
        assert f"Type: {sample_type}" in pprof.go_pprof(out, "-top")


def unknown_run(run_db: Path, tmp: Path) -> Path:
    """The run with no frame symbolized: each is `[unknown] (module+0xVADDR)`."""
    db = tmp / "unknown.duckdb"
    db.write_bytes(run_db.read_bytes())
    with duckdb.connect(str(db)) as con:
        con.execute("""UPDATE frames SET reason = 'no-module', file = NULL, line = NULL,
            symbol = NULL, name = '[unknown] (p+0x' || lower(hex(vaddr)) || ')',
            function = '[unknown] (p+0x' || lower(hex(vaddr)) || ')'""")
    return db


# frames renamed as a Python program and C++ would have them: name -> (new name, symbol)
FOREIGN = {"main": ("<module>", None), "work": ("run.<locals>.<listcomp>", None),
           "grow": ("<lambda>", None),
           "make_big": ("std::vector<int>::push_back(int const&)",
                        "_ZNSt6vectorIiSaIiEE9push_backERKi"),
           "make_small": ("ns::f<int>", "ns::f<int>")}


def foreign_run(run_db: Path, tmp: Path) -> Path:
    db = tmp / "foreign.duckdb"
    db.write_bytes(run_db.read_bytes())
    with duckdb.connect(str(db)) as con:
        for old, (name, symbol) in FOREIGN.items():
            con.execute("UPDATE frames SET name = ?, function = ?, symbol = ? WHERE name = ?",
                        [name, name, symbol, old])
    return db


def test_pprof_names_survive_its_demangler(run_db: Path, tmp_path: Path) -> None:
    """pprof demangles a function whose system name is its name: `<module>` would lose
    its angle brackets (shown as `<unknown>`), a C++ name its parameters. Every name is
    written so that pprof shows it as it is."""
    prof = pprof.decode(export(foreign_run(run_db, tmp_path), tmp_path, "pprof").read_bytes())
    functions = {(name, system) for _, _, lines in prof.locations.values()
                 for name, system, _, _ in lines}
    assert {name for name, _ in functions} >= {n for n, _ in FOREIGN.values()}
    assert {name: pprof.shown(name, system) for name, system in functions} == {
        name: name for name, _ in functions}
    assert ("std::vector<int>::push_back(int const&)",
            "_ZNSt6vectorIiSaIiEE9push_backERKi") in functions


@pytest.mark.skipif(pprof.GO is None, reason="golang-go missing: run scripts/setup")
def test_go_tool_pprof_shows_the_names(run_db: Path, tmp_path: Path) -> None:
    out = export(foreign_run(run_db, tmp_path), tmp_path, "pprof")
    _, flat = pprof.top(out, "alloc_space")
    assert "<unknown>" not in flat
    assert flat["std::vector<int>::push_back(int const&)"] == 1024 + 2048  # both lines
    assert flat["ns::f<int>"] == 1512 and flat["<lambda>"] == 4608
    traces = pprof.traces(out, "alloc_space")
    assert [f for _, _, f in traces if f[0] == "ns::f<int>"] == [
        ["ns::f<int>", "run.<locals>.<listcomp>", "<module>"]]


@pytest.mark.skipif(pprof.GO is None, reason="golang-go missing: run scripts/setup")
def test_go_tool_pprof_top_matches_the_report(run_db: Path, tmp_path: Path) -> None:
    """`go tool pprof -top` reads the profile as the report has it: the main binary,
    the totals, each site's value per sample type at its line, the truncated stacks."""
    out = export(run_db, tmp_path, "pprof")
    d = report_data(open_run(run_db))
    head, flat = pprof.top(out, "alloc_space")
    assert head.startswith("File: p\nBuild ID: " + BUILD_ID + "\np -x\nType: alloc_space\n")
    assert f"of {sum(SIZES)}B total" in head
    for section, sample_type in (("calls", "alloc_objects"), ("peak", "peak_space"),
                                 ("leaks", "leaked_space"), ("temporary", "temporary_objects")):
        _, flat = pprof.top(out, sample_type, lines=True)
        sites = {f"{e['location']} {e['file']}:{e['line']}" if e["file"] else e["location"]:
                 e["value"] for e in d["sections"][section]}
        assert {k: v for k, v in flat.items() if v} == sites, section
    _, flat = pprof.top(out, "alloc_space")
    assert flat["[truncated]"] == 0  # cut stacks end in it: it is no site


@pytest.mark.skipif(pprof.GO is None, reason="golang-go missing: run scripts/setup")
def test_go_tool_pprof_traces_are_the_folded_stacks(run_db: Path, tmp_path: Path) -> None:
    out = export(run_db, tmp_path, "pprof", "--pids", "on")
    folded_lines = export(run_db, tmp_path, "folded", "--pids", "on").read_text().splitlines()
    want: dict[str, int] = {}
    for ln in folded_lines:
        key, v = ln.rsplit(" ", 1)
        want[key] = int(v)
    got: dict[str, int] = {}
    names = {100: "parent (100)", 200: "child (200)"}
    for pid, value, frames in pprof.traces(out, "alloc_space"):
        key = ";".join([names[pid], *reversed(frames)])
        got[key] = got.get(key, 0) + value
    assert got == want


@pytest.mark.skipif(pprof.GO is None, reason="golang-go missing: run scripts/setup")
def test_go_tool_pprof_unknown_frames_stay_apart(run_db: Path, tmp_path: Path) -> None:
    """An unsymbolized frame is a function of its own (module + ELF address), never one
    `[unknown]` lump."""
    out = export(unknown_run(run_db, tmp_path), tmp_path, "pprof")
    _, flat = pprof.top(out, "alloc_space")
    assert "[unknown]" not in flat
    assert flat[f"[unknown] p+{vaddr_of('grow'):#x}"] == 4608
    assert flat[f"[unknown] p+{vaddr_of('make_big'):#x}"] == 1024
    assert flat[f"[unknown] p+{vaddr_of('make_big:31'):#x}"] == 2048
    assert sum(flat.values()) == sum(SIZES)


def test_speedscope(run_db: Path, tmp_path: Path) -> None:
    doc = json.loads(export(run_db, tmp_path, "speedscope", "--metric", "peak").read_text())
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    assert doc["name"] == "p -x"
    names = [p["name"].split(": ")[1] for p in doc["profiles"]]
    assert names == ["peak", "allocated", "calls", "leaked", "temporary"]
    assert [p["unit"] for p in doc["profiles"]] == ["bytes", "bytes", "none", "bytes", "none"]
    peak = doc["profiles"][0]
    assert peak["endValue"] == sum(peak["weights"]) == 300 + 2048 + 4096 + 128
    frames = doc["shared"]["frames"]
    for sample in peak["samples"]:
        assert frames[sample[0]]["name"] in ("parent", "child")
    alloc = doc["profiles"][1]
    assert sum(alloc["weights"]) == sum(SIZES)
    # a frame per function (make_big allocates at two lines: one frame, its first line)
    assert sorted(f["name"] for f in frames) == sorted({f["name"] for f in frames})
    make_big = next(f for f in frames if f["name"] == "make_big")
    assert (make_big["file"], make_big["line"]) == ("make_big.c", 12)
    by_stack: dict[str, int] = {}
    for st, w in zip(alloc["samples"], alloc["weights"], strict=True):
        key = ";".join(frames[i]["name"] for i in st)
        by_stack[key] = by_stack.get(key, 0) + w
    assert by_stack["parent;main;work;make_big"] == 1024 + 2048
    assert by_stack["parent;[truncated];thread_fn"] == 300
    pids = json.loads(export(run_db, tmp_path, "speedscope", "--pids", "on").read_text())
    assert {pids["shared"]["frames"][s[0]]["name"] for s in pids["profiles"][0]["samples"]
            } == {"parent (100)", "child (200)"}


def test_one_line_names(run_db: Path, tmp_path: Path) -> None:
    """A multi-line command names the profile by its first line, shortened."""
    db = tmp_path / "multi.duckdb"
    db.write_bytes(run_db.read_bytes())
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'command'",
                    [json.dumps(["python3", "-c", "import sys\nprint(sys.argv)\n" + "x" * 200])])
    doc = json.loads(export(db, tmp_path, "speedscope").read_text())
    assert doc["name"] == "python3 -c import sys…"
    assert pprof.decode(export(db, tmp_path, "pprof").read_bytes()).comments == [doc["name"]]


def test_bad_format(run_db: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["export", str(run_db), "--format", "svg", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert "expected one of folded, pprof, speedscope" in r.output


def test_pid_filter(run_db: Path, tmp_path: Path) -> None:
    text = export(run_db, tmp_path, "folded", "--pid", "200").read_text()
    assert text == "child;[no stack] 128\nchild;[truncated];thread_fn 64\n"
