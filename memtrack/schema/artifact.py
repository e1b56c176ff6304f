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

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from memtrack.schema import (
    ADDED_COLUMNS,
    MANIFEST,
    MODULE_INFO,
    MODULES_DIR,
    TABLES,
    table_file,
)
from memtrack.schema.manifest import Manifest, ManifestError


class ArtifactError(Exception):
    """A problem with an artifact, worded for one line: `FILE: problem`."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


# An artifact is untrusted input (uploaded from a runner nobody here controls): every
# file of it is reached through artifact_file, and read no larger than these.
MAX_MANIFEST_BYTES = 64 << 20
MAX_MODULE_INFO_BYTES = 64 << 10
BUILD_ID = re.compile(r"[0-9a-f]{2,128}")  # a build id names files: hex only


def _resolve(root: Path, names: tuple[str, ...]) -> tuple[Path, str]:
    """(the path as shown, the real path) of `names` under `root`, or ArtifactError when
    a name is not a plain one or the real path leaves the artifact."""
    shown = root.joinpath(*(n if isinstance(n, str) else "?" for n in names))
    for n in names:
        if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or "\0" in n:
            raise ArtifactError(shown, f"not a file name inside the artifact: {n!r}")
    real_root = os.path.realpath(root)
    real = os.path.realpath(root.joinpath(*names))
    if os.path.commonpath([real_root, real]) != real_root:
        raise ArtifactError(shown, "a symlink that leaves the artifact")
    return shown, real


def artifact_file(root: Path, *names: str, max_bytes: int | None = None) -> Path:
    """The one way to a file of the artifact at `root`: `names` are plain names (no
    `/`, `..`, `.` or NUL: nothing absolute or leading up), the file they name does not
    leave the artifact through a symlink, is a regular file (not a FIFO, a device or a
    directory) and holds at most `max_bytes`. The resolved path, or ArtifactError
    (FileNotFoundError when it does not exist)."""
    shown, real = _resolve(root, names)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ArtifactError(shown, e.strerror or str(e)) from None
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(shown, "not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ArtifactError(shown, f"{st.st_size:,} bytes, more than the {max_bytes:,} "
                                   "such a file may hold")
    return Path(real)


def artifact_dir(root: Path, name: str) -> Path | None:
    """A directory of the artifact (artifact_file's rules), None when there is none."""
    shown, real = _resolve(root, (name,))
    if not os.path.lexists(real):
        return None
    if not os.path.isdir(real):
        raise ArtifactError(shown, "not a directory")
    return Path(real)


def artifact_bytes(root: Path, *names: str, max_bytes: int) -> bytes:
    """The bytes of a small file of the artifact (artifact_file's rules), at most
    `max_bytes` read whatever the file grew to since."""
    with open(artifact_file(root, *names, max_bytes=max_bytes), "rb") as f:
        return f.read(max_bytes + 1)[:max_bytes]


@dataclass(frozen=True)
class ModuleCopy:
    """A module copied into the artifact, as its validated module.json names it."""

    build_id: str  # hex, the name of its directory
    path: str  # where it was mapped on the traced host
    elf_path: Path  # resolved inside the artifact
    debug_path: Path | None  # its separate debug file, resolved inside the artifact

    def to_dict(self) -> dict[str, Any]:
        return {"build_id": self.build_id, "path": self.path, "file": self.elf_path.name,
                "debug_file": self.debug_path.name if self.debug_path else None}


def module_copies(root: Path) -> tuple[list[ModuleCopy], list[str]]:
    """Every module of `root`/modules/ whose module.json is valid (a JSON object whose
    build_id is hex and names its directory, whose file and debug_file are plain names of
    regular files in that directory), and one line per module skipped. Whether the ELF's
    own build-id note agrees is checked where the ELF is read (memtrack.symbolize)."""
    out: list[ModuleCopy] = []
    problems: list[str] = []
    try:
        mdir = artifact_dir(root, MODULES_DIR)
    except ArtifactError as e:
        return out, [str(e)]
    if mdir is None:
        return out, problems
    for d in sorted(os.listdir(mdir)):
        try:
            out.append(_module_copy(root, d))
        except FileNotFoundError:
            continue  # a directory without module.json: a copy never finished
        except ArtifactError as e:
            problems.append(f"{e}; module skipped")
    return out, problems


def _module_copy(root: Path, d: str) -> ModuleCopy:
    shown = root / MODULES_DIR / d / MODULE_INFO
    if not BUILD_ID.fullmatch(d):
        raise ArtifactError(root / MODULES_DIR / d, "not a build id (hex)")
    data = artifact_bytes(root, MODULES_DIR, d, MODULE_INFO, max_bytes=MAX_MODULE_INFO_BYTES)
    try:
        info = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ArtifactError(shown, f"not valid JSON ({e})") from None
    if not isinstance(info, dict):
        raise ArtifactError(shown, "not a JSON object")
    bid, path, file, debug = (info.get(k) for k in ("build_id", "path", "file", "debug_file"))
    if bid != d:
        raise ArtifactError(shown, f"build_id {bid!r} is not its directory's name")
    if not isinstance(path, str) or not isinstance(file, str) or not (
            debug is None or isinstance(debug, str)):
        raise ArtifactError(shown, "path and file must be strings, debug_file a string or null")
    try:
        elf = artifact_file(root, MODULES_DIR, d, file)
    except FileNotFoundError:
        raise ArtifactError(shown, f"its file {file!r} is missing") from None
    dbg = None
    if debug:
        try:
            dbg = artifact_file(root, MODULES_DIR, d, debug)
        except FileNotFoundError:
            raise ArtifactError(shown, f"its debug file {debug!r} is missing") from None
    return ModuleCopy(d, path, elf, dbg)


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
        self.manifest.checksums = {t.path.name: file_checksum(t.path)
                                   for t in self.tables.values()}
        self.manifest.complete = True
        self.write_manifest()


def file_checksum(path: Path) -> str:
    """The checksum the manifest keeps of a finished table file."""
    with open(path, "rb") as f:
        return "blake2b:" + hashlib.file_digest(f, "blake2b").hexdigest()


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
    position: int = 0  # bytes of the file read so far (batches)


@dataclass
class Artifact:
    """An artifact opened for reading; tables are read (and validated) on demand."""

    path: Path
    manifest: Manifest
    warnings: list[str] = field(default_factory=list)
    truncated: set[str] = field(default_factory=set)  # tables read up to a cut batch
    # a table cut short in an artifact whose manifest says the capture ended normally is
    # damage (ArtifactError) unless accepted (`--accept-damaged`): read up to the cut
    accept_damaged: bool = False

    @classmethod
    def open(cls, path: Path | str, *, accept_damaged: bool = False) -> Artifact:
        path = Path(path)
        if not path.exists():
            raise ArtifactError(path, "no such artifact")
        if not path.is_dir():
            raise ArtifactError(path, "not an artifact directory")
        mpath = path / MANIFEST
        try:
            data = artifact_bytes(path, MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise ArtifactError(mpath, "missing (not an artifact, or capture never started)"
                                ) from None
        try:
            manifest = Manifest.decode(data)
        except ManifestError as e:
            raise ArtifactError(mpath, str(e)) from None
        art = cls(path=path, manifest=manifest, accept_damaged=accept_damaged)
        if not manifest.complete:
            art.warnings.append(f"{path}: the capture was cut short (memtrack killed?): "
                                "tables hold what was written up to their last whole batch")
        return art

    def file(self, *names: str, max_bytes: int | None = None) -> Path:
        """A file of this artifact, through artifact_file's rules."""
        return artifact_file(self.path, *names, max_bytes=max_bytes)

    def read(self, name: str, *, required: bool = True) -> TableRead:
        """Read one table whole (`batches`)."""
        read = TableRead(TABLES[name].empty_table())
        batches = list(self.batches(name, required=required, into=read))
        read.table = pa.Table.from_batches(batches, schema=TABLES[name])
        return read

    def batches(self, name: str, *, required: bool = True,
                into: TableRead | None = None) -> Iterator[pa.RecordBatch]:
        """One table's record batches, each validated, its schema checked (columns a
        newer minor format added are left out); a truncated stream yields its whole
        batches (and says so in `into`), a damaged one raises ArtifactError after its
        last (the checksum is of the whole file). The file is read, not mapped: the
        batches already handed out take no memory once let go."""
        schema = TABLES[name]
        shown = self.path / table_file(name)
        into = into if into is not None else TableRead(schema.empty_table())
        try:
            fpath = self.file(table_file(name))
        except FileNotFoundError:
            if required:
                raise ArtifactError(shown, "missing") from None
            return
        rows = 0
        if fpath.stat().st_size == 0 and not self.manifest.complete:
            # a capture killed before this table's first batch (older memtrack)
            self.warn(f"{shown}: empty; read as no rows")
            into.truncated, into.problem = True, "empty"
            return
        with pa.OSFile(str(fpath)) as f:
            try:
                reader = pa.ipc.open_stream(f)
            except (pa.ArrowException, OSError) as e:
                if fpath.stat().st_size == 0:
                    raise ArtifactError(shown, "empty (capture killed before it started?)"
                                        ) from None
                raise ArtifactError(shown, f"not an Arrow IPC stream ({_one_line(e)})"
                                    ) from None
            filled = self._filled(name, reader.schema)
            try:
                diff = _schema_diff(reader.schema, pa.schema(
                    [f for f in schema if f.name not in filled]))
            except UnicodeDecodeError:  # pyarrow decodes a field's name as it is asked
                diff = "a field name that is not UTF-8"
            if diff:
                raise ArtifactError(shown, f"wrong schema for {name!r}: {diff}")
            while True:
                try:
                    batch = reader.read_next_batch()
                    # a damaged offset or length is read beyond its buffer (a crash)
                    # unless every batch is validated in full before use
                    batch.validate(full=True)
                except StopIteration:
                    break
                except (pa.ArrowException, OSError, MemoryError) as e:
                    into.truncated = True
                    into.problem = f"truncated after {rows} rows ({_one_line(e)})"
                    break
                if not batch.schema.equals(schema):
                    batch = pa.RecordBatch.from_arrays(
                        [pa.repeat(pa.scalar(filled[f.name], f.type), batch.num_rows)
                         if f.name in filled else batch.column(f.name) for f in schema],
                        schema=schema)
                rows += batch.num_rows
                into.position = f.tell()
                yield batch
        want = self.manifest.checksums.get(table_file(name))
        if not into.truncated and want is not None and file_checksum(fpath) != want:
            # it parses, but its values are not those capture wrote (a flipped byte)
            raise ArtifactError(shown, "damaged: its bytes differ from the checksum capture "
                                       "wrote in the manifest")
        if into.truncated and self.manifest.complete and not self.accept_damaged:
            raise ArtifactError(shown, f"damaged: {into.problem}, yet the manifest says the "
                                "capture ended normally (--accept-damaged reads the whole "
                                "batches before the damage)")
        if into.truncated:
            self.truncated.add(name)
            self.warn(f"{shown}: {into.problem}; reading the whole batches before it")

    def _filled(self, name: str, got: pa.Schema) -> dict[str, object]:
        """The columns of table `name` that a minor format after this artifact's added
        (ADDED_COLUMNS) and its file lacks: name -> the value its rows read as."""
        try:
            version = tuple(int(x) for x in self.manifest.format_version.split(".")[:2])
        except ValueError:
            return {}
        return {col: value for col, since, value in ADDED_COLUMNS.get(name, ())
                if version < since and col not in got.names}

    def warn(self, text: str) -> None:
        """A warning, once (a table read again warns again)."""
        if text not in self.warnings:
            self.warnings.append(text)

    def module_copies(self) -> list[ModuleCopy]:
        """The modules copied into the artifact whose module.json is valid (the others
        are named in `warnings`)."""
        copies, problems = module_copies(self.path)
        self.warnings.extend(p for p in problems if p not in self.warnings)
        return copies

    def modules(self) -> list[dict[str, Any]]:
        """module.json of every valid module copied into the artifact."""
        return [c.to_dict() for c in self.module_copies()]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _schema_diff(got: pa.Schema, want: pa.Schema) -> str:
    gn = {f.name: f.type for f in got}
    wn = {f.name: f.type for f in want}
    missing = [n for n in wn if n not in gn]
    typed = [f"{n} is {gn[n]}, expected {wn[n]}" for n in wn if n in gn and gn[n] != wn[n]]
    dup = sorted({n for n in got.names if got.names.count(n) > 1} & set(wn))
    parts = []
    if missing:
        parts.append("missing " + ", ".join(missing))
    if dup:
        parts.append("repeated " + ", ".join(dup))
    parts.extend(typed)
    return "; ".join(parts)
