"""Tables over the BPF maps of a loaded program, and tracepoint attach, without libbcc.

Loading bcc's Python module loads libbcc and, through it, clang and LLVM (90 ms here,
more on a busy machine): a capture whose program comes from the cache needs none of
that. These classes offer what capture uses of bcc's table API, with bcc's meaning:
`Key`/`Leaf` ctypes types, `t[key]` (KeyError when missing; arrays take ints),
assignment, `del` (KeyError when missing; arrays zero the slot), iteration over keys,
`keys()/values()/items()`, `len()`, `clear()`, `map_fd`, `max_entries`; a per-CPU
array's value is one Leaf per possible CPU (`sum(t[k])`).

Key and leaf types come from bcc's JSON description of the C types, kept in the
program's cache entry (memtrack.capture.program.MapSpec).
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from memtrack.capture.syscalls import bpf, libc, perf_event_open

BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY = 1, 2, 3, 4
MAP_HASH, MAP_ARRAY, MAP_PERCPU_ARRAY, MAP_LRU_HASH, MAP_RINGBUF = 1, 2, 6, 9, 27
ARRAYS = (MAP_ARRAY, MAP_PERCPU_ARRAY)
PERF_TYPE_TRACEPOINT = 2
PERF_ATTR_SIZE_VER5 = 112
PERF_FLAG_FD_CLOEXEC = 8
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_DISABLE = 0x2401
PERF_EVENT_IOC_SET_BPF = 0x40042408
TRACEFS_EVENTS = Path("/sys/kernel/tracing/events")


# bcc's names of C scalar types in its descriptions -> ctypes
_SCALARS: dict[str, Any] = {
    "_Bool": ct.c_bool, "char": ct.c_char, "signed char": ct.c_byte,
    "unsigned char": ct.c_ubyte, "short": ct.c_short, "unsigned short": ct.c_ushort,
    "int": ct.c_int, "unsigned int": ct.c_uint, "long": ct.c_long,
    "unsigned long": ct.c_ulong, "long long": ct.c_longlong,
    "unsigned long long": ct.c_ulonglong, "float": ct.c_float, "double": ct.c_double,
    "__int128": ct.c_int64 * 2, "unsigned __int128": ct.c_uint64 * 2,
}


def ctype_of(desc: Any) -> Any:
    """The ctypes type of a bcc type description: a scalar's name, or
    [name, [[field, type] | [field, type, [n]] | [field, type, bits] | nested], kind]
    with kind "struct", "struct_packed" or "union"."""
    if isinstance(desc, str):
        try:
            return _SCALARS[desc]
        except KeyError:
            raise ValueError(f"BPF map type {desc!r} is not one memtrack decodes") from None
    name, members = desc[0], desc[1]
    kind = desc[2] if len(desc) > 2 else "struct"
    fields: list[tuple[Any, ...]] = []
    anonymous: list[str] = []
    for m in members:
        if len(m) == 3 and isinstance(m[2], str):  # a nested struct or union
            field = m[0] or f"__anon{len(anonymous)}"
            if not m[0]:
                anonymous.append(field)
            fields.append((field, ctype_of(m)))
        elif len(m) == 3 and isinstance(m[2], list):  # an array
            fields.append((m[0], ctype_of(m[1]) * m[2][0]))
        elif len(m) == 3:  # a bit field
            fields.append((m[0], ctype_of(m[1]), int(m[2])))
        else:
            fields.append((m[0], ctype_of(m[1])))
    base = ct.Union if kind == "union" else ct.Structure
    body: dict[str, Any] = {"_anonymous_": anonymous, "_fields_": fields}
    if kind == "struct_packed":
        body["_pack_"] = 1
    return type(str(name), (base,), body)


def possible_cpus() -> int:
    """How many CPUs the kernel may bring up: per-CPU maps hold a value for each."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def _map_op(cmd: int, fd: int, key: Any, value: Any = None, flags: int = 0) -> int:
    attr = (ct.c_uint64 * 4)(fd, ct.addressof(key) if key is not None else 0,
                             ct.addressof(value) if value is not None else 0, flags)
    if bpf(cmd, attr) < 0:
        return ct.get_errno()
    return 0


