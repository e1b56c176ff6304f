"""`memtrack report` and `memtrack query` on a synthetic run: totals, sections, JSON,
--pid, CSV/JSON query output, one-line errors with exit 2."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import duckdb
import pytest
from support.synth import LEAKS, PEAK, SIZES, TEMPORARY, write_artifact, write_run
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.schema.ddl import derive

runner = CliRunner()


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("rep") / "run.duckdb")


def invoke(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def test_report_json_totals(run_db: Path) -> None:
    code, out, _ = invoke("report", str(run_db), "--format", "json")
    assert code == 0
    d = json.loads(out)
    t = d["totals"]
    assert t["calls"] == len(SIZES) and t["allocated_bytes"] == sum(SIZES)
    assert t["temporary"] == len(TEMPORARY)
    assert t["leaked_bytes"] == sum(s for _, s in LEAKS.values())
    assert t["leaked_allocations"] == len(LEAKS)
    # both processes together: pid 200's blocks all come after pid 100's peak at 1400
    assert t["peak_heap_bytes"] == PEAK["bytes"]
    assert t["peak_heap_at_s"] == pytest.approx((PEAK["ts"] - 900) / 1e9)
    # pid 100: anon 64 KiB since 1400, file 8 KiB at 1500; the child forked at 1800
    # starts from its parent's values: the processes' RSS summed peaks there
    assert t["peak_rss_bytes"] == 2 * (65536 + 8192)
    assert t["peak_rss_at_s"] == pytest.approx((1800 - 900) / 1e9)
    assert t["runtime_s"] == pytest.approx(2100 / 1e9)
    calls = {e["location"]: e["value"] for e in d["sections"]["calls"]}
    assert calls == {"grow": 2, "make_big": 2, "make_small": 2, "thread_fn": 2, "[no stack]": 1}
    peak = {e["location"]: e["value"] for e in d["sections"]["peak"]}
    assert peak == {"grow": 4096, "make_big": 2048, "thread_fn": 300, "[no stack]": 128}
    leaks = d["sections"]["leaks"]
    assert [(e["location"], e["value"]) for e in leaks] == [
        ("grow", 4096), ("make_small", 1000), ("[no stack]", 128), ("thread_fn", 64)]
    bt = leaks[1]["backtraces"][0]["frames"]
    assert [(f["function"], f["file"]) for f in bt] == [
        ("make_small", "make_small.c"), ("work", "work.c"), ("main", "main.c")]
    temp = {e["location"]: e["value"] for e in d["sections"]["temporary"]}
    assert temp == {"make_small": 1, "grow": 1}


def test_report_text(run_db: Path) -> None:
    code, out, _ = invoke("report", str(run_db))
    assert code == 0
    assert "calls to allocation functions: 9 (" in out
    assert "temporary memory allocations: 2 (" in out
    assert f"peak heap memory consumption: {PEAK['bytes'] / 1024:.2f}K" in out
    assert "total memory leaked: 5.16K (4 allocations)" in out
    for title in ("MOST CALLS TO ALLOCATION FUNCTIONS", "PEAK MEMORY CONSUMERS",
                  "MEMORY LEAKS", "MOST TEMPORARY ALLOCATIONS"):
        assert title in out
    assert "4.00K from grow (grow.c:10) in 1 backtrace" in out


def test_report_pid(run_db: Path) -> None:
    code, out, _ = invoke("report", str(run_db), "--format", "json", "--pid", "200")
    assert code == 0
    t = json.loads(out)["totals"]
    assert (t["calls"], t["leaked_bytes"], t["peak_heap_bytes"]) == (2, 64 + 128, 128)
    code, _, err = invoke("report", str(run_db), "--pid", "999")
    assert code == 2 and "no process 999" in err


def test_query_formats(run_db: Path) -> None:
    sql = "SELECT alloc_id, size, kind FROM allocations WHERE size > 1000 ORDER BY alloc_id"
    code, out, _ = invoke("query", str(run_db), sql, "--format", "csv")
    assert code == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert rows == [["alloc_id", "size", "kind"], ["1", "1024", "malloc"],
                    ["3", "2048", "malloc"], ["4", "4096", "realloc"]]
    code, out, _ = invoke("query", str(run_db), sql, "--format", "json")
    assert json.loads(out) == [{"alloc_id": 1, "size": 1024, "kind": "malloc"},
                               {"alloc_id": 3, "size": 2048, "kind": "malloc"},
                               {"alloc_id": 4, "size": 4096, "kind": "realloc"}]
    code, out, _ = invoke("query", str(run_db), sql)
    assert code == 0 and out.splitlines()[0].split() == ["alloc_id", "size", "kind"]
    assert out.rstrip().endswith("(3 rows)")


def test_query_errors(run_db: Path, tmp_path: Path) -> None:
    code, out, err = invoke("query", str(run_db), "SELECT nope FROM allocations")
    assert code == 2 and out == ""
    assert err.startswith("memtrack: query: ") and err.count("\n") == 1
    code, _, err = invoke("query", str(tmp_path / "none.duckdb"), "SELECT 1")
    assert code == 2 and "no such run database" in err and err.count("\n") == 1
    old = tmp_path / "old.duckdb"
    con = duckdb.connect(str(old))
    con.execute("CREATE TABLE meta (key VARCHAR, value VARCHAR)")
    con.execute("INSERT INTO meta VALUES ('schema_version', '0')")
    con.close()
    for cmd in (["query", str(old), "SELECT 1"], ["report", str(old)]):
        code, _, err = invoke(*cmd)
        assert code == 2 and "format 0 is older" in err and err.count("\n") == 1


def test_process_cli(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    code, _, err = invoke("process", str(tmp_path / "missing.memtrack"), "-o",
                          str(tmp_path / "x.duckdb"))
    assert code == 2 and "no such artifact" in err and err.count("\n") == 1
    for out, msg in ((tmp_path / "nodir" / "x.duckdb", "no such directory"),
                     (tmp_path, "is a directory")):
        code, _, err = invoke("process", str(art), "-o", str(out))
        assert code == 2 and msg in err and err.count("\n") == 1
    (art / "events.arrow").write_bytes(b"garbage")
    code, _, err = invoke("process", str(art), "-o", str(tmp_path / "x.duckdb"))
    assert code == 2 and "events.arrow" in err and err.count("\n") == 1


def test_records_with_the_same_frames_are_one_backtrace(run_db: Path, tmp_path: Path) -> None:
    """Stack records whose bytes differ but unwind to the same frames (different locals,
    say) are one backtrace, with their values summed."""
    db = tmp_path / "dup.duckdb"
    db.write_bytes(run_db.read_bytes())
    with duckdb.connect(str(db)) as con:
        (sid, n) = con.execute("""
            SELECT stack_id, count(*) FROM allocation_sites WHERE location = 'make_big'
            GROUP BY stack_id""").fetchone()
        assert n == 2
        new = con.execute("SELECT max(stack_id) + 1 FROM stacks").fetchone()[0]
        con.execute("INSERT INTO stacks SELECT ? AS stack_id, * EXCLUDE (stack_id) "
                    "FROM stacks WHERE stack_id = ?", [new, sid])
        con.execute("INSERT INTO stack_frames SELECT ? AS stack_id, * EXCLUDE (stack_id) "
                    "FROM stack_frames WHERE stack_id = ?", [new, sid])
        con.execute("""UPDATE allocations SET stack_id = ? WHERE alloc_id = (
            SELECT min(alloc_id) FROM allocations WHERE stack_id = ?)""", [new, sid])
        con.execute("DELETE FROM backtraces")
        derive(con, "backtraces")  # as the load stage does
    code, out, _ = invoke("report", str(db), "--format", "json")
    assert code == 0
    entry = next(e for e in json.loads(out)["sections"]["calls"] if e["location"] == "make_big")
    assert entry["value"] == 2 and entry["stacks"] == 1
    assert [bt["value"] for bt in entry["backtraces"]] == [2]
