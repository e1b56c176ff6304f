"""The capture's BPF program: bcc compiles it once, memtrack loads it.

bcc builds a program by running clang over the C sources at every start: 0.4-0.8 s
here on a quiet machine, several times that on a busy one (and every malloc clang
makes traps while another capture's uprobes are attached). What bcc produces depends
only on its inputs, so `load_program` keeps it: an `Image` holds each function's
bytecode with its map references turned into relocations, and each map's
specification; it is cached under `$XDG_CACHE_HOME/memtrack/bpf` (capture runs as
root: `/root/.cache/...`) keyed by everything that shapes bcc's output (`cache_key`).

Every load, cached or just compiled, goes through the same small loader (`Program`):
it creates the maps, loads functions on demand, attaches the `tracepoint__*`
functions as bcc would, and offers tables with bcc's table API over its maps
(memtrack.capture.tables), so that `program[name]`, `program.funcs`, `load_func` and
`attach_tracepoint` serve the capture parts as a `bcc.BPF` object did. A cache hit
loads neither bcc nor its clang and LLVM.

A cache file is used only if this user owns it, nobody else can write it, and both
its key and the digest of its content match: a cached program is never stale, and
nobody else's.
"""

from __future__ import annotations

import ctypes as ct
import errno
import functools
import hashlib
import importlib.util
import json
import os
import re
import stat
import struct
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from memtrack.capture.syscalls import bpf
from memtrack.capture.tables import Table, attach_tracepoint, ctype_of, detach_tracepoint

CACHE_FORMAT = 1
TRACEFS_EVENTS = Path("/sys/kernel/tracing/events")
BPF_PSEUDO_MAP_FD = 1
LD_IMM64 = 0x18
CALL = 0x85
BPF_PSEUDO_KFUNC_CALL = 2
BPF_MAP_CREATE = 0
BPF_PROG_LOAD = 5
BPF_PROG_TEST_RUN = 10
BPF_OBJ_NAME_LEN = 16
PROG_KPROBE, PROG_TRACEPOINT, PROG_RAW_TRACEPOINT = 2, 5, 17
MAX_RUN_ARGS = 12  # a raw tracepoint program's context: at most 12 u64 arguments
LOG_SIZE = 1 << 24
LOAD_ATTEMPTS = 5
SLOW_S = 1.0  # loading still under way after this long is announced

# The kernel functions behind common.h's MT_LOOP (Linux 6.4+; memtrack uses them from
# 6.7, whose verifier checks an iterator loop's convergence exactly): the sources call
# each through a placeholder helper number, which compile_image turns into a call of
# the kernel function by its BTF id (bcc cannot declare kernel functions).
ITERATOR_KFUNCS = {"MT_KF_ITER_NEW": ("bpf_iter_num_new", 0x4D540001),
                   "MT_KF_ITER_NEXT": ("bpf_iter_num_next", 0x4D540002),
                   "MT_KF_ITER_DESTROY": ("bpf_iter_num_destroy", 0x4D540003)}
ITERATORS_SINCE = (6, 7)
VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")
_TRACEPOINT_RE = re.compile(r"TRACEPOINT_PROBE\(\s*(\w+)\s*,\s*(\w+)\s*\)")


class LoadError(Exception):
    """The program could not be built or loaded; the message says why, in one line."""


@dataclass
class MapSpec:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: str  # bcc's JSON description of the C type (ctypes Key/Leaf come from it)
    leaf_desc: str
    inner: str = ""  # a map of maps: the map its values are shaped like


