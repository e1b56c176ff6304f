"""Hostile artifacts made from a small real capture (tests/test_hostile.py): every
family of issue 16's list and more. Each case is a function that damages a copy of the
capture in place; `outside` is a directory beside the copy that nothing may read or
write (it holds a valid ELF and manifest, the targets of the escapes)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from memtrack.schema import TABLES, table_file

_OPTS = pa.ipc.IpcWriteOptions(compression="zstd")


@dataclass
class Case:
    name: str
    damage: Callable[[Path, Path], None]
    expect: str = "any"  # "ok" (exit 0), "error" (exit 2) or "any" (either)
    says: str = ""  # a substring of the output (stderr on error, stdout+stderr on success)
    known: str = ""  # a failure not fixed yet (the test is an expected failure until then)
    # the manifest's checksums are rewritten to match the damaged files, as an attacker
    # would: the damage must be caught by what reads the values, not by the checksum
    reseal: bool = True


KNOWN: dict[str, str] = {}  # case name -> why it still fails


def read_table(art: Path, name: str) -> pa.Table:
    with pa.ipc.open_stream(pa.memory_map(str(art / table_file(name)))) as r:
        return r.read_all()


def write_table(art: Path, name: str, table: pa.Table) -> None:
    path = art / table_file(name)
    path.unlink()
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema, options=_OPTS) as w:
        w.write_table(table)


def set_column(art: Path, name: str, col: str, value: object,
               rows: slice = slice(0, 1)) -> None:
    """Set `col` to `value` in the rows `rows` of a table."""
    t = read_table(art, name)
    old = t.column(col).combine_chunks()
    n = len(t)
    idx = set(range(n)[rows])
    merged = [value if i in idx else old[i].as_py() for i in range(n)]
    write_table(art, name, t.set_column(t.schema.get_field_index(col), col,
                                        pa.array(merged, old.type)))


def reseal(art: Path) -> None:
    """Rewrite the manifest's checksums of the table files as they now are (nothing when
    the manifest is not a readable regular JSON file)."""
    from memtrack.schema.artifact import file_checksum

    path = art / "manifest.json"
    if path.is_symlink() or not path.is_file():
        return
    try:
        m = json.loads(path.read_bytes())
        sums = m["checksums"]
    except (ValueError, RecursionError, KeyError, TypeError):
        return
    if not isinstance(sums, dict):
        return
    for name in sums:
        f = art / name
        if f.is_file() and not f.is_symlink():
            sums[name] = file_checksum(f)
    path.write_text(json.dumps(m))


def manifest(art: Path) -> dict:
    return json.loads((art / "manifest.json").read_text())


def set_manifest(art: Path, **fields: object) -> None:
    m = manifest(art)
    for k, v in fields.items():
        cur = m
        *path, last = k.split("__")
        for p in path:
            cur = cur[p]
        cur[last] = v
    (art / "manifest.json").write_text(json.dumps(m))


def modules(art: Path) -> list[Path]:
    return sorted(p for p in (art / "modules").iterdir() if (p / "module.json").exists())


def module_info(d: Path) -> dict:
    return json.loads((d / "module.json").read_text())


def set_module_info(d: Path, **fields: object) -> None:
    info = module_info(d)
    info.update(fields)
    (d / "module.json").write_text(json.dumps(info))


def libc_dir(art: Path) -> Path:
    return next(d for d in modules(art) if "libc.so" in module_info(d)["path"])


def _replace_with(art: Path, rel: str, make: Callable[[Path], None]) -> None:
    p = art / rel
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()
    make(p)


def _section_size(elf: Path, section: str, size: int) -> None:
    """Set one section's sh_size in an ELF64 file's section header table."""
    data = bytearray(elf.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    stroff, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        h = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, h)
        end = data.index(0, stroff + name_off)
        if data[stroff + name_off:end].decode() == section:
            struct.pack_into("<Q", data, h + 0x20, size)
            elf.write_bytes(bytes(data))
            return
    raise AssertionError(f"{elf} has no {section}")


def _flip(art: Path, name: str, where: float) -> None:
    p = art / table_file(name)
    data = bytearray(p.read_bytes())
    i = int(len(data) * where)
    data[i] ^= 0xFF
    p.write_bytes(bytes(data))


def _escape_build_id(art: Path, outside: Path) -> None:
    # a build id that walks out of the cache directory, in module.json and mappings
    bad = "../../../../" + str(outside).lstrip("/") + "/ESCAPED"
    d = libc_dir(art)
    set_module_info(d, build_id=bad)
    set_column(art, "mappings", "build_id", bad, slice(0, None))


def _map_libc_to(art: Path, path: str) -> None:
    """libc's copy refused (module.json not JSON) and its mappings say `path`: process
    once fell back to that host file (/etc/shadow, a FIFO) for a run from elsewhere."""
    d = libc_dir(art)
    libc = module_info(d)["path"]
    (d / "module.json").write_text("{")
    t = read_table(art, "mappings")
    paths = [path if p == libc else p for p in t.column("path").to_pylist()]
    write_table(art, "mappings", t.set_column(t.schema.get_field_index("path"), "path",
                                              pa.array(paths, pa.string())))


def _other_elf(art: Path, outside: Path) -> None:
    # an ELF filed under another module's build id (its note differs)
    a, b = modules(art)[:2]
    fa = a / module_info(a)["file"]
    shutil.copyfile(b / module_info(b)["file"], fa)


def cases() -> list[Case]:
    out = [*_cases()]
    for c in out:
        c.known = KNOWN.get(c.name, "")
    return out


def _cases() -> list[Case]:
    out = "outside"
    C = Case
    return [
        # reads and writes outside the artifact
        C("module-file-absolute", lambda a, o: set_module_info(
            libc_dir(a), file=str(o / "libc.so.6")), "ok", out),
        C("module-file-dotdot", lambda a, o: set_module_info(
            libc_dir(a), file="../../../outside/libc.so.6"), "ok", "not a file name"),
        C("module-debug-absolute", lambda a, o: set_module_info(
            libc_dir(a), debug_file=str(o / "libc.so.6")), "ok", "not a file name"),
        C("module-elf-symlink-out", lambda a, o: _replace_with(
            a, str((libc_dir(a) / module_info(libc_dir(a))["file"]).relative_to(a)),
            lambda p: p.symlink_to(o / "libc.so.6")), "ok", "leaves the artifact"),
        C("module-dir-symlink-out", lambda a, o: _replace_with(
            a, str(libc_dir(a).relative_to(a)), lambda p: p.symlink_to(o)), "ok",
          "leaves the artifact"),
        C("modules-symlink-out", lambda a, o: _replace_with(
            a, "modules", lambda p: p.symlink_to(o)), "ok", "leaves the artifact"),
        C("manifest-symlink-out", lambda a, o: _replace_with(
            a, "manifest.json", lambda p: p.symlink_to(o / "manifest.json")), "error",
          "leaves the artifact"),
        C("manifest-fifo", lambda a, o: _replace_with(
            a, "manifest.json", lambda p: os.mkfifo(p)), "error", "not a regular file"),
        C("manifest-dev-zero", lambda a, o: _replace_with(
            a, "manifest.json", lambda p: p.symlink_to("/dev/zero")), "error",
          "leaves the artifact"),
        C("manifest-huge", lambda a, o: os.truncate(a / "manifest.json", 65 << 20), "error",
          "such a file may hold"),
        C("events-fifo", lambda a, o: _replace_with(
            a, "events.arrow", lambda p: os.mkfifo(p)), "error", "not a regular file"),
        C("events-dev-zero", lambda a, o: _replace_with(
            a, "events.arrow", lambda p: p.symlink_to("/dev/zero")), "error",
          "leaves the artifact"),
        C("events-symlink-inside", lambda a, o: _replace_with(
            a, "events.arrow", lambda p: p.symlink_to("stacks.arrow")), "error",
          "wrong schema"),
        C("build-id-escape", _escape_build_id, "ok"),
        C("module-dir-not-hex", lambda a, o: libc_dir(a).rename(a / "modules" / "libc"), "ok",
          "not a build id"),
        C("module-elf-other-build-id", _other_elf, "ok"),
        C("module-json-not-json", lambda a, o: (libc_dir(a) / "module.json").write_text("{"),
          "ok", "not valid JSON"),
        C("module-json-list", lambda a, o: (libc_dir(a) / "module.json").write_text("[1]"),
          "ok", "not a JSON object"),
        C("module-json-deep", lambda a, o: (libc_dir(a) / "module.json").write_text(
            "[" * 100000 + "]" * 100000), "ok", "module skipped"),
        C("module-json-file-int", lambda a, o: set_module_info(libc_dir(a), file=7), "ok",
          "must be strings"),
        C("module-elf-section-2^40", lambda a, o: _section_size(
            libc_dir(a) / module_info(libc_dir(a))["file"], ".eh_frame", 1 << 40), "ok"),
        C("module-debug-section-2^40", lambda a, o: _section_size(
            libc_dir(a) / module_info(libc_dir(a))["debug_file"], ".debug_info", 1 << 40),
          "ok"),
        C("mapping-etc-shadow", lambda a, o: _map_libc_to(a, "/etc/shadow"), "ok",
          "host modules off"),
        C("mapping-fifo", lambda a, o: (os.mkfifo(o / "fifo"), _map_libc_to(a, str(o / "fifo"))),
          "ok", "host modules off"),
        C("mapping-other-artifact", lambda a, o: _map_libc_to(a, str(o / "libc.so.6")), "ok",
          "host modules off"),
        C("module-elf-empty", lambda a, o: (
            libc_dir(a) / module_info(libc_dir(a))["file"]).write_bytes(b""), "ok"),
        # manifest fields of the wrong type or out of range
        C("manifest-exit-status-list", lambda a, o: set_manifest(a, exit_status=[1]), "error",
          "exit_status"),
        C("manifest-host-string", lambda a, o: set_manifest(a, host="x"), "error", "host"),
        C("manifest-start-yesterday", lambda a, o: set_manifest(a, start_ns="yesterday"),
          "error", "start_ns"),
        C("manifest-start-1e30", lambda a, o: set_manifest(a, start_ns=10**30), "error",
          "start_ns"),
        C("manifest-command-string", lambda a, o: set_manifest(a, command="ls"), "error",
          "command"),
        C("manifest-losses-list", lambda a, o: set_manifest(a, losses=[1]), "error", "losses"),
        C("manifest-loss-negative", lambda a, o: set_manifest(
            a, losses__events_ring_full=-5), "error", "losses"),
        C("manifest-loss-huge", lambda a, o: set_manifest(
            a, losses__events_ring_full=2**64), "error", "losses"),
        C("manifest-complete-no", lambda a, o: set_manifest(a, complete="no"), "error",
          "complete"),
        C("manifest-page-size-0", lambda a, o: set_manifest(a, host__page_size=0), "error",
          "page_size"),
        C("manifest-extra-list", lambda a, o: set_manifest(a, options__extra=[1]), "error",
          "extra"),
        C("manifest-deep", lambda a, o: (a / "manifest.json").write_text(
            '{"format_version": "2.0", "options": {"x": ' + "[" * 100000 + "]" * 100000 + "}}"),
          "error", "manifest.json"),
        C("manifest-non-utf8", lambda a, o: (a / "manifest.json").write_bytes(
            (a / "manifest.json").read_bytes().replace(b'"command"', b'"\xffcommand"')),
          "error", "manifest.json"),
        C("manifest-markup", lambda a, o: set_manifest(a, command=["[/bold]x[red"]), "ok",
          "[/bold]x[red"),
        C("manifest-format-3", lambda a, o: set_manifest(a, format_version="3.0"), "error",
          "newer"),
        C("manifest-format-list", lambda a, o: set_manifest(a, format_version=[2]), "error",
          "format_version"),
        C("manifest-missing", lambda a, o: (a / "manifest.json").unlink(), "error", "missing"),
        C("manifest-cut-short", lambda a, o: set_manifest(a, complete=False), "ok",
          "cut short"),
        # column values that size or index something
        C("stacks-copy-len-4g", lambda a, o: set_column(
            a, "stacks", "copy_len", 0xFFFFFFFF, slice(0, None)), "ok",
          "bad rows skipped"),
        C("stacks-payload-empty", lambda a, o: set_column(
            a, "stacks", "payload", b"", slice(0, None)), "ok"),
        C("stacks-payload-short", lambda a, o: set_column(
            a, "stacks", "payload", b"\x01\x02\x03", slice(0, 5)), "ok"),
        C("stacks-null-regs", lambda a, o: set_column(
            a, "stacks", "regs", [None] * 17, slice(0, 3)), "ok",
          "bad rows skipped"),
        C("stacks-huge-fp-chain", lambda a, o: set_column(
            a, "stacks", "fp_chain", [1] * 5000, slice(0, 2)), "ok",
          "bad rows skipped"),
        C("events-size-2^64-1", lambda a, o: set_column(
            a, "events", "size", 2**64 - 1, slice(0, None, 3)), "ok",
          "bad rows skipped"),
        C("events-kind-200", lambda a, o: set_column(
            a, "events", "kind", 200, slice(0, 10)), "ok"),
        C("events-allocator-99", lambda a, o: set_column(
            a, "events", "allocator", 99, slice(0, 10)), "ok",
          "bad rows skipped"),
        C("events-ts-max", lambda a, o: set_column(
            a, "events", "ts", 2**64 - 1, slice(0, 5)), "ok"),
        C("events-addr-0", lambda a, o: set_column(
            a, "events", "addr", 0, slice(0, None)), "ok"),
        C("rss-member-99", lambda a, o: set_column(
            a, "rss", "member", 99, slice(0, 4)), "ok", "bad rows skipped"),
        C("rss-bytes-int64-max", lambda a, o: set_column(
            a, "rss", "bytes", 2**63 - 1, slice(0, 4)), "ok",
          "bad rows skipped"),
        C("rss-bytes-negative", lambda a, o: set_column(
            a, "rss", "bytes", -1, slice(0, 4)), "ok", "bad rows skipped"),
        C("mappings-none-usable", lambda a, o: set_column(
            a, "mappings", "end", 0, slice(0, None)), "ok",
          "bad rows skipped"),
        C("mappings-empty", lambda a, o: write_table(
            a, "mappings", TABLES["mappings"].empty_table()), "ok"),
        C("mappings-null-path", lambda a, o: set_column(
            a, "mappings", "path", None, slice(0, 5)), "ok"),
        C("processes-null-pid", lambda a, o: set_column(
            a, "processes", "pid", None), "ok"),
        # damaged files
        C("events-truncated", lambda a, o: os.truncate(
            a / "events.arrow", (a / "events.arrow").stat().st_size // 2), "error",
          "events.arrow: damaged: truncated"),
        C("events-last-bytes-cut", lambda a, o: os.truncate(
            a / "events.arrow", (a / "events.arrow").stat().st_size - 50), "error",
          "events.arrow: damaged"),
        C("events-truncated-cut-short", lambda a, o: (os.truncate(
            a / "events.arrow", (a / "events.arrow").stat().st_size // 2),
            set_manifest(a, complete=False)), "ok", "truncated"),
        C("events-empty-file", lambda a, o: (a / "events.arrow").write_bytes(b""), "error",
          "empty"),
        C("events-garbage", lambda a, o: (a / "events.arrow").write_bytes(b"\xff" * 4096),
          "error", "events.arrow"),
        C("events-missing", lambda a, o: (a / "events.arrow").unlink(), "error", "missing"),
        C("events-dropped-column", lambda a, o: write_table(
            a, "events", read_table(a, "events").drop_columns(["size"])), "error",
          "missing size"),
        C("events-added-column", lambda a, o: write_table(
            a, "events", read_table(a, "events").append_column(
                "future", pa.array([1] * read_table(a, "events").num_rows))), "ok"),
        C("events-retyped-column", lambda a, o: write_table(a, "events", read_table(
            a, "events").set_column(0, "ts", pa.array(["x"] * read_table(
                a, "events").num_rows))), "error", "ts is string"),
        C("stacks-directory", lambda a, o: _replace_with(
            a, "stacks.arrow", lambda p: p.mkdir()), "error", "not a regular file"),
        *(C(f"flip-{t}-{w}", lambda a, o, t=t, w=w: _flip(a, t, w))
          for t in ("events", "stacks", "mappings", "rss", "processes")
          for w in (0.3, 0.8)),
        # the manifest's checksums catch what parses but is not what capture wrote
        C("events-value-changed", lambda a, o: set_column(a, "events", "addr", 12345),
          "error", "events.arrow: damaged", reseal=False),
        C("stacks-value-changed", lambda a, o: set_column(a, "stacks", "sp", 8), "error",
          "stacks.arrow: damaged", reseal=False),
        *(C(f"flip-unsealed-{t}", lambda a, o, t=t: _flip(a, t, 0.5), reseal=False)
          for t in ("events", "stacks", "mappings")),
        C("manifest-checksums-list", lambda a, o: set_manifest(a, checksums=[1]), "error",
          "checksums"),
    ]
