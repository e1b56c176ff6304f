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
    # sites are locations (function and line): make_big allocates at two lines
    calls = [(e["location"], e["line"], e["value"]) for e in d["sections"]["calls"]]
    assert calls == [("grow", 10, 2), ("make_small", 13, 2), ("thread_fn", 16, 2),
                     ("[no stack]", None, 1), ("make_big", 12, 1), ("make_big", 31, 1)]
    peak = [(e["location"], e["line"], e["value"]) for e in d["sections"]["peak"]]
    assert peak == [("grow", 10, 4096), ("make_big", 31, 2048), ("thread_fn", 16, 300),
                    ("[no stack]", None, 128)]
    leaks = d["sections"]["leaks"]
    assert [(e["location"], e["value"]) for e in leaks] == [
        ("grow", 4096), ("make_small", 1000), ("[no stack]", 128), ("thread_fn", 64)]
    assert {e["module"] for e in leaks} == {"/bin/p", None}
    bt = leaks[1]["backtraces"][0]
    assert [(f["function"], f["file"]) for f in bt["frames"]] == [
        ("make_small", "make_small.c"), ("work", "work.c"), ("main", "main.c")]
    assert bt["truncated"] is False
    # a stack cut short ends in a [truncated] frame, not in a false root
    cut = leaks[3]["backtraces"][0]
    assert cut["truncated"] is True
    assert [f["function"] for f in cut["frames"]] == ["thread_fn", "[truncated]"]
    temp = {e["location"]: e["value"] for e in d["sections"]["temporary"]}
    assert temp == {"make_small": 1, "grow": 1}


def test_report_text(run_db: Path) -> None:
    code, out, _ = invoke("report", str(run_db))
    assert code == 0
    assert "calls to allocation functions: 9 (" in out
    assert "temporary memory allocations: 2 (" in out
    assert (f"peak heap memory consumption: {PEAK['bytes'] / 1024:.2f} KiB "
            f"({PEAK['bytes']:,} B) at 0.000s") in out
    assert "total memory leaked: 5.16 KiB (5,288 B) in 4 allocations" in out
    assert (f"bytes allocated in total: {sum(SIZES) / 1024:.2f} KiB ({sum(SIZES):,} B)"
            in out)
    for title in ("MOST CALLS TO ALLOCATION FUNCTIONS", "PEAK MEMORY CONSUMERS",
                  "MEMORY LEAKS", "MOST TEMPORARY ALLOCATIONS"):
        assert title in out
    assert "4.00 KiB from grow (grow.c:10) in 1 backtrace" in out
    calls = out.split("MOST CALLS TO ALLOCATION FUNCTIONS\n")[1].split("\n\n")[0]
    assert "1 call from make_big (make_big.c:12) in 1 backtrace" in calls
    assert "1 call from make_big (make_big.c:31) in 1 backtrace" in calls
    assert "2 calls from thread_fn (thread_fn.c:16) in 1 backtrace\n" \
           "    2 calls from:\n      thread_fn  thread_fn.c:16\n      [truncated]\n" in calls


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


def test_no_progress_bar_in_output(run_db: Path) -> None:
    """DuckDB prints a progress bar to stdout once a query runs for two seconds (on a busy
    machine, in the middle of `query --format json`): every connection has it off."""
    from memtrack.schema.ddl import open_run

    con = open_run(run_db)
    assert con.execute("SELECT current_setting('enable_progress_bar')").fetchone() == (False,)


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


def copy_stack(con: duckdb.DuckDBPyConnection, sid: int, *, move_one: bool = True,
               line_of: tuple[int, int] | None = None) -> int:
    """A new stack whose every frame is a new code location (another address) at the
    same function, file and line as stack `sid`'s (or, with `line_of` = (depth, line),
    another line at that depth); one of `sid`'s allocations moved to it."""
    new = con.execute("SELECT max(stack_id) + 1 FROM stacks").fetchone()[0]
    base = con.execute("SELECT max(frame_id) + 1 FROM frames").fetchone()[0]
    con.execute("INSERT INTO stacks SELECT ? AS stack_id, * EXCLUDE (stack_id) "
                "FROM stacks WHERE stack_id = ?", [new, sid])
    con.execute("""
        INSERT INTO frames SELECT ? + sf.depth AS frame_id, f.inline_depth, f.name,
            f.function, f.symbol, f."offset" + 1, f.file,
            CASE WHEN sf.depth = ? THEN ? ELSE f.line END, f."column", f.module_id,
            f.vaddr + 1, f.reason
        FROM stack_frames sf JOIN frames f USING (frame_id) WHERE sf.stack_id = ?""",
                [base, *(line_of or (-1, 0)), sid])
    con.execute("""
        INSERT INTO stack_frames SELECT ? AS stack_id, depth, address + 1, module_id,
            method, lookup_vaddr + 1, ? + depth FROM stack_frames WHERE stack_id = ?""",
                [new, base, sid])
    if move_one:
        con.execute("""UPDATE allocations SET stack_id = ? WHERE alloc_id = (
            SELECT min(alloc_id) FROM allocations WHERE stack_id = ?)""", [new, sid])
    con.execute("DELETE FROM backtraces")
    derive(con, "backtraces")  # as the load stage does
    return new


def grow_entry(db: Path) -> dict:
    code, out, _ = invoke("report", str(db), "--format", "json")
    assert code == 0
    return next(e for e in json.loads(out)["sections"]["calls"] if e["location"] == "grow")


def grow_stack(con: duckdb.DuckDBPyConnection) -> int:
    (sid, n), = con.execute("""SELECT stack_id, count(*) FROM allocation_sites
                               WHERE location = 'grow' GROUP BY stack_id""").fetchall()
    assert n == 2
    return sid


def test_stacks_at_the_same_locations_are_one_backtrace(run_db: Path, tmp_path: Path) -> None:
    """Stacks whose bytes differ (locals, say) and whose frames are other addresses (two
    calls on one line) but at the same function, file and line are one backtrace, with
    their values summed: heaptrack's granularity."""
    db = tmp_path / "dup.duckdb"
    db.write_bytes(run_db.read_bytes())
    with duckdb.connect(str(db)) as con:
        sid = grow_stack(con)
        copy_stack(con, sid)
        assert con.execute("SELECT count(DISTINCT stack_id) FROM allocation_sites "
                           "WHERE location = 'grow'").fetchone() == (2,)
    entry = grow_entry(db)
    assert entry["value"] == 2 and entry["stacks"] == 1
    assert [bt["value"] for bt in entry["backtraces"]] == [2]


def test_a_caller_at_another_line_is_another_backtrace(run_db: Path, tmp_path: Path) -> None:
    db = tmp_path / "other.duckdb"
    db.write_bytes(run_db.read_bytes())
    with duckdb.connect(str(db)) as con:
        copy_stack(con, grow_stack(con), line_of=(2, 99))  # main, at line 99
    entry = grow_entry(db)
    assert entry["value"] == 2 and entry["stacks"] == 2
    assert [bt["value"] for bt in entry["backtraces"]] == [1, 1]
    assert sorted(bt["frames"][1]["line"] for bt in entry["backtraces"]) == [11, 99]