@dataclass
class Image:
    """What bcc produced: per function its bytecode (map references zeroed) and the
    (instruction, map index) pairs to relocate; per map its specification."""

    license: str
    kern_version: int
    maps: list[MapSpec]
    functions: dict[str, bytes]
    relocations: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def to_json(self, key: str) -> bytes:
        body = {"license": self.license, "kern_version": self.kern_version,
                "maps": [asdict(m) for m in self.maps],
                "functions": {k: v.hex() for k, v in self.functions.items()},
                "relocations": self.relocations}
        payload = json.dumps(body, sort_keys=True)
        digest = hashlib.sha256(payload.encode()).hexdigest()
        return json.dumps({"format": CACHE_FORMAT, "key": key, "digest": digest,
                           "body": payload}).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> Image | None:
        """The image, or None when the data is not a whole, matching cache entry."""
        try:
            outer = json.loads(data)
            if outer.get("format") != CACHE_FORMAT or outer.get("key") != key:
                return None
            payload = outer["body"]
            if hashlib.sha256(payload.encode()).hexdigest() != outer["digest"]:
                return None
            body = json.loads(payload)
            return cls(body["license"], int(body["kern_version"]),
                       [MapSpec(**m) for m in body["maps"]],
                       {k: bytes.fromhex(v) for k, v in body["functions"].items()},
                       {k: [(int(i), int(m)) for i, m in v]
                        for k, v in body["relocations"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


# -- bcc: the compiler ------------------------------------------------------------------

@functools.cache
def _libbcc() -> Any:
    """libbcc's module introspection calls that bcc's Python module does not declare
    (a CDLL instance of our own, so that bcc's declarations stay as they are)."""
    lib = ct.CDLL("libbcc.so.0", use_errno=True)
    sz, vp, cp = ct.c_size_t, ct.c_void_p, ct.c_char_p
    for name, res, args in (
            ("bpf_num_tables", sz, [vp]), ("bpf_table_name", cp, [vp, sz]),
            ("bpf_table_fd_id", ct.c_int, [vp, sz]), ("bpf_table_type_id", ct.c_int, [vp, sz]),
            ("bpf_table_key_size_id", sz, [vp, sz]), ("bpf_table_leaf_size_id", sz, [vp, sz]),
            ("bpf_table_max_entries_id", sz, [vp, sz]),
            ("bpf_table_flags_id", ct.c_int, [vp, sz]),
            ("bpf_table_key_desc_id", cp, [vp, sz]), ("bpf_table_leaf_desc_id", cp, [vp, sz]),
            ("bpf_num_functions", sz, [vp]), ("bpf_function_name", cp, [vp, sz]),
            ("bpf_function_start", vp, [vp, cp]), ("bpf_function_size", sz, [vp, cp]),
            ("bpf_module_license", cp, [vp]), ("bpf_module_kern_version", ct.c_uint, [vp])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


_MAP_OF_MAPS_RE = re.compile(r'BPF_(?:ARRAY|HASH)_OF_MAPS\(\s*(\w+)\s*,\s*"(\w+)"')


def compile_image(text: str, cflags: list[str], kfuncs: dict[int, int] | None = None) -> Image:
    """Run bcc over `text` and take what it produced (nothing is loaded or attached);
    `kfuncs` maps placeholder helper numbers to the BTF ids of the kernel functions
    they stand for."""
    from bcc import BPF

    class Compiler(BPF):  # type: ignore[misc]
        def _trace_autoload(self) -> None:
            pass  # bcc would load and attach tracepoint__* functions here

    try:
        b = Compiler(text=text, cflags=cflags)
    except Exception as e:  # noqa: BLE001 - bcc raises plain Exception
        raise LoadError(f"cannot compile the BPF program: {e}") from None
    lib = _libbcc()
    # bcc keeps a map of maps' inner map to itself: read it where the source declares it
    inner = dict(_MAP_OF_MAPS_RE.findall(text))
    try:
        m = b.module
        maps, index = [], {}
        for i in range(lib.bpf_num_tables(m)):
            spec = MapSpec(lib.bpf_table_name(m, i).decode(), lib.bpf_table_type_id(m, i),
                           lib.bpf_table_key_size_id(m, i), lib.bpf_table_leaf_size_id(m, i),
                           lib.bpf_table_max_entries_id(m, i), lib.bpf_table_flags_id(m, i),
                           lib.bpf_table_key_desc_id(m, i).decode(),
                           lib.bpf_table_leaf_desc_id(m, i).decode())
            spec.inner = inner.get(spec.name, "")
            index[lib.bpf_table_fd_id(m, i)] = len(maps)
            maps.append(spec)
        functions, relocations = {}, {}
        for i in range(lib.bpf_num_functions(m)):
            name = lib.bpf_function_name(m, i)
            code = bytearray(ct.string_at(lib.bpf_function_start(m, name),
                                          lib.bpf_function_size(m, name)))
            relocs = []
            for at in range(0, len(code) - 8, 8):
                op, regs, _, imm = struct.unpack_from("<BBhi", code, at)
                if op == LD_IMM64 and regs >> 4 == BPF_PSEUDO_MAP_FD:
                    relocs.append((at // 8, index[imm]))
                    struct.pack_into("<i", code, at + 4, 0)
                elif op == CALL and regs == 0 and kfuncs and imm in kfuncs:
                    struct.pack_into("<BBhi", code, at, CALL, BPF_PSEUDO_KFUNC_CALL << 4, 0,
                                     kfuncs[imm])
            functions[name.decode()] = bytes(code)
            relocations[name.decode()] = relocs
        return Image(lib.bpf_module_license(m).decode(), lib.bpf_module_kern_version(m),
                     maps, functions, relocations)
    finally:
        b.cleanup()


# -- kernel functions -------------------------------------------------------------------

def iterators_possible() -> bool:
    """Whether this kernel should have the number iterator (its release and a vmlinux
    BTF: cheap, for the cache key; kfunc_ids confirms it when compiling)."""
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return bool(m) and (int(m[1]), int(m[2])) >= ITERATORS_SINCE and VMLINUX_BTF.exists()


def iterator_cflags() -> list[str]:
    """The flags that build common.h's MT_LOOP on the kernel's iterator."""
    return ["-DMT_ITER", *(f"-D{macro}={number:#x}"
                           for macro, (_, number) in ITERATOR_KFUNCS.items())]


# Bytes after a BTF type's 12-byte header, by kind: fixed, and per vlen entry.
_BTF_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}
_BTF_PER_MEMBER = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}
_BTF_FUNC = 12


def kfunc_ids(names: list[str], path: Path = VMLINUX_BTF) -> dict[str, int]:
    """The BTF type ids of the kernel functions `names` (those found) in the kernel's
    BTF. A walk of the type section (types have no index; ids are their order): about
    0.1 s, paid when a program is compiled, never on a cache hit."""
    try:
        data = path.read_bytes()
        magic, _, _, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", data, 0)
    except (OSError, struct.error):
        return {}
    if magic != 0xEB9F:
        return {}
    strings = data[hdr_len + str_off:hdr_len + str_off + str_len]
    wanted = {}
    for name in names:
        at = strings.find(b"\0" + name.encode() + b"\0")
        if at >= 0:
            wanted[at + 1] = name
    found: dict[str, int] = {}
    off, end, tid = hdr_len + type_off, hdr_len + type_off + type_len, 1
    while off + 12 <= end and len(found) < len(wanted):
        name_off, info, _ = struct.unpack_from("<III", data, off)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        if kind == _BTF_FUNC and name_off in wanted:
            found[wanted[name_off]] = tid
        off += 12 + _BTF_EXTRA.get(kind, 0) + _BTF_PER_MEMBER.get(kind, 0) * vlen
        tid += 1
    return found


_BTF_STRUCT, _BTF_UNION = 4, 5
_BTF_QUALIFIERS = {8, 9, 10, 11, 18}  # typedef, volatile, const, restrict, type tag


def kernel_member_offset(path: tuple[str, ...], btf: Path = VMLINUX_BTF) -> int | None:
    """offsetof(struct path[0], path[1].path[2]...) in this kernel, from its BTF (e.g.
    ("task_struct", "thread", "fsbase")), or None where the BTF or a member is missing.
    One walk of the type section (~0.2 s), paid only by the capture that needs it."""
    try:
        data = btf.read_bytes()
        magic, _, _, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", data, 0)
    except (OSError, struct.error):
        return None
    if magic != 0xEB9F or len(path) < 2:
        return None
    strings = data[hdr_len + str_off:hdr_len + str_off + str_len]

    def name_at(name: str) -> int:
        at = strings.find(b"\0" + name.encode() + b"\0")
        return at + 1 if at >= 0 else -1

    starts = [0]  # type id -> its offset in data (ids count from 1)
    off, end = hdr_len + type_off, hdr_len + type_off + type_len
    while off + 12 <= end:
        starts.append(off)
        info = struct.unpack_from("<I", data, off + 4)[0]
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        off += 12 + _BTF_EXTRA.get(kind, 0) + _BTF_PER_MEMBER.get(kind, 0) * vlen
    first = name_at(path[0])
    tid = None
    for i, at in enumerate(starts[1:], start=1):
        name_off, info = struct.unpack_from("<II", data, at)
        if name_off == first and (info >> 24) & 0x1F == _BTF_STRUCT:
            tid = i
            break
    total = 0
    for member in path[1:]:
        while tid is not None and 0 < tid < len(starts):  # through typedefs, qualifiers
            info = struct.unpack_from("<I", data, starts[tid] + 4)[0]
            if (info >> 24) & 0x1F not in _BTF_QUALIFIERS:
                break
            tid = struct.unpack_from("<I", data, starts[tid] + 8)[0]
        if tid is None or not 0 < tid < len(starts):
            return None
        at = starts[tid]
        info = struct.unpack_from("<I", data, at + 4)[0]
        if (info >> 24) & 0x1F not in (_BTF_STRUCT, _BTF_UNION):
            return None
        want, tid = name_at(member), None
        for k in range(info & 0xFFFF):
            name_off, mtype, moff = struct.unpack_from("<III", data, at + 12 + 12 * k)
            if name_off == want:
                total += (moff & 0xFFFFFF if info >> 31 else moff) // 8
                tid = mtype
                break
        if tid is None:
            return None
    return total


def iterator_kfuncs() -> dict[int, int]:
    """Placeholder helper number -> BTF id of the kernel function it stands for, for
    every function MT_LOOP's iterator needs; empty where this kernel lacks any of them
    (MT_LOOP is then built as bounded loops)."""
    if not iterators_possible():
        return {}
    ids = kfunc_ids([name for name, _ in ITERATOR_KFUNCS.values()])
    if len(ids) < len(ITERATOR_KFUNCS):
        return {}
    return {number: ids[name] for name, number in ITERATOR_KFUNCS.values()}


# -- the cache ----------------------------------------------------------------------------

def _file_id(path: str | Path) -> list[Any]:
    try:
        st = os.stat(path)
    except OSError:
        return [str(path), None]
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def _toolchain() -> list[Any]:
    """bcc's Python module and library, found without loading them (libbcc brings clang
    and LLVM along: loading it is most of what a cache hit saves)."""
    spec = importlib.util.find_spec("bcc")
    pkg = Path(spec.origin).parent if spec and spec.origin else None
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
    return [[_file_id(pkg / f) for f in ("__init__.py", "version.py")] if pkg else None,
            [_file_id(Path(d) / "libbcc.so.0") for d in dirs
             if (Path(d) / "libbcc.so.0").exists()]]


def cache_key(text: str, cflags: list[str], tracefs: Path = TRACEFS_EVENTS) -> str:
    """A digest of every input of bcc's output: the source and its flags, the kernel and
    the headers bcc compiles against, the tracepoint formats bcc reads for
    TRACEPOINT_PROBE arguments, and bcc itself (a newer clang or LLVM under the same
    bcc still compiled the same source correctly: not part of the key)."""
    u = os.uname()
    build = Path("/lib/modules") / u.release / "build"
    headers = [_file_id(build / p) for p in ("include/generated/autoconf.h",
                                              "include/generated/uapi/linux/version.h")]
    formats = []
    for category, event in sorted(set(_TRACEPOINT_RE.findall(text))):
        try:
            formats.append((tracefs / category / event / "format").read_text())
        except OSError:
            formats.append(None)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("BCC_"))
    material = json.dumps([CACHE_FORMAT, text, cflags, u.release, u.version, u.machine,
                           _file_id(build), headers, formats, env, _toolchain()])
    return hashlib.sha256(material.encode()).hexdigest()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memtrack" / "bpf"


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class ProgramCache:
    """Images by key, one file each, in a directory only this user can write; the
    `keep` most recently used ones stay (every change of source or options makes one)."""

    def __init__(self, directory: Path, keep: int = 64) -> None:
        self.dir = directory
        self.keep = keep

    def usable(self) -> str | None:
        """None, or why the directory cannot hold programs (created if missing)."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.lstat(self.dir)
        except OSError as e:
            return f"{self.dir}: {e.strerror}"
        if not stat.S_ISDIR(st.st_mode) or not _private(st):
            return f"{self.dir}: not a directory of this user's that only it can write"
        return None

    def get(self, key: str) -> Image | None:
        try:
            fd = os.open(self.dir / f"{key}.json", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not _private(os.fstat(f.fileno())):
                return None
            data = f.read()
            image = Image.from_json(data, key)
            if image is not None:
                os.utime(f.fileno())  # recently used: kept by put's pruning
        return image

    def put(self, key: str, image: Image) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(image.to_json(key))
            os.replace(tmp, self.dir / f"{key}.json")
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._prune()

    def _prune(self) -> None:
        entries = []
        for p in self.dir.glob("*.json"):
            try:
                entries.append((p.stat().st_mtime_ns, p))
            except OSError:
                continue
        for _, p in sorted(entries, reverse=True)[self.keep:]:
            try:
                p.unlink()
            except OSError:
                pass


# -- the loader ---------------------------------------------------------------------------

def _obj_name(name: str) -> bytes:
    return re.sub(r"[^A-Za-z0-9_.]", "_", name).encode()[:BPF_OBJ_NAME_LEN - 1]


def _create_map(spec: MapSpec, inner_fd: int = 0) -> int:
    attr = (ct.c_uint8 * 72)()
    struct.pack_into("<IIIIII", attr, 0, spec.type, spec.key_size, spec.value_size,
                     spec.max_entries, spec.flags, inner_fd)
    ct.memmove(ct.addressof(attr) + 28, _obj_name(spec.name), len(_obj_name(spec.name)))
    fd = bpf(BPF_MAP_CREATE, attr)
    if fd < 0:
        e = ct.get_errno()
        raise LoadError(f"cannot create BPF map {spec.name}: {os.strerror(e)}")
    return fd


MAP_THREADS = 4  # maps created at once


def _create_maps(specs: list[MapSpec]) -> list[int]:
    """Every map of `specs`, their fds in that order. Creating a map allocates (and
    zeroes) all of it: a preallocated hash map of 65536 entries or a ring of 16 MiB per
    CPU takes 2-130 ms here, and bcc's programs have a dozen of them. They are made
    side by side (the GIL is released in the syscall); a map of maps after the others,
    once the map its values are shaped like exists."""
    fds: list[int | None] = [None] * len(specs)
    by_name = {spec.name: i for i, spec in enumerate(specs)}
    errors: dict[int, LoadError] = {}
    lock = threading.Lock()

    def create(queue: list[int]) -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                i = queue.pop()
            spec = specs[i]
            inner = fds[by_name[spec.inner]] if spec.inner in by_name else 0
            try:
                fds[i] = _create_map(spec, inner or 0)
            except LoadError as e:
                with lock:
                    errors[i] = e

    try:
        for wave in ([i for i, s in enumerate(specs) if not s.inner],
                     [i for i, s in enumerate(specs) if s.inner]):
            queue = wave[::-1]
            threads = [threading.Thread(target=create, args=(queue,))
                       for _ in range(min(MAP_THREADS, len(wave)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[min(errors)]
    except BaseException:
        for fd in fds:
            if fd is not None:
                os.close(fd)
        raise
    return [fd for fd in fds if fd is not None]


@dataclass
class Function:
    """A loaded program: what bcc calls a Function (its `fd` is what users take)."""

    bpf: Any
    name: bytes
    fd: int


class Program:
    """A loaded Image: maps created, functions loaded on demand, tracepoint__*
    functions attached, tables as bcc offers them."""

    def __init__(self, image: Image) -> None:
        self.image = image
        self.funcs: dict[bytes, Function] = {}
        # (tracepoint, program) -> the attachment's perf event: several programs may
        # attach to one tracepoint (the stacks' and the lifecycle's sys_exit_mmap)
        self.tracepoint_fds: dict[tuple[bytes, bytes], int] = {}
        self.tables: dict[str, Table] = {}
        self._map_fds: list[int] = []
        try:
            self._map_fds = _create_maps(image.maps)
            for name in image.functions:
                if name.startswith("tracepoint__"):
                    tp = name[len("tracepoint__"):].replace("__", ":")
                    self.attach_tracepoint(tp=tp, fn_name=name)
        except BaseException:
            self.cleanup()
            raise

    def __getitem__(self, name: str | bytes) -> Table:
        key = name.decode() if isinstance(name, bytes) else name
        t = self.tables.get(key)
        if t is None:
            for i, spec in enumerate(self.image.maps):
                if spec.name == key:
                    try:
                        t = Table(spec.name, self._map_fds[i], spec.type, spec.max_entries,
                                  spec.flags, ctype_of(json.loads(spec.key_desc)),
                                  ctype_of(json.loads(spec.leaf_desc)))
                    except ValueError as e:
                        raise LoadError(str(e)) from None
                    self.tables[key] = t
                    break
            else:
                raise KeyError(name)
        return t

    def load_func(self, func_name: str | bytes, prog_type: int, device: Any = None,
                  attach_type: int = -1, prog_flags: int = 0) -> Function:
        """Load one function (once; a second call returns the first program).
        `prog_flags`: BPF_F_* load flags (BPF_F_SLEEPABLE = 16), beyond bcc's."""
        name = func_name.decode() if isinstance(func_name, bytes) else func_name
        bname = name.encode()
        if bname in self.funcs:
            return self.funcs[bname]
        code = self.image.functions.get(name)
        if code is None:
            raise LoadError(f"unknown BPF program {name}")
        insns = bytearray(code)
        for at, m in self.image.relocations.get(name, []):
            struct.pack_into("<i", insns, at * 8 + 4, self._map_fds[m])
        fd = self._prog_load(name, prog_type, bytes(insns), attach_type, prog_flags, log=False)
        if fd < 0:
            fd = self._prog_load(name, prog_type, bytes(insns), attach_type, prog_flags,
                                 log=True)
        fn = Function(self, bname, fd)
        self.funcs[bname] = fn
        return fn

    def _prog_load(self, name: str, prog_type: int, insns: bytes, attach_type: int,
                   prog_flags: int, log: bool) -> int:
        buf = ct.create_string_buffer(insns, len(insns))
        lic = ct.create_string_buffer(self.image.license.encode())
        logbuf = ct.create_string_buffer(LOG_SIZE if log else 1)
        attr = (ct.c_uint8 * 128)()
        struct.pack_into("<IIQQIIQII", attr, 0, prog_type, len(insns) // 8,
                         ct.addressof(buf), ct.addressof(lic), 1 if log else 0,
                         LOG_SIZE if log else 0, ct.addressof(logbuf) if log else 0,
                         self.image.kern_version, prog_flags)
        short = name[len("tracepoint__"):] if name.startswith("tracepoint__") else name
        pname = _obj_name(short)
        ct.memmove(ct.addressof(attr) + 48, pname, len(pname))
        struct.pack_into("<I", attr, 68, max(attach_type, 0))
        fd = bpf(BPF_PROG_LOAD, attr)
        for _ in range(LOAD_ATTEMPTS - 1):
            # the verifier gives up with EAGAIN when a signal is pending (a child's
            # SIGCHLD while the loading thread verifies): as libbpf, load again
            if fd >= 0 or ct.get_errno() != errno.EAGAIN:
                break
            fd = bpf(BPF_PROG_LOAD, attr)
        if fd < 0 and log:
            e = ct.get_errno()
            if e == errno.EPERM:
                raise LoadError("loading BPF programs needs root (CAP_BPF and CAP_PERFMON)")
            tail = logbuf.value.decode(errors="replace").strip().splitlines()[-3:]
            raise LoadError(f"Failed to load BPF program {name}: {os.strerror(e)}"
                            + (f" ({' / '.join(tail)})" if tail else ""))
        return fd

    def attach_tracepoint(self, tp: str | bytes = b"", fn_name: str | bytes = b"") -> None:
        """As bcc's: attach function `fn_name` to tracepoint "category:event"."""
        tpb = tp.encode() if isinstance(tp, str) else tp
        fn = self.load_func(fn_name, PROG_TRACEPOINT)
        category, _, event = tpb.decode().partition(":")
        try:
            fd = attach_tracepoint(fn.fd, category, event)
        except OSError as e:
            raise LoadError(f"Failed to attach BPF program {fn.name.decode()} to tracepoint "
                            f"{tpb.decode()} ({e.strerror})") from None
        self.tracepoint_fds[tpb, fn.name] = fd

    def detach_tracepoint(self, tp: str | bytes = b"") -> None:
        """Detach every program attached to tracepoint "category:event"."""
        tpb = tp.encode() if isinstance(tp, str) else tp
        keys = [key for key in self.tracepoint_fds if key[0] == tpb]
        if not keys:
            raise LoadError(f"tracepoint {tpb.decode()} is not attached")
        for key in keys:
            detach_tracepoint(self.tracepoint_fds.pop(key))

    def run_stats(self) -> dict[str, dict[str, int]]:
        """Per loaded program that ran, its own run time and runs ({"run_ns", "runs"}),
        as the kernel counts them while kernel.bpf_stats_enabled is on (else nothing)."""
        out = {}
        # a copy taken at once: the allocator programs may still be loading on their
        # thread (links.UprobeLinks) and join the dict meanwhile
        for name, fn in list(self.funcs.items()):
            try:
                info = prog_info(fn.fd)
            except OSError:
                continue
            if info.get("run_cnt"):
                out[name.decode()] = {"run_ns": info.get("run_time_ns", 0),
                                      "runs": info["run_cnt"]}
        return out

    def cleanup(self) -> None:
        """Detach the tracepoints, close every program and map."""
        for key in list(self.tracepoint_fds):
            detach_tracepoint(self.tracepoint_fds.pop(key))
        for fn in self.funcs.values():
            os.close(fn.fd)
        self.funcs.clear()
        for fd in self._map_fds:
            os.close(fd)
        self._map_fds = []
        self.tables.clear()


def prog_info(fd: int) -> dict[str, int]:
    """The integer fields of a loaded BPF program's fdinfo (run_time_ns, run_cnt,
    verified_insns, ...)."""
    out = {}
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        k, _, v = line.partition(":")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def test_run(prog_fd: int, args: list[int]) -> int:
    """Run a loaded raw tracepoint program once, now, on this thread
    (BPF_PROG_TEST_RUN, Linux 5.10+) with `args` as its context's arguments; returns
    what the program returned. OSError when the kernel refuses."""
    if len(args) > MAX_RUN_ARGS:
        raise ValueError(f"at most {MAX_RUN_ARGS} arguments, not {len(args)}")
    ctx = (ct.c_uint64 * max(len(args), 1))(*args)
    attr = (ct.c_uint8 * 80)()  # union bpf_attr's `test` member
    struct.pack_into("<I", attr, 0, prog_fd)
    struct.pack_into("<I", attr, 40, 8 * len(args))  # ctx_size_in
    struct.pack_into("<Q", attr, 48, ct.addressof(ctx))  # ctx_in
    if bpf(BPF_PROG_TEST_RUN, attr) < 0:
        e = ct.get_errno()
        raise OSError(e, f"BPF_PROG_TEST_RUN: {os.strerror(e)}")
    return int(struct.unpack_from("<I", attr, 4)[0])  # retval


class SlowNote:
    """A context that writes "memtrack: <what>..." to `stream` if it is still running
    after SLOW_S seconds; `what` may change on the way."""

    def __init__(self, stream: TextIO | None, what: str) -> None:
        self.stream = stream
        self.what = what
        self._timer: threading.Timer | None = None

    def _say(self) -> None:
        assert self.stream is not None
        self.stream.write(f"memtrack: {self.what}...\n")
        self.stream.flush()

    def __enter__(self) -> SlowNote:
        if self.stream is not None:
            self._timer = threading.Timer(SLOW_S, self._say)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()


def load_program(text: str, cflags: list[str], cache: ProgramCache | None, *,
                 note: SlowNote | None = None) -> Program:
    """The program for `text` and `cflags`: from the cache when it holds it, else
    compiled by bcc (and cached; `note` then says so if it takes a while)."""
    image = None
    key = ""
    iterators = iterators_possible()
    if cache is not None:
        key = cache_key(text, cflags + iterator_cflags() if iterators else cflags)
        image = cache.get(key)
    if image is None:
        if note is not None:
            note.what = "compiling the BPF programs" + (
                "; later runs load them from the cache" if cache is not None else "")
        kfuncs = iterator_kfuncs()
        image = compile_image(text, cflags + iterator_cflags() if kfuncs else cflags, kfuncs)
        if cache is not None:
            try:
                cache.put(key, image)
            except OSError:
                pass  # a full disk costs the next run a compile, nothing else
    return Program(image)