class Table(MutableMapping[Any, Any]):
    """One BPF map of a loaded program."""

    def __init__(self, name: str, map_fd: int, map_type: int, max_entries: int, flags: int,
                 key: Any, leaf: Any) -> None:
        self.name = name
        self.map_fd = map_fd
        self.ttype = map_type
        self.max_entries = max_entries
        self.flags = flags
        self.Key = key
        self.Leaf = leaf
        if map_type == MAP_PERCPU_ARRAY:
            if ct.sizeof(leaf) % 8:
                raise ValueError(f"BPF map {name}: per-CPU values must be 8-byte multiples")
            self.sLeaf = leaf
            self.Leaf = leaf * possible_cpus()

    def get_fd(self) -> int:
        return self.map_fd

    def _key(self, key: Any) -> Any:
        if isinstance(key, int) and self.ttype in ARRAYS:
            if not 0 <= key < self.max_entries:
                raise IndexError(f"{self.name}: index {key} out of range")
            return self.Key(key)
        if not isinstance(key, ct._SimpleCData | ct.Structure | ct.Union | ct.Array):
            raise TypeError(f"{self.name}: a key is a ctypes value, not {type(key).__name__}")
        return key

    def __getitem__(self, key: Any) -> Any:
        k = self._key(key)
        leaf = self.Leaf()
        if _map_op(BPF_MAP_LOOKUP_ELEM, self.map_fd, k, leaf):
            raise KeyError(key)
        return leaf

    def __setitem__(self, key: Any, leaf: Any) -> None:
        e = _map_op(BPF_MAP_UPDATE_ELEM, self.map_fd, self._key(key), leaf)
        if e:
            raise OSError(e, f"cannot update BPF map {self.name}: {os.strerror(e)}")

    def __delitem__(self, key: Any) -> None:
        if self.ttype in ARRAYS:  # array slots always exist: zero it, as bcc does
            self[key] = self.Leaf()
            return
        if _map_op(BPF_MAP_DELETE_ELEM, self.map_fd, self._key(key)):
            raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        if self.ttype in ARRAYS:
            yield from (self.Key(i) for i in range(self.max_entries))
            return
        key = None
        while True:
            nxt = self.Key()
            if _map_op(BPF_MAP_GET_NEXT_KEY, self.map_fd, key, nxt):
                return
            yield nxt
            key = nxt

    def __len__(self) -> int:
        return self.max_entries if self.ttype in ARRAYS else sum(1 for _ in self)

    def clear(self) -> None:
        for k in list(self):
            try:
                del self[k]
            except KeyError:  # gone meanwhile (the program deletes too)
                pass


def percpu_counts(table: Any, names: Sequence[str]) -> dict[str, int]:
    """A per-CPU array of counters (index i counts names[i]), each summed over CPUs."""
    return {name: int(sum(table[ct.c_int(i)])) for i, name in enumerate(names)}


def attach_tracepoint(prog_fd: int, category: str, event: str,
                      tracefs: Path = TRACEFS_EVENTS) -> int:
    """A perf event on tracepoint category:event running `prog_fd`; returns its fd."""
    try:
        tp_id = int((tracefs / category / event / "id").read_text())
    except (OSError, ValueError) as e:
        raise OSError(errno.ENOENT, f"no tracepoint {category}:{event} ({e})") from None
    attr = (ct.c_uint8 * 128)()
    fields = ((0, PERF_TYPE_TRACEPOINT, ct.c_uint32), (4, PERF_ATTR_SIZE_VER5, ct.c_uint32),
              (8, tp_id, ct.c_uint64), (16, 1, ct.c_uint64), (48, 1, ct.c_uint32))
    for off, value, ctype in fields:  # config = id, sample_period, wakeup_events
        v = ctype(value)
        ct.memmove(ct.addressof(attr) + off, ct.byref(v), ct.sizeof(v))
    fd = perf_event_open(attr, -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, f"tracepoint {category}:{event}: {os.strerror(e)}")
    for req, arg in ((PERF_EVENT_IOC_SET_BPF, prog_fd), (PERF_EVENT_IOC_ENABLE, 0)):
        if libc.ioctl(fd, req, arg) < 0:
            e = ct.get_errno()
            os.close(fd)
            raise OSError(e, f"tracepoint {category}:{event}: {os.strerror(e)}")
    return fd


def detach_tracepoint(fd: int) -> None:
    libc.ioctl(fd, PERF_EVENT_IOC_DISABLE, 0)
    os.close(fd)
