"""The artifact contract: every table round-trips, and every bad artifact is one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from memtrack.schema import (
    EVENTS,
    FORMAT_MAJOR,
    MANIFEST,
    TABLES,
    Allocator,
    EventKind,
    table_file,
)
from memtrack.schema.artifact import Artifact, ArtifactError, ArtifactWriter, file_checksum

ROOT = Path(__file__).resolve().parent.parent


def sample_rows(name: str, n: int, seed: int = 0) -> dict[str, list]:
    """Deterministic rows of every column of table `name`, covering nulls and lists."""
    schema = TABLES[name]
    cols: dict[str, list] = {}
    for f in schema:
        t = f.type
        if pa.types.is_unsigned_integer(t) or pa.types.is_signed_integer(t):
            bits = t.bit_width
            cols[f.name] = [(seed * 7919 + i * 104729) % (1 << min(bits - 1, 40)) for i in range(n)]
        elif pa.types.is_boolean(t):
            cols[f.name] = [bool((i + seed) % 2) for i in range(n)]
        elif pa.types.is_string(t):
            cols[f.name] = [None if (i % 5 == 4 and f.nullable) else f"{f.name}-{i}"
                            for i in range(n)]
        elif pa.types.is_binary(t):
            cols[f.name] = [bytes([(i + j) % 256 for j in range(i % 37)]) for i in range(n)]
        elif pa.types.is_fixed_size_list(t):
            cols[f.name] = [[i * 100 + j for j in range(t.list_size)] for i in range(n)]
        elif pa.types.is_list(t) and pa.types.is_struct(t.value_type):
            names = [c.name for c in t.value_type]
            cols[f.name] = [[dict.fromkeys(names, i + j) for j in range(i % 3)] for i in range(n)]
        elif pa.types.is_list(t) and pa.types.is_boolean(t.value_type):
            cols[f.name] = [[bool((i + j) % 2) for j in range(i % 6)] for i in range(n)]
        elif pa.types.is_list(t) and pa.types.is_string(t.value_type):
            cols[f.name] = [[f"arg{j}" for j in range(i % 4)] for i in range(n)]
        elif pa.types.is_list(t):
            cols[f.name] = [list(range(i % 6)) for i in range(n)]
        else:
            raise AssertionError(f"sample_rows does not know {f.name}: {t}")
    return cols


def make_artifact(path: Path, rows: int = 50, batches: int = 3) -> dict[str, pa.Table]:
    w = ArtifactWriter(path)
    written: dict[str, list[pa.RecordBatch]] = {n: [] for n in TABLES}
    for b in range(batches):
        for name, schema in TABLES.items():
            batch = pa.RecordBatch.from_pydict(sample_rows(name, rows, seed=b), schema=schema)
            w.write(name, batch)
            written[name].append(batch)
    w.manifest.command = ["./prog", "arg"]
    w.manifest.root_pid = 1234
    w.manifest.exit_status.code = 0
    w.manifest.losses["events_ring_full"] = 3
    w.close()
    return {n: pa.Table.from_batches(bs, schema=TABLES[n]) for n, bs in written.items()}


def test_every_table_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    written = make_artifact(path)
    art = Artifact.open(path)
    assert art.manifest.complete
    assert art.manifest.root_pid == 1234 and art.manifest.command == ["./prog", "arg"]
    assert art.manifest.losses["events_ring_full"] == 3
    for name in TABLES:
        r = art.read(name)
        assert not r.truncated
        assert r.table.equals(written[name]), name
    assert art.warnings == []


def test_files_use_zstd_streams(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    make_artifact(path)
    with pa.ipc.open_stream(pa.memory_map(str(path / table_file("events")))) as r:
        batches = list(r)
    # the empty batch written at creation (a valid stream from the start), then the data
    assert [b.num_rows for b in batches] == [0, 50, 50, 50]
    raw = (path / table_file("events")).read_bytes()
    # An uncompressed stream would hold the sample's repeated column names and zero runs;
    # zstd frames start with this magic number.
    assert b"\x28\xb5\x2f\xfd" in raw


def test_truncated_events_file_reads_whole_batches(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    written = make_artifact(path, rows=200, batches=4)
    f = path / table_file("events")
    data = f.read_bytes()
    with pa.ipc.open_stream(pa.py_buffer(data)) as r:
        sizes = [b.num_rows for b in r]
    assert sizes == [0, 200, 200, 200, 200]
    f.write_bytes(data[: len(data) - 40])  # cut inside the last batch
    # the manifest says the capture ended normally: damage, unless accepted
    with pytest.raises(ArtifactError, match=r"events.arrow: damaged: truncated after 600"):
        Artifact.open(path).read("events")
    art = Artifact.open(path, accept_damaged=True)
    r = art.read("events")
    assert r.truncated
    assert r.table.num_rows == 600
    assert r.table.equals(written["events"].slice(0, 600))
    assert any("truncated after 600 rows" in w for w in art.warnings)


def test_capture_killed_before_manifest_complete(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    w = ArtifactWriter(path)
    w.write("events", sample_rows("events", 10))
    w.flush()
    w.write_manifest()  # what a running capture leaves on disk
    art = Artifact.open(path)
    assert not art.manifest.complete
    assert art.read("events").table.num_rows == 10
    assert any("the capture was cut short" in x for x in art.warnings)


def test_every_table_is_a_valid_stream_from_the_start(tmp_path: Path) -> None:
    """A capture killed right after it created the artifact leaves readable tables."""
    path = tmp_path / "run.memtrack"
    w = ArtifactWriter(path)
    w.write_manifest()
    for name, schema in TABLES.items():
        with pa.ipc.open_stream(pa.memory_map(str(path / table_file(name)))) as r:
            assert r.schema.equals(schema)
            assert r.read_all().num_rows == 0
    art = Artifact.open(path)
    for name in TABLES:
        r = art.read(name)
        assert r.table.num_rows == 0 and not r.truncated
    r = run_info(path)
    assert r.returncode == 0, r.stderr
    assert "the capture was cut short" in r.stdout


def test_empty_table_file_of_a_cut_short_capture_reads_as_no_rows(tmp_path: Path) -> None:
    """What an older memtrack killed mid-run left: faults.arrow of 0 bytes beside intact
    events; the events read, the empty file is a warning. In a complete artifact the
    same file is damage."""
    path = tmp_path / "run.memtrack"
    w = ArtifactWriter(path)
    w.write("events", sample_rows("events", 10))
    w.write_manifest()
    (path / table_file("faults")).write_bytes(b"")
    art = Artifact.open(path)
    assert art.read("events").table.num_rows == 10
    faults = art.read("faults")
    assert faults.table.num_rows == 0 and faults.truncated
    assert any("faults.arrow: empty; read as no rows" in x for x in art.warnings)
    r = run_info(path)
    assert r.returncode == 0, r.stderr
    w.close()
    (path / table_file("faults")).write_bytes(b"")
    with pytest.raises(ArtifactError, match="faults.arrow: empty"):
        Artifact.open(path).read("faults")


def test_writer_refuses_existing_directory(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    make_artifact(path)
    with pytest.raises(ArtifactError, match="already exists"):
        ArtifactWriter(path)
    ArtifactWriter(path, overwrite=True).close()
    assert Artifact.open(path).read("events").table.num_rows == 0


def test_module_copy_layout(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    w = ArtifactWriter(path)
    elf = Path(sys.executable).resolve()
    info = w.add_module("ab" * 20, str(elf), elf)
    vdso = tmp_path / "vdso"
    vdso.write_bytes(b"\x7fELF-not-really")
    w.add_module("cd" * 20, "[vdso]", vdso)
    w.close()
    art = Artifact.open(path)
    mods = {m["build_id"]: m for m in art.modules()}
    assert mods["ab" * 20]["file"] == elf.name and info["debug_file"] is None
    assert (path / "modules" / ("ab" * 20) / elf.name).read_bytes() == elf.read_bytes()
    assert mods["cd" * 20]["file"] == "vdso.so"
    assert [m["build_id"] for m in art.manifest.modules] == ["ab" * 20, "cd" * 20]


# ---- bad artifacts: `memtrack info` prints one line naming the file and exits 2 ----

def run_info(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memtrack.cli", "info", str(path)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})


def _bad(tmp_path: Path, case: str) -> tuple[Path, str]:
    path = tmp_path / "run.memtrack"
    if case == "missing-artifact":
        return path, "no such artifact"
    make_artifact(path)
    if case == "no-manifest":
        (path / MANIFEST).unlink()
        return path, "manifest.json: missing"
    if case == "manifest-not-json":
        (path / MANIFEST).write_text("{not json")
        return path, "manifest.json: not valid JSON"
    if case == "newer-major":
        m = json.loads((path / MANIFEST).read_text())
        m["format_version"] = f"{FORMAT_MAJOR + 1}.0"
        (path / MANIFEST).write_text(json.dumps(m))
        return path, "is newer than this memtrack reads"
    if case == "older-major":
        m = json.loads((path / MANIFEST).read_text())
        m["format_version"] = "1.1"
        (path / MANIFEST).write_text(json.dumps(m))
        return path, "format 1.1 is older than this memtrack reads"
    if case == "missing-events":
        (path / table_file("events")).unlink()
        return path, "events.arrow: missing"
    if case == "wrong-schema":
        bad = pa.schema([f for f in EVENTS if f.name != "size"])
        with pa.ipc.new_stream(str(path / table_file("events")), bad) as w:
            w.write(pa.RecordBatch.from_pydict({f.name: [1] for f in bad}, schema=bad))
        return path, "wrong schema for 'events': missing size"
    if case == "not-arrow":
        (path / table_file("events")).write_bytes(b"hello, this is not arrow at all")
        return path, "events.arrow: not an Arrow IPC stream"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing-artifact", "no-manifest", "manifest-not-json",
                                  "newer-major", "older-major", "missing-events",
                                  "wrong-schema", "not-arrow"])
def test_info_bad_artifact_is_one_line_exit_2(tmp_path: Path, case: str) -> None:
    path, expected = _bad(tmp_path, case)
    r = run_info(path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("memtrack: ") and expected in lines[0], lines[0]
    assert str(path) in lines[0]
    assert "Traceback" not in r.stderr


def test_info_prints_contents(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    w = ArtifactWriter(path)
    kinds = [EventKind.MALLOC, EventKind.MALLOC, EventKind.FREE, EventKind.REALLOC]
    rows = sample_rows("events", len(kinds))
    rows["kind"] = [int(k) for k in kinds]
    rows["allocator"] = [int(Allocator.LIBC)] * len(kinds)
    w.write("events", rows)
    w.write("mappings", sample_rows("mappings", 7))
    w.manifest.command = ["./demo", "--fast"]
    w.manifest.root_pid = 4321
    w.manifest.exit_status.code = 3
    w.manifest.losses["stacks_ring_full"] = 12
    elf = Path(sys.executable).resolve()
    w.add_module("ef" * 20, str(elf), elf)
    w.close()
    r = run_info(path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "./demo --fast" in out and "pid 4321" in out and "exit 3" in out
    assert "malloc" in out and " 2" in out and "realloc" in out
    assert "stacks_ring_full=12" in out
    assert "modules   1" in out and str(elf) in out
    for name in TABLES:
        assert name in out
    rj = subprocess.run([sys.executable, "-m", "memtrack.cli", "info", "--json", str(path)],
                        capture_output=True, text=True, cwd=ROOT)
    data = json.loads(rj.stdout)
    assert data["tables"]["events"]["rows"] == 4
    assert data["tables"]["mappings"]["rows"] == 7
    assert data["event_kinds"] == {"malloc": 2, "free": 1, "realloc": 1}
    assert data["losses"]["stacks_ring_full"] == 12


def test_help_lists_every_command() -> None:
    r = subprocess.run([sys.executable, "-m", "memtrack.cli", "--help"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    for cmd in ("capture", "process", "report", "query", "export", "info", "doctor"):
        assert f" {cmd} " in r.stdout, cmd


def test_fidelity_counters_are_not_losses(tmp_path: Path) -> None:
    path = tmp_path / "run.memtrack"
    w = ArtifactWriter(path)
    w.manifest.losses.update(stack_copies_cut=7, stacks_ring_full=2)
    w.close()
    assert Artifact.open(path).manifest.nonzero_losses() == {"stacks_ring_full": 2}


def _older_processes(path: Path, version: str) -> None:
    """processes.arrow as formats before 2.5 wrote it (no ns_pid), the manifest `version`."""
    old = pa.schema([f for f in TABLES["processes"] if f.name != "ns_pid"])
    table = Artifact.open(path).read("processes").table.select(old.names)
    with pa.ipc.new_stream(str(path / table_file("processes")), old) as w:
        w.write_table(table.cast(old))
    m = json.loads((path / MANIFEST).read_text())
    m["format_version"] = version
    m.get("checksums", {}).pop(table_file("processes"), None)
    (path / MANIFEST).write_text(json.dumps(m))


def test_processes_of_an_older_format_read_ns_pid_as_null(tmp_path: Path) -> None:
    """A column a minor format added (schema.ADDED_COLUMNS) reads as nulls from a file of
    an older format, through `process` too; a file of the format that has it must."""
    from support.synth import write_artifact

    art = write_artifact(tmp_path / "run.memtrack")
    assert Artifact.open(art).read("processes").table["ns_pid"].to_pylist() == [100, 200, 200]
    _older_processes(art, "2.4")
    read = Artifact.open(art).read("processes").table
    assert read.schema == TABLES["processes"] and read.num_rows == 3
    assert read["ns_pid"].null_count == 3 and read["pid"].to_pylist() == [100, 200, 200]
    db = tmp_path / "run.duckdb"
    r = subprocess.run([sys.executable, "-m", "memtrack.cli", "process", str(art), "-o",
                        str(db), "-q"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT pid, name, ns_pid FROM processes ORDER BY pid"
                           ).fetchall() == [(100, "parent", None), (200, "child2", None)]
        counters = json.loads(con.execute(
            "SELECT value FROM meta WHERE key = 'counters'").fetchone()[0])
        assert counters.get("processes_bad_rows", 0) == 0, counters
    _older_processes(art, "2.5")
    r = run_info(art)
    assert r.returncode == 2 and "wrong schema for 'processes': missing ns_pid" in r.stderr


@pytest.mark.parametrize("version", ["2.4", "2.5"])
def test_column_a_minor_format_added(tmp_path: Path, version: str) -> None:
    """stacks.arrow of a format before python_cut (2.5) reads as no Python cut; the
    same file in a 2.5 artifact lacks a column it must have."""
    path = tmp_path / "run.memtrack"
    written = make_artifact(path)
    f = path / table_file("stacks")
    old = written["stacks"].drop_columns(["python_cut"])
    with pa.ipc.new_stream(str(f), old.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(old)
    m = json.loads((path / MANIFEST).read_text())
    m["format_version"] = version
    m["checksums"][table_file("stacks")] = file_checksum(f)
    (path / MANIFEST).write_text(json.dumps(m))
    art = Artifact.open(path)
    if version == "2.5":
        with pytest.raises(ArtifactError, match="wrong schema for 'stacks': missing python_cut"):
            art.read("stacks")
        return
    got = art.read("stacks").table
    assert got.schema.equals(TABLES["stacks"])
    assert got.column("python_cut").to_pylist() == [False] * old.num_rows
    assert got.drop_columns(["python_cut"]).equals(old)
