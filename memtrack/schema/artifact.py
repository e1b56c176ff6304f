"""Reading and writing an artifact directory (NAME.memtrack/).

Every table is an Arrow IPC *stream* with zstd-compressed buffers. A stream has no
footer, so batches can be appended as they arrive and a file cut short by a killed
capture is still readable up to its last whole batch. Each file is a valid stream from
the moment it is created (its schema and an empty batch are written and flushed at
once), and the manifest is written at the start and rewritten while capture runs
(`complete` only at the end), so a capture killed at any point leaves an artifact
that reads as "cut short", never as damaged.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from memtrack.schema import (
    FORMAT_MAJOR,
    MANIFEST,
    MODULE_INFO,
    MODULES_DIR,
    TABLES,
    table_file,
)
from memtrack.schema.manifest import Manifest


class ArtifactError(Exception):
    """A problem with an artifact, worded for one line: `FILE: problem`."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


class TableWriter:
    """Appends record batches of one schema to one IPC stream file (from any thread)."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self.rows = 0
        self._lock = threading.Lock()
        # not pa.OSFile: its fd would be inherited by the traced program (no O_CLOEXEC,
        # and OSFile.fileno() cannot say which it is); Python's open() sets it
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._sink = pa.PythonFile(self._file, mode="w")
        self._writer = pa.ipc.new_stream(self._sink, schema, options=_WRITE_OPTIONS)
        # the stream writer puts the schema out with the first batch: a valid (empty)
        # stream from the start
        self._writer.write_batch(pa.RecordBatch.from_pylist([], schema=schema))
        self._sink.flush()

    def write(self, data: pa.RecordBatch | pa.Table | dict[str, Any]) -> None:
        if isinstance(data, dict):
            data = pa.RecordBatch.from_pydict(data, schema=self.schema)
        elif not data.schema.equals(self.schema):
            data = data.cast(self.schema) if isinstance(data, pa.Table) else pa.Table.from_batches(
                [data]
            ).cast(self.schema)
        if data.num_rows == 0:
            return
        with self._lock:
            self._writer.write(data)
            self.rows += data.num_rows

    def flush(self) -> None:
        with self._lock:
            self._sink.flush()

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._sink.close()
                self._file.close()
                self._writer = None  # type: ignore[assignment]


class ArtifactWriter:
    """Creates NAME.memtrack/ and its table files; the manifest is written last."""

    def __init__(self, path: Path | str, *, overwrite: bool = False) -> None:
        self.path = Path(path)
        if self.path.exists():
            if not overwrite:
                raise ArtifactError(self.path, "already exists (use --force to replace it)")
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        (self.path / MODULES_DIR).mkdir()
        self.tables: dict[str, TableWriter] = {
            name: TableWriter(self.path / table_file(name), schema)
            for name, schema in TABLES.items()
        }
        self.manifest = Manifest()

    def write(self, table: str, data: pa.RecordBatch | pa.Table | dict[str, Any]) -> None:
        self.tables[table].write(data)

    def module_dir(self, build_id: str) -> Path:
        return self.path / MODULES_DIR / build_id

    def has_module(self, build_id: str) -> bool:
        return (self.module_dir(build_id) / MODULE_INFO).exists()

    def add_module(
        self, build_id: str, path: str, elf: Path, debug_file: Path | None = None
    ) -> dict[str, Any]:
        """Copy one module (and its separate debug file) into modules/BUILD_ID/."""
        d = self.module_dir(build_id)
        d.mkdir(parents=True, exist_ok=True)
        name = os.path.basename(path.strip("[]")) or "module"
        if path.startswith("["):
            name += ".so"
        shutil.copyfile(elf, d / name)
        debug_name = None
        if debug_file is not None:
            debug_name = name + ".debug"
            shutil.copyfile(debug_file, d / debug_name)
        info = {"build_id": build_id, "path": path, "file": name, "debug_file": debug_name}
        (d / MODULE_INFO).write_text(json.dumps(info, indent=1))
        self.manifest.modules.append(info)
        return info

    def flush(self) -> None:
        for t in self.tables.values():
            t.flush()

    def write_manifest(self) -> None:
        _atomic_write(self.path / MANIFEST, json.dumps(self.manifest.to_dict(), indent=2))

    def close(self) -> None:
        for t in self.tables.values():
            t.close()
        self.manifest.complete = True
        self.write_manifest()


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".manifest.")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


@dataclass
class TableRead:
    table: pa.Table
    truncated: bool = False  # the file ended inside a batch; rows up to the last whole one
    problem: str = ""


@dataclass
class Artifact:
    """An artifact opened for reading; tables are read (and validated) on demand."""

    path: Path
    manifest: Manifest
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, path: Path | str) -> Artifact:
        path = Path(path)
        if not path.exists():
            raise ArtifactError(path, "no such artifact")
        if not path.is_dir():
            raise ArtifactError(path, "not an artifact directory")
        mpath = path / MANIFEST
        if not mpath.exists():
            raise ArtifactError(mpath, "missing (not an artifact, or capture never started)")
        try:
            raw = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(mpath, f"not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ArtifactError(mpath, "not a JSON object")
        version = str(raw.get("format_version", ""))
        try:
            major = int(version.split(".")[0])
        except ValueError:
            raise ArtifactError(mpath, f"bad format_version {version!r}") from None
        if major > FORMAT_MAJOR:
            raise ArtifactError(
                mpath,
                f"format {version} is newer than this memtrack reads ({FORMAT_MAJOR}.x); "
                "upgrade memtrack",
            )
        if major < FORMAT_MAJOR:
            raise ArtifactError(
                mpath,
                f"format {version} is older than this memtrack reads ({FORMAT_MAJOR}.x: "
                "stack records are skeletons since 2.0); capture again",
            )
        try:
            manifest = Manifest.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise ArtifactError(mpath, f"malformed manifest ({e})") from None
        art = cls(path=path, manifest=manifest)
        if not manifest.complete:
            art.warnings.append(f"{path}: the capture was cut short (memtrack killed?): "
                                "tables hold what was written up to their last whole batch")
        return art

    def read(self, name: str, *, required: bool = True) -> TableRead:
        """Read one table, validating its schema; a truncated stream yields its whole batches."""
        schema = TABLES[name]
        fpath = self.path / table_file(name)
        if not fpath.exists():
            if required:
                raise ArtifactError(fpath, "missing")
            return TableRead(schema.empty_table())
        batches: list[pa.RecordBatch] = []
        truncated = False
        problem = ""
        if fpath.stat().st_size == 0 and not self.manifest.complete:
            # a capture killed before this table's first batch (older memtrack)
            self.warnings.append(f"{fpath}: empty; read as no rows")
            return TableRead(schema.empty_table(), True, "empty")
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(fpath)))
        except (pa.ArrowInvalid, OSError) as e:
            if fpath.stat().st_size == 0:
                raise ArtifactError(fpath, "empty (capture killed before it started?)") from None
            raise ArtifactError(fpath, f"not an Arrow IPC stream ({e})") from None
        if not reader.schema.equals(schema):
            diff = _schema_diff(reader.schema, schema)
            raise ArtifactError(fpath, f"wrong schema for {name!r}: {diff}")
        while True:
            try:
                batches.append(reader.read_next_batch())
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as e:
                truncated = True
                problem = f"truncated after {sum(b.num_rows for b in batches)} rows ({e})"
                break
        if truncated:
            self.warnings.append(f"{fpath}: {problem}; reading the whole batches before it")
        return TableRead(pa.Table.from_batches(batches, schema=schema), truncated, problem)

    def modules(self) -> list[dict[str, Any]]:
        """module.json of every module copied into the artifact."""
        out = []
        mdir = self.path / MODULES_DIR
        if mdir.is_dir():
            for d in sorted(mdir.iterdir()):
                info = d / MODULE_INFO
                if info.exists():
                    try:
                        out.append(json.loads(info.read_text()))
                    except json.JSONDecodeError:
                        self.warnings.append(f"{info}: not valid JSON; module skipped")
        return out


def _schema_diff(got: pa.Schema, want: pa.Schema) -> str:
    gn = {f.name: f.type for f in got}
    wn = {f.name: f.type for f in want}
    missing = [n for n in wn if n not in gn]
    extra = [n for n in gn if n not in wn]
    typed = [f"{n} is {gn[n]}, expected {wn[n]}" for n in wn if n in gn and gn[n] != wn[n]]
    parts = []
    if missing:
        parts.append("missing " + ", ".join(missing))
    if extra:
        parts.append("unexpected " + ", ".join(extra))
    parts.extend(typed)
    return "; ".join(parts) or "field order differs"
