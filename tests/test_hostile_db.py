"""Hostile run databases, datasets and artifacts (issue 35), built synthetically (no
capture): a run database whose stored views, macros or tables are not memtrack's, a
dataset with symbolic links inside, SQL that writes into a dataset, and the values that
were tracebacks. Each runs through the command line under tests/test_hostile.py's
harness (an audit hook names every file opened outside the allowed roots): exit 0 or 2
with one line, never a traceback, nothing read or written outside."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from support.synth import write_artifact, write_run
from test_hostile import check, memtrack

from memtrack.elf.debuglink import find_debug_file
from memtrack.elf.image import ElfImage
from memtrack.schema import STACKS
from memtrack.schema.artifact import ArtifactWriter, file_checksum
from memtrack.schema.dataset import partition

SECRET = "SECRET-6f1c"  # what a file outside holds: never in any output


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.txt").write_text(SECRET + "\n")
    return d / "secret.txt"


def hostile_db(path: Path, secret: Path, *sql: str) -> Path:
    """The synthetic run database with `sql` run in it (`{secret}`: the outside file)."""
    write_run(path)
    with duckdb.connect(str(path)) as con:
        for s in sql:
            con.execute(s.replace("{secret}", str(secret)))
    return path


# a stored view of memtrack's name that reads a file, as every reader used to run it
READING_VIEW = (
    "ALTER VIEW stack_location RENAME TO old_location",
    "CREATE VIEW stack_location AS SELECT stack_id, frame_id, "
    "(SELECT content FROM read_text('{secret}')) AS name, function, file, line, module_id "
    "FROM old_location",
    "CREATE OR REPLACE VIEW hotspots AS SELECT content AS function FROM read_text('{secret}')",
    "CREATE MACRO site(x) AS (SELECT content FROM read_text('{secret}'))",
    "CREATE TABLE extra AS SELECT content FROM read_text('{secret}')",
)


def run_cli(tmp_path: Path, *cmds: list[str], read: list[Path],
            write: list[Path]) -> list[str]:
    """Each command's output, the harness's contract checked (no file opened outside,
    exit 0 or 2 with one line, no traceback)."""
    results, bad = memtrack(tmp_path, *cmds, read=read, write=write)
    return [check(r, bad, " ".join(r.args[:1])) for r in results if r is not None]


def test_stored_views_macros_and_tables_are_never_run(tmp_path: Path, secret: Path) -> None:
    db = hostile_db(tmp_path / "run.duckdb", secret, *READING_VIEW)
    good = write_run(tmp_path / "good.duckdb")
    out = tmp_path / "out"
    out.mkdir()
    said = run_cli(
        tmp_path, ["report", str(db)], ["report", str(db), "--html", str(out / "r.html")],
        ["report", str(db), "--format", "json"],
        ["export", str(db), "--format", "folded", "-o", str(out / "f.txt")],
        ["diff", str(good), str(db)],
        ["query", str(db), "select name from stack_location"],
        ["query", str(db), "select * from hotspots"],
        read=[tmp_path / "run.duckdb", good, out], write=[out])
    assert len(said) == 7 and "make_small" in said[0]
    for s in [*said, (out / "r.html").read_text(), (out / "f.txt").read_text()]:
        assert SECRET not in s


@pytest.mark.parametrize(("sql", "says"), [
    (("DROP TABLE frames CASCADE",
      "CREATE VIEW frames AS SELECT content AS name FROM read_text('{secret}')"),
     "a damaged run database: no frames"),
    (("ALTER TABLE events ADD COLUMN evil VARCHAR",),
     "a damaged run database: events not as memtrack writes it"),
    (("DROP TABLE meta", "CREATE VIEW meta AS SELECT 'schema_version' AS key, "
      "content AS value FROM read_text('{secret}')"), "not a memtrack run database"),
])
def test_a_run_database_not_memtracks_is_refused(tmp_path: Path, secret: Path,
                                                 sql: tuple[str, ...], says: str) -> None:
    db = hostile_db(tmp_path / "run.duckdb", secret, *sql)
    for s in run_cli(tmp_path, ["report", str(db)], ["query", str(db), "select 1"],
                     read=[db], write=[]):
        assert says in s and SECRET not in s, s


def test_query_cannot_reopen_file_access(tmp_path: Path, secret: Path) -> None:
    db = write_run(tmp_path / "run.duckdb")
    for sql in ("SET enable_external_access = true",
                "SET lock_configuration = false",
                f"ATTACH '{secret}' AS s",
                "INSTALL httpfs", "LOAD httpfs"):
        (s,) = run_cli(tmp_path, ["query", str(db), sql], read=[db], write=[])
        assert s.startswith("memtrack: query:"), (sql, s)


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    from memtrack.process.dataset import append_run

    ds = tmp_path / "ds"
    append_run(ds, "a", write_run(tmp_path / "a.duckdb"))
    return ds


def test_process_dataset_never_writes_through_a_symlink(tmp_path: Path, dataset: Path) -> None:
    art = write_artifact(tmp_path / "b.memtrack")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.parquet").write_text("precious")
    os.symlink(victim, partition(dataset, "allocations", "b"))
    cmd = ["process", str(art), "--dataset", str(dataset), "--run-id", "b",
           "--host-modules", "off", "--cache", "off", "--quiet"]
    (s,) = run_cli(tmp_path, cmd, read=[art, dataset], write=[dataset])
    assert "run=b: not a directory of this dataset" in s, s
    assert (victim / "data.parquet").read_text() == "precious"
    # a symlink in the file's place is replaced, never written through
    os.unlink(partition(dataset, "allocations", "b"))
    partition(dataset, "allocations", "b").mkdir()
    os.symlink(victim / "data.parquet", partition(dataset, "allocations", "b") / "data.parquet")
    (s,) = run_cli(tmp_path, [*cmd, "--force"], read=[art, dataset], write=[dataset])
    assert (victim / "data.parquet").read_text() == "precious"
    assert not (partition(dataset, "allocations", "b") / "data.parquet").is_symlink()
    (s,) = run_cli(tmp_path, ["query", "--dataset", str(dataset),
                              "select count(DISTINCT run) AS n from allocations"],
                   read=[dataset], write=[])
    assert s.split()[2] == "2", s


def test_query_dataset_writes_nothing(tmp_path: Path, dataset: Path, secret: Path) -> None:
    before = {p: p.read_bytes() for p in dataset.rglob("*") if p.is_file()}
    target = partition(dataset, "events", "a") / "data.parquet"
    for sql in (f"COPY (SELECT 1) TO '{target}' (FORMAT parquet)",
                f"COPY (SELECT 1) TO '{dataset}/new.csv'",
                f"SELECT * FROM read_text('{secret}')"):
        (s,) = run_cli(tmp_path, ["query", "--dataset", str(dataset), sql], read=[dataset],
                       write=[])
        assert "file system operations are disabled" in s and SECRET not in s, s
    assert {p: p.read_bytes() for p in dataset.rglob("*") if p.is_file()} == before


def test_dataset_file_symlinked_out_is_refused(tmp_path: Path, dataset: Path,
                                              secret: Path) -> None:
    f = partition(dataset, "frames", "a") / "data.parquet"
    shutil.move(f, secret.parent / "frames.parquet")
    os.symlink(secret.parent / "frames.parquet", f)
    for s in run_cli(tmp_path, ["query", "--dataset", str(dataset), "select 1"],
                     ["diff", "--dataset", str(dataset), "a", "a"],
                     read=[dataset], write=[]):
        assert "data.parquet: not a file of this dataset" in s, s


def test_numeric_options_are_bounded(tmp_path: Path) -> None:
    db = write_run(tmp_path / "run.duckdb")
    said = run_cli(tmp_path, ["report", str(db), "--top", str(2**64)],
                   ["report", str(db), "--pid", str(2**40)],
                   ["diff", str(db), str(db), "--top", str(2**63)],
                   ["diff", str(db), str(db), "--pid", str(2**70)],
                   ["export", str(db), "--format", "folded", "-o", str(tmp_path / "x"),
                    "--pid", "-1"],
                   read=[db], write=[tmp_path / "x"])
    for s, option in zip(said, ("--top", "--pid", "--top", "--pid", "--pid"), strict=True):
        assert s.startswith(f"memtrack: {option}: expected 0") or \
            s.startswith(f"memtrack: {option}: expected 1"), s


def reseal(art: Path) -> None:
    m = json.loads((art / "manifest.json").read_text())
    m["checksums"] = {f: file_checksum(art / f) for f in m["checksums"]}
    (art / "manifest.json").write_text(json.dumps(m))


def test_manifest_nested_deep_is_one_line(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    m = json.loads((art / "manifest.json").read_text())
    deep: dict = {}
    for _ in range(900):
        deep = {"x": deep}
    m["options"]["extra"] = deep
    (art / "manifest.json").write_text(json.dumps(m))
    for s in run_cli(tmp_path, ["info", str(art)], ["info", str(art), "--json"],
                     read=[art], write=[]):
        assert "nested more than" in s, s


def test_a_field_name_not_utf8_is_one_line(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    f = art / "events.arrow"
    data = bytearray(f.read_bytes())
    data[data.index(b"old_addr")] = 0xFF
    f.write_bytes(bytes(data))
    reseal(art)
    out = tmp_path / "out"
    out.mkdir()
    for s in run_cli(tmp_path, ["info", str(art)],
                     ["process", str(art), "-o", str(out / "r.duckdb"), "--cache", "off",
                      "--host-modules", "off"], read=[art, out], write=[out]):
        assert "events.arrow: wrong schema for 'events': a field name that is not UTF-8" in s


def test_a_complete_artifact_cut_short_is_damaged(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    f = art / "events.arrow"
    os.truncate(f, f.stat().st_size - 50)
    out = tmp_path / "out"
    out.mkdir()
    cmd = ["process", str(art), "-o", str(out / "r.duckdb"), "--cache", "off",
           "--host-modules", "off"]
    said = run_cli(tmp_path, ["info", str(art)], cmd, [*cmd, "--accept-damaged", "--force"],
                   read=[art, out], write=[out])
    assert all("events.arrow: damaged: truncated after" in s for s in said[:2]), said
    assert "truncated after" in said[2] and not said[2].startswith("memtrack: "), said[2]


def test_unwind_skips_rows_process_would(tmp_path: Path) -> None:
    art = tmp_path / "a.memtrack"
    w = ArtifactWriter(art)
    w.write("stacks", pa.table({
        "hash": [5], "ts": [1], "pid": [1], "tid": [1], "sp": [0x7000], "copy_len": [0xFFFFFFFF],
        "truncated": [False], "regs": [[0] * 17], "payload": [b"\0" * 16], "fp_chain": [[]],
        "ret_fixups": [[]], "python_cut": [False]}, schema=STACKS))
    w.close()
    (s,) = run_cli(tmp_path, ["unwind", str(art), "--record", "5"], read=[art], write=[])
    assert "no stack record with hash 0x5" in s, s


def test_a_debuglink_beside_a_copy_is_an_artifact_file(tmp_path: Path) -> None:
    """A module copy's .gnu_debuglink names a file beside it that is a symlink out of
    the artifact (to the genuine debug file, so its CRC matches): never used."""
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    with ElfImage(libc) as img:
        link, build_id = img.debuglink(), img.build_id
    genuine = find_debug_file(libc, build_id)
    if link is None or genuine is None:
        pytest.skip("this host's libc has no debuglink or no debug file")
    d = tmp_path / "a.memtrack" / "modules" / build_id
    d.mkdir(parents=True)
    shutil.copyfile(libc, d / "libc.so.6")
    os.symlink(genuine, d / link[0])
    assert find_debug_file(d / "libc.so.6", None, ()) is not None  # what it was
    assert find_debug_file(d / "libc.so.6", None, (), tmp_path / "a.memtrack") is None
