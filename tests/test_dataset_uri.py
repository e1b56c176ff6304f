"""A dataset behind a URI (`file:///DIR` here: through pyarrow's filesystems, as
`s3://` would be): `process` appends to it, `query`, `diff` and `history` read it and
give what they give for the same directory by path; an append that fails part way
leaves no run (its `runs` row is written last, and removed first when a run is
replaced) and no staging files; a symbolic link inside is refused there too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.runs import disk_full_at
from support.synth import SIZES, write_artifact, write_run
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.process import dataset as writer
from memtrack.schema.dataset import DatasetError, Remote, run_ids, where

PER_RUN = ("SELECT run, count(*) AS calls, sum(size)::BIGINT AS bytes FROM allocations "
           "GROUP BY run ORDER BY run")


def invoke(*args: str | Path) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def test_process_query_diff_history_over_a_uri(tmp_path: Path) -> None:
    art = write_artifact(tmp_path / "a.memtrack")
    ds = tmp_path / "ds"
    uri = ds.as_uri()
    assert isinstance(where(uri), Remote)
    for run in ("r1", "r2"):
        code, _, err = invoke("process", art, "--dataset", uri, "--run-id", run, "-q",
                              "--label", f"commit={run}")
        assert code == 0, err
    code, _, err = invoke("process", art, "--dataset", uri, "--run-id", "r1", "-q")
    assert code == 2 and "already in the dataset (--force replaces it)" in err
    assert sorted(p.name for p in ds.iterdir()) == sorted(
        ["runs", *writer.EXPORT_TABLES])  # no staging left
    for table in ("runs", "allocations", "meta"):
        assert sorted(p.name for p in (ds / table).iterdir()) == ["run=r1", "run=r2"]
        assert [p.name for p in (ds / table / "run=r1").iterdir()] == ["data.parquet"]
    # the same files read by path and by URI
    by_uri = invoke("query", "--dataset", uri, "--format", "json", PER_RUN)
    by_path = invoke("query", "--dataset", ds, "--format", "json", PER_RUN)
    assert by_uri == by_path and json.loads(by_uri[1]) == [
        {"run": r, "calls": len(SIZES), "bytes": sum(SIZES)} for r in ("r1", "r2")]
    code, text, _ = invoke("diff", "--dataset", uri, "r1", "r2")
    assert code == 0 and text.splitlines()[0] == "base: run r1  [commit=r1]  $ p -x"
    by_uri = invoke("history", "--dataset", uri, "--format", "json", "--order-by", "commit")
    by_path = invoke("history", "--dataset", ds, "--format", "json", "--order-by", "commit")
    d_uri, d_path = json.loads(by_uri[1]), json.loads(by_path[1])
    assert d_uri["dataset"] == uri and d_path["dataset"] == str(ds)
    assert {**d_uri, "dataset": None} == {**d_path, "dataset": None}
    assert [r["run"] for r in d_uri["runs"]] == ["r1", "r2"]


def test_an_append_that_fails_leaves_no_run(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    db = write_run(tmp_path / "run.duckdb")
    uri = (tmp_path / "ds").as_uri()
    assert writer.append_run(uri, "r1", db) is False
    copy = writer.copy_parquet
    written: list[str] = []

    def failing(con: object, query: str, path: Path) -> None:
        written.append(path.name)
        if len(written) == 5:
            raise OSError(28, "No space left on device")
        copy(con, query, path)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "copy_parquet", failing)
    with pytest.raises(OSError):
        writer.append_run(uri, "r2", db)
    assert run_ids(uri) == ["r1"]  # the tables written are no run: r2 has no runs row
    assert (tmp_path / "ds" / "processes" / "run=r2" / "data.parquet").is_file()
    written.clear()
    with pytest.raises(OSError):  # replacing r1: it leaves the dataset first
        writer.append_run(uri, "r1", db, force=True)
    assert run_ids(uri) == []
    assert not [p for p in (tmp_path / "ds").iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(writer, "copy_parquet", copy)
    assert writer.append_run(uri, "r1", db, force=True) is False  # its runs row was gone
    assert run_ids(uri) == ["r1"]


def test_links_inside_are_refused(tmp_path: Path) -> None:
    db = write_run(tmp_path / "run.duckdb")
    ds = tmp_path / "ds"
    writer.append_run(ds.as_uri(), "r1", db)
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, ds / "allocations" / "run=r2")
    (ds / "runs" / "run=r2").mkdir()
    (ds / "runs" / "run=r2" / "data.parquet").write_bytes(
        (ds / "runs" / "run=r1" / "data.parquet").read_bytes())
    code, _, err = invoke("query", "--dataset", ds.as_uri(), "SELECT count(*) FROM allocations")
    assert code == 2 and "not a directory of this dataset" in err and err.count("\n") == 1
    with pytest.raises(DatasetError, match="not a directory of this dataset"):
        writer.append_run(ds.as_uri(), "r2", db, force=True)
    assert list(victim.iterdir()) == []


def test_a_bad_uri_is_one_line(tmp_path: Path) -> None:
    code, _, err = invoke("query", "--dataset", "nosuch://x/y", "SELECT 1")
    assert code == 2 and err.startswith("memtrack: nosuch://x/y: ") and err.count("\n") == 1


def test_object_storage_path(tmp_path: Path) -> None:
    """The code path of `s3://` (no local filesystem under it: listings, moves that are
    copies) on pyarrow's in-memory filesystem (`mock:`): append, a failed append that
    leaves no run, query, a run read as its database, history."""
    import pyarrow.fs as pafs

    from memtrack.report.history import HistoryOptions, history_data
    from memtrack.schema.dataset import open_dataset, open_dataset_run

    fs, _ = pafs.FileSystem.from_uri("mock:///")
    remote = Remote(fs, "bucket/ds", "mock:///bucket/ds")
    db = write_run(tmp_path / "run.duckdb")
    for run in ("r1", "r2"):
        assert writer.append_run(remote, run, db) is False
    with pytest.raises(DatasetError, match="already in the dataset"):
        writer.append_run(remote, "r1", db)
    with disk_full_at("allocations"), pytest.raises(OSError):
        writer.append_run(remote, "r3", db)
    assert run_ids(remote) == ["r1", "r2"]
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector("bucket/ds"))]
    assert sorted(names) == sorted(["runs", *writer.EXPORT_TABLES])  # no staging left
    con = open_dataset(remote)
    assert con.execute(PER_RUN).fetchall() == [(r, len(SIZES), sum(SIZES)) for r in ("r1", "r2")]
    run = open_dataset_run(remote, "r2")
    assert run.execute("SELECT sum(size)::BIGINT FROM allocations").fetchone() == (sum(SIZES),)
    h = history_data(remote, HistoryOptions(diffs=True)).data
    assert h["dataset"] == "mock:///bucket/ds" and [r["run"] for r in h["runs"]] == ["r1", "r2"]
    assert h["steps"] == [] and list(h["diffs"]) == ["r2"]


@pytest.mark.parametrize("as_uri", [False, True])
def test_an_append_leaves_the_other_runs_alone(tmp_path: Path, as_uri: bool) -> None:
    """Appending a run creates its own files and nothing else: every file of the runs
    already there is the same file (inode, size, time) afterwards."""
    db = write_run(tmp_path / "run.duckdb")
    ds = tmp_path / "ds"
    root = ds.as_uri() if as_uri else ds
    for run in ("r1", "r2"):
        writer.append_run(root, run, db)

    def files() -> dict[str, tuple[int, int, int]]:
        return {str(p.relative_to(ds)): (p.stat().st_ino, p.stat().st_size,
                                         p.stat().st_mtime_ns)
                for p in ds.rglob("*") if p.is_file()}

    before = files()
    writer.append_run(root, "r3", db)
    after = files()
    assert {k: after[k] for k in before} == before
    assert sorted({k.split("/")[1] for k in set(after) - set(before)}) == ["run=r3"]
    assert len(set(after) - set(before)) == len(writer.EXPORT_TABLES) + 1
