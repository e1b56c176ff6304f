"""`process --jobs N`: every table of the run database is the same whatever the jobs and
the pieces the stack records are cut into, on a synthetic artifact
(bench/synth_artifact.py: real modules, stacks that unwind to _start, threads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import duckdb
import pytest

from memtrack.process.pipeline import ProcessError, process
from memtrack.schema.ddl import DERIVED_NAMES, TABLE_NAMES

ROOT = Path(__file__).resolve().parent.parent


def synth():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("synth_artifact",
                                                  ROOT / "bench" / "synth_artifact.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def checksums(db: Path) -> dict[str, tuple[int, int]]:
    """Rows and an order-sensitive checksum of every table (meta without its paths)."""
    con = duckdb.connect(str(db), read_only=True)
    out = {}
    for name in ("meta", *TABLE_NAMES, *DERIVED_NAMES):
        where = "WHERE key <> 'artifact'" if name == "meta" else ""
        out[name] = con.execute(
            f"SELECT count(*), sum(hash(t) * (n + 1)) FROM "
            f"(SELECT t, row_number() OVER () AS n FROM {name} t {where})").fetchone()
    con.close()
    return out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    art = tmp_path_factory.mktemp("jobs") / "synth.memtrack"
    synth().generate(art, 60_000, 6_000, threads=4, depth=16, quiet=True)
    return art


def test_tables_equal_whatever_jobs(artifact: Path, tmp_path: Path) -> None:
    one = process(artifact, tmp_path / "one.duckdb", progress=False, jobs=1)
    # two workers, and pieces of 1 MiB: 6,000 stacks of ~1.5 KiB are cut into several
    two = process(artifact, tmp_path / "two.duckdb", progress=False, jobs=2,
                  piece_bytes=1 << 20)
    assert one.stacks == two.stacks == 6_000
    assert one.counters == two.counters
    a, b = checksums(tmp_path / "one.duckdb"), checksums(tmp_path / "two.duckdb")
    assert a == b
    assert a["stacks"][0] == 6_000 and a["allocations"][0] == one.allocations
    con = duckdb.connect(str(tmp_path / "two.duckdb"), read_only=True)
    stops = con.execute("SELECT stop, count(*) FROM stacks GROUP BY 1").fetchall()
    con.close()
    assert stops == [("complete", 6_000)]  # every synthetic stack unwinds to _start


def test_jobs_must_be_positive(artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ProcessError, match="--jobs must be at least 1"):
        process(artifact, tmp_path / "x.duckdb", progress=False, jobs=0)


def test_first_verified_record_of_each_hash(artifact: Path) -> None:
    """A hash recorded twice is unwound from its first record that verifies; the same
    bytes from two processes are one stack, counted."""
    import pyarrow as pa

    from memtrack.process.decode import StackRecords
    from memtrack.process.parallel import choose_records
    from memtrack.schema import STACKS
    from memtrack.schema.artifact import Artifact

    rows = Artifact.open(artifact).read("stacks").table.slice(0, 3).to_pylist()
    bad = dict(rows[0], payload=rows[0]["payload"][:-1] + bytes([rows[0]["payload"][-1] ^ 1]))
    table = pa.Table.from_pylist([
        bad,  # does not verify
        dict(rows[0], pid=999),  # the first of its hash that does
        rows[1], dict(rows[1], pid=777),  # one stack recorded by two processes
        rows[2],
    ], schema=STACKS)
    chosen, counters = choose_records(StackRecords.of(table), 1 << 20)
    assert chosen.tolist() == [1, 2, 4]
    assert table.column("hash").take(chosen).to_pylist() == [r["hash"] for r in rows]
    assert counters == {"decode_mismatch": 1, "decode_bad_payload": 0,
                        "stacks_duplicate_hash": 1}
