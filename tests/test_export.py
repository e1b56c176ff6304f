"""Exports of a synthetic run: folded, pprof (decoded here: go is not installed) and
speedscope carry the same totals as `memtrack report`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from support.synth import LEAKS, SIZES, write_run
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
    r = runner.invoke(app, ["export", str(run_db), "--format", fmt, "-o", str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


def test_folded(run_db: Path, tmp_path: Path) -> None:
    text = export(run_db, tmp_path, "folded").read_text()
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines())
    assert lines["parent (100);main;work;make_small"] == str(512 + 1000)
    assert lines["parent (100);main;grow"] == str(4096 + 512)
    assert lines["child (200);[no stack]"] == "128"
    assert sum(int(v) for v in lines.values()) == sum(SIZES)
    leaked = export(run_db, tmp_path, "folded", "--metric", "leaked").read_text()
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in leaked.splitlines()) == sum(
        s for _, s in LEAKS.values())


# -- a minimal protobuf wire-format reader, enough for profile.proto

def _varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return n, i


def fields(b: bytes) -> list[tuple[int, int | bytes]]:
    out = []
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(b, i)
            out.append((num, v))
        elif wt == 2:
            n, i = _varint(b, i)
            out.append((num, b[i:i + n]))
            i += n
        else:
            raise AssertionError(f"unexpected wire type {wt}")
    return out


def packed(b: bytes) -> list[int]:
    vals, i = [], 0
    while i < len(b):
        v, i = _varint(b, i)
        vals.append(v)
    return vals


def test_pprof_totals_match_report(run_db: Path, tmp_path: Path) -> None:
    prof = fields(gzip.decompress(export(run_db, tmp_path, "pprof").read_bytes()))
    strings = [v.decode() for n, v in prof if n == 6]
    assert strings[0] == ""
    types = [(strings[dict(fields(v))[1]], strings[dict(fields(v))[2]]) for n, v in prof if n == 1]
    assert types == [("alloc_objects", "count"), ("alloc_space", "bytes"),
                     ("inuse_objects", "count"), ("inuse_space", "bytes")]
    functions = {dict(fields(v))[1]: strings[dict(fields(v))[2]] for n, v in prof if n == 5}
    locations = {}
    for n, v in prof:
        if n == 4:
            f = fields(v)
            lid = dict(f)[1]
            locations[lid] = [functions[dict(fields(x))[1]] for k, x in f if k == 4]
    totals = [0, 0, 0, 0]
    by_site: dict[str, int] = {}
    for n, v in prof:
        if n != 2:
            continue
        f = fields(v)
        locs = packed(dict(f)[1])
        vals = packed(dict(f)[2])
        assert all(lid in locations for lid in locs)
        totals = [a + b for a, b in zip(totals, vals, strict=True)]
        site = locations[locs[0]][0]
        by_site[site] = by_site.get(site, 0) + vals[1]
    con = open_run(run_db)
    t = report_data(con)["totals"]
    assert totals == [t["calls"], t["allocated_bytes"], t["leaked_allocations"],
                      t["leaked_bytes"]]
    assert totals == [9, sum(SIZES), 4, sum(s for _, s in LEAKS.values())]
    assert by_site == {"make_small": 1512, "make_big": 3072, "thread_fn": 364, "grow": 4608,
                       "[no stack]": 128}


def test_speedscope(run_db: Path, tmp_path: Path) -> None:
    doc = json.loads(export(run_db, tmp_path, "speedscope", "--metric", "peak").read_text())
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    names = [p["name"].split(": ")[1] for p in doc["profiles"]]
    assert names == ["peak", "allocated", "calls", "leaked"]
    peak = doc["profiles"][0]
    assert peak["endValue"] == sum(peak["weights"]) == 300 + 2048 + 4096 + 128
    frames = doc["shared"]["frames"]
    for sample in peak["samples"]:
        assert frames[sample[0]]["name"] in ("parent (100)", "child (200)")
    alloc = doc["profiles"][1]
    assert sum(alloc["weights"]) == sum(SIZES)


def test_bad_format(run_db: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["export", str(run_db), "--format", "svg", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert "expected one of folded, pprof, speedscope" in r.output


def test_pid_filter(run_db: Path, tmp_path: Path) -> None:
    text = export(run_db, tmp_path, "folded", "--pid", "200").read_text()
    assert text == "child (200);[no stack] 128\nchild (200);thread_fn 64\n"
