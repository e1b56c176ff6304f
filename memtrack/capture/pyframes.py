"""Python frames: the CapturePart that adds bpf/pyframes.h and drains its record ring.

At each attach stop (exec, a new executable mapping) `on_stop` looks for a CPython
interpreter among the process's executable mappings: a module whose dynamic symbols
define `_PyRuntime` (Debian's stripped /usr/bin/python3 exports it, as does a
libpython). Its version is the `Py_Version` constant read from the file (3.11+), never
from code run in the traced process; 3.10 has no `Py_Version` but is the one version
that defines `Py_Is` (new in 3.10) without it; a free-threaded build (3.13t) says so in
the `_Py_DebugOffsets` that open `_PyRuntime` (3.13+). A version in OFFSETS, built with
the GIL, gets an entry in the kernel's mt_py_procs (the runtime's address and that
version's struct offsets), and from then on every allocation of the process folds its
thread's Python frames into its stack hash; any other version or build is one warning
naming it and the file, and its stacks keep their native frames only.

The ring carries two kinds of records (bpf/pyframes.h): Python stack records (a chain
of code keys and instruction indexes, and the native stack hash it extends) and code
records (a code object's qualified name, file name, first line, line table and the
interpreter's version, read by the BPF program when the code key is new). They become
py_stacks.arrow and py_codes.arrow; `process` names and merges the frames
(memtrack.process.pyframes).
"""

from __future__ import annotations

import ctypes as ct
import functools
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.capture.options import CaptureOptions
from memtrack.capture.parts import RING_PYFRAMES, Ring
from memtrack.capture.procfs import MapLine, mapped_file
from memtrack.capture.tables import percpu_counts
from memtrack.schema import PY_CODES, PY_STACKS
from memtrack.schema.artifact import ArtifactWriter

RING = "mt_py_ring"
PROCS = "mt_py_procs"
DEPTH = 128  # bpf/pyframes.h MT_PY_DEPTH
OUT_WORDS = 8 + (2 * (256 + 512) + 8192) // 8  # MT_PY_OUT_WORDS: the largest record
REC_STACK, REC_CODE = 1, 2
# mt_py_stats indexes of bpf/pyframes.h -> counter names.
KERNEL_STATS = (
    "python_captures",
    "python_stacks",
    "python_stack_records",
    "python_code_records",
    "pyframes_ring_full",
    "python_frames_cut",
    "python_no_thread",
    "python_read_failed",
)
KERNEL_LOSSES = ("pyframes_ring_full", "python_frames_cut")
TRACEFS = Path("/sys/kernel/tracing/events")
DEBUG_COOKIE = b"xdebugpy"  # _Py_Debug_Cookie

# Offsets per CPython version (major, minor), in the order of bpf/pyframes.h's struct
# mt_py_proc, each `offsetof` of that version's headers (Include/internal: compile a
# file defining Py_BUILD_CORE that prints them; tests/test_pyframes.py does so against
# the installed python3.11-dev headers, and pyenv's 3.10, 3.12 and 3.13 where present,
# and compares; 3.13's also against the _Py_DebugOffsets its libpython holds). 3.10's
# names differ (in parentheses): its frames are PyFrameObjects, each run by its own
# evaluation call, with the instruction's index (f_lasti) rather than a pointer to it.
FIELDS = (
    "tstate_current",  # _PyRuntimeState.gilstate.tstate_current
    "interp_head",  # _PyRuntimeState.interpreters.head
    "threads_head",  # PyInterpreterState.threads.head (3.10: tstate_head)
    "ts_next",  # PyThreadState.next
    "ts_native_tid",  # PyThreadState.native_thread_id (3.10: thread_id, pthread_self())
    "ts_cframe",  # PyThreadState.cframe
    "cf_current",  # _PyCFrame.current_frame (3.10: PyThreadState.frame)
    "f_code",  # _PyInterpreterFrame.f_code (3.10: PyFrameObject.f_code)
    "f_previous",  # _PyInterpreterFrame.previous (3.10: f_back)
    "f_prev_instr",  # _PyInterpreterFrame.prev_instr (3.10: f_lasti)
    "f_is_entry",  # _PyInterpreterFrame.is_entry
    "co_span",  # where the 88 immutable bytes hashed begin (co_firstlineno..co_linetable):
    #             offsetof(PyCodeObject, co_linetable) + 8 - 80 (3.10: co_firstlineno)
    "co_firstlineno",  # PyCodeObject.co_firstlineno
    "co_filename",  # PyCodeObject.co_filename
    "co_qualname",  # PyCodeObject.co_qualname (3.10: co_name)
    "co_linetable",  # PyCodeObject.co_linetable
    "co_code",  # PyCodeObject.co_code_adaptive
    "str_length",  # PyASCIIObject.length
    "str_state",  # PyASCIIObject.state
    "str_ascii_data",  # sizeof(PyASCIIObject)
    "str_compact_data",  # sizeof(PyCompactUnicodeObject)
    "bytes_size",  # PyVarObject.ob_size
    "bytes_data",  # PyBytesObject.ob_sval
    "f_owner",  # _PyInterpreterFrame.owner
    "shim",  # 1: runs end above shim frames (3.12, 3.13), 0: at is_entry frames (3.11)
    "cframe",  # 1: the frame is tstate->cframe->current_frame, 0: tstate->current_frame
    "f_read",  # bytes of a frame read: offsetof(_PyInterpreterFrame, localsplus) (3.10:
    #            to f_lasti's end, rounded up to 8)
    "instr_index",  # 1: f_prev_instr is an int, the instruction's index (3.10); 0: a pointer
    "each_entry",  # 1: every frame was entered from C, its own evaluation call (3.10)
)
OFFSETS: dict[tuple[int, int], tuple[int, ...]] = {
    # 3.10: no _PyCFrame holds the frame (cframe 0: PyThreadState.frame); its thread
    # state has no native_thread_id: thread_id is pthread_self(), matched against the
    # calling thread's FS base (PyProc.task_fsbase)
    (3, 10): (568, 32, 8, 8, 176, 0, 24, 32, 24, 96, 0, 40, 40, 104, 112, 120, 0,
              16, 32, 48, 72, 16, 32, 0, 0, 0, 104, 1, 1),
    (3, 11): (576, 40, 16, 8, 160, 56, 8, 32, 48, 56, 68, 64, 72, 112, 128, 136, 184,
              16, 32, 48, 72, 16, 32, 69, 0, 1, 72, 0, 0),
    # 3.12: the current thread state is a thread-local (0: search the thread list), no
    # is_entry (0: unused)
    (3, 12): (0, 40, 72, 8, 144, 56, 0, 0, 8, 56, 0, 64, 68, 112, 128, 136, 192,
              16, 32, 40, 56, 16, 32, 70, 1, 1, 72, 0, 0),
    # 3.13: as 3.12, and no _PyCFrame: PyThreadState.current_frame is cf_current (ts_cframe
    # unused); f_code is f_executable, f_prev_instr is instr_ptr
    (3, 13): (0, 632, 7344, 8, 160, 0, 72, 0, 8, 56, 0, 64, 68, 112, 128, 136, 200,
              16, 32, 40, 56, 16, 32, 70, 1, 0, 72, 0, 0),
}


class PyProc(ct.Structure):
    """bpf/pyframes.h struct mt_py_proc: the runtime's address, the version's OFFSETS,
    then task_fsbase (3.10: where the kernel keeps a thread's FS base, pthread_self() on
    x86_64, in its task_struct; 0: threads are matched by native_thread_id) and the
    version (major << 8 | minor, for the code records: it says the line table's format)."""

    _fields_ = [("runtime", ct.c_uint64), *((f, ct.c_uint32) for f in FIELDS),
                ("task_fsbase", ct.c_uint32), ("version", ct.c_uint32)]


@functools.cache
def task_fsbase() -> int | None:
    """offsetof(struct task_struct, thread.fsbase) in this kernel (its BTF), where
    pthread_self() is the FS base (x86_64: glibc's and musl's thread pointer is the
    struct pthread itself); None elsewhere."""
    if platform.machine() != "x86_64":
        return None
    from memtrack.capture.program import kernel_member_offset

    return kernel_member_offset(("task_struct", "thread", "fsbase"))


@dataclass(frozen=True)
class Interpreter:
    """A CPython module: where its _PyRuntime lies (ELF vaddr) and its version."""

    path: str
    runtime_vaddr: int
    first_load: int  # the first PT_LOAD's vaddr, page-aligned (where offset 0 maps)
    version: tuple[int, ...] | None  # (3, 10): no micro (no Py_Version); None: before 3.10
    free_threaded: bool = False  # a --disable-gil build (3.13t): other layouts

    @property
    def supported(self) -> bool:
        return (self.version is not None and self.version[:2] in OFFSETS
                and not self.free_threaded)

    def describe(self) -> str:
        v = ".".join(map(str, self.version)) if self.version else "before 3.10"
        return f"CPython {v}{' free-threaded' if self.free_threaded else ''} ({self.path})"


def find_interpreter(path: str) -> Interpreter | None:
    """The CPython interpreter a module file is, or None (not one, or unreadable)."""
    from memtrack.elf.image import ElfImage, ElfReadError
    from memtrack.elf.symtab import STT_FUNC, STT_NOTYPE, STT_OBJECT, defined_symbols

    try:
        with ElfImage(path) as img:
            found = defined_symbols(img, {"_PyRuntime", "Py_Version", "Py_Is"},
                                    (STT_OBJECT, STT_NOTYPE, STT_FUNC), sections=(".dynsym",))
            if "_PyRuntime" not in found:  # not an interpreter (an extension imports it)
                return None
            runtime = found["_PyRuntime"][0]
            version = None
            if "Py_Version" in found:
                raw = img.code(found["Py_Version"][0], 4)
                if len(raw) == 4:
                    hexv = int.from_bytes(raw, "little")
                    version = (hexv >> 24, (hexv >> 16) & 0xFF, (hexv >> 8) & 0xFF)
            elif "Py_Is" in found:  # the stable ABI's Py_Is came in 3.10, Py_Version in 3.11
                version = (3, 10)
            # 3.13+: _PyRuntime opens with _Py_DebugOffsets: cookie, version, free_threaded
            head = img.code(runtime, 24)
            free = head[:8] == DEBUG_COOKIE and int.from_bytes(head[16:24], "little") != 0
            seg = img.segments
            first = int(seg.vaddr[0]) & ~0xFFF if len(seg.vaddr) else 0
    except (ElfReadError, OSError, ValueError, KeyError):
        return None
    return Interpreter(path, runtime, first, version, free)


def fork_child_offset(tracefs: Path = TRACEFS) -> int:
    """child_pid's offset in sched_process_fork's record, from its tracefs format (it
    moved when the comm fields became dynamic strings)."""
    try:
        text = (tracefs / "sched" / "sched_process_fork" / "format").read_text()
    except OSError:
        return 20
    for line in text.splitlines():
        if "child_pid;" in line:
            for part in line.split(";"):
                if part.strip().startswith("offset:"):
                    return int(part.split(":")[1])
    return 20


def _decode(raw: bytes, kind: int) -> str:
    codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}.get(kind)
    if codec is None:
        return ""
    n = len(raw) - len(raw) % kind
    return raw[:n].decode(codec, errors="replace")


@dataclass
class PyBatches:
    stacks: pa.RecordBatch
    codes: pa.RecordBatch
    malformed: int


def records_to_batches(records: Iterable[bytes | memoryview]) -> PyBatches:
    """Ring records as PY_STACKS and PY_CODES batches. One Python step per record: they
    are one per distinct Python chain or code object, not per allocation."""
    st: dict[str, list[Any]] = {k: [] for k in PY_STACKS.names}
    co: dict[str, list[Any]] = {k: [] for k in PY_CODES.names}
    bad = 0
    for rec in records:
        b = bytes(rec)
        if len(b) < 32 or len(b) % 8:
            bad += 1
            continue
        w = np.frombuffer(b, dtype="<u8")
        kind = int(w[0]) & 0xFF
        pid, tid = int(w[2]) & 0xFFFFFFFF, int(w[2]) >> 32
        if kind == REC_STACK:
            n = (int(w[0]) >> 8) & 0xFFFF
            if n == 0 or n > DEPTH or len(w) != 4 + 2 * n:
                bad += 1
                continue
            fr = w[4:].reshape(n, 2)
            st["hash"].append(int(w[1]))
            st["native_hash"].append(int(w[3]))
            st["pid"].append(pid)
            st["tid"].append(tid)
            st["cut"].append(bool((int(w[0]) >> 24) & 1))
            st["code_key"].append(fr[:, 0].tolist())
            st["instr"].append((fr[:, 1] & np.uint64(0xFFFFFFFF)).astype(np.uint32).tolist())
            st["entry"].append(((fr[:, 1] >> np.uint64(32)) & np.uint64(1)).astype(bool).tolist())
        elif kind == REC_CODE and len(w) >= 8:
            w5, lt = int(w[5]), int(w[6])
            qlen, qkind = w5 & 0xFFFF, (w5 >> 16) & 7
            flen, fkind = (w5 >> 32) & 0xFFFF, (w5 >> 48) & 7
            qpad, fpad = (qlen + 7) & ~7, (flen + 7) & ~7
            data = b[64:]
            if qpad + fpad + lt > len(data):
                bad += 1
                continue
            co["key"].append(int(w[1]))
            co["pid"].append(pid)
            co["address"].append(int(w[3]))
            co["first_line"].append(int(w[4]) & 0xFFFFFFFF)
            co["qualname"].append(_decode(data[:qlen], qkind))
            co["filename"].append(_decode(data[qpad:qpad + flen], fkind))
            co["linetable"].append(data[qpad + fpad:qpad + fpad + lt])
            co["linetable_size"].append(int(w[4]) >> 32)
            co["python_version"].append(int(w[7]) & 0xFFFF)
        else:
            bad += 1
    return PyBatches(pa.RecordBatch.from_pydict(st, schema=PY_STACKS),
                     pa.RecordBatch.from_pydict(co, schema=PY_CODES), bad)


class PyFramesPart:
    """CapturePart for Python frames (pyframes.h); needs the stacks part before it."""

    name = "pyframes"

    def __init__(self, options: CaptureOptions, *, seen_entries: int = 65536,
                 code_entries: int = 65536, ring_pages: int = 1024) -> None:
        self.cut = options.python_stacks == "python"
        self.ring_pages = ring_pages
        self.seen_entries = seen_entries
        self.code_entries = code_entries
        self.malformed = 0
        # (dev, inode, mtime) of the mapped file -> what it is
        self.interpreters: dict[tuple[str, int, int], Interpreter | None] = {}
        self._reader: Any = None

    def sources(self) -> list[str]:
        return ["pyframes.h"]

    def cflags(self) -> list[str]:
        return ["-DMT_PYFRAMES", f"-DMT_PY_CUT={int(self.cut)}",
                f"-DMT_PY_RING_PAGES={self.ring_pages}",
                f"-DMT_PY_SEEN={self.seen_entries}", f"-DMT_PY_CODES={self.code_entries}",
                f"-DMT_PY_FORK_CHILD={fork_child_offset()}"]

    def attach(self, bpf: Any) -> list[str]:
        try:
            bpf.attach_tracepoint(tp="sched:sched_process_fork", fn_name="mt_py_fork")
        except Exception as e:  # noqa: BLE001 - bcc raises bare Exception
            return [f"python frames: cannot attach mt_py_fork to sched:sched_process_fork "
                    f"({e}); fork children that do not exec have native frames only"]
        return []

    def _interpreter(self, pid: int, m: MapLine) -> Interpreter | None:
        """The interpreter `pid` maps with `m`, read through /proc/PID/map_files (the
        mapped file itself: a container's python is not the host's file of its path;
        procfs.mapped_file)."""
        src = mapped_file(pid, m)
        if src is None:
            return None
        key = (m.dev, m.inode, _mtime(src))
        if key not in self.interpreters:
            found = find_interpreter(src)
            self.interpreters[key] = found and replace(found, path=m.path)
        return self.interpreters[key]

    def on_stop(self, bpf: Any, pid: int, maps: list[MapLine]) -> list[str]:
        """At an attach stop: point the kernel at this process's interpreter (or forget
        it: an exec may have replaced it). Returns a warning for a version it does not
        know, once per interpreter file."""
        starts: dict[str, int] = {}
        for m in maps:
            if m.offset == 0 and m.path.startswith("/"):
                starts.setdefault(m.path, m.start)
        found, start = None, 0
        for m in maps:
            if "x" in m.perms and m.path in starts:
                interp = self._interpreter(pid, m)
                if interp is not None:
                    found, start = interp, starts[m.path]
                    break
        table = bpf[PROCS]
        fsbase = task_fsbase() if found is not None and found.version == (3, 10) else 0
        if found is None or not found.supported or fsbase is None:
            try:
                del table[ct.c_uint32(pid)]
            except KeyError:
                pass
            if found is None:
                return []
            if fsbase is None:
                return [f"python frames: {found.describe()} keeps pthread_self() as its "
                        "threads' identity, which memtrack reads from the kernel's BTF "
                        "(task_struct.thread.fsbase) on x86_64 only; not found here, its "
                        "stacks have native frames only"]
            return [f"python frames: {found.describe()} is not a build memtrack knows "
                    f"(known: {', '.join(f'{a}.{b}' for a, b in OFFSETS)}, with the GIL); its "
                    "stacks have native frames only"]
        assert found.version is not None
        major, minor = found.version[:2]
        proc = PyProc(start - found.first_load + found.runtime_vaddr,
                      *OFFSETS[(major, minor)], fsbase, major << 8 | minor)
        table[ct.c_uint32(pid)] = proc
        return []

    def rings(self) -> list[Ring]:
        return [Ring(RING, RING_PYFRAMES, None, OUT_WORDS * 8)]

    def write(self, bpf: Any, writer: ArtifactWriter, ring: Ring, records: Any) -> int:
        if not records:
            return 0
        out = records_to_batches(records)
        self.malformed += out.malformed
        if out.codes.num_rows:
            writer.write("py_codes", out.codes)
        if out.stacks.num_rows:
            writer.write("py_stacks", out.stacks)
        return out.stacks.num_rows + out.codes.num_rows

    def drain(self, bpf: Any, writer: ArtifactWriter) -> int:
        if self._reader is None:
            from memtrack.capture.ringbuf import RingReader

            self._reader = RingReader(bpf, RING)
        return self.write(bpf, writer, self.rings()[0], self._reader.read_records())

    def kernel_stats(self, bpf: Any) -> dict[str, int]:
        return percpu_counts(bpf["mt_py_stats"], KERNEL_STATS)

    def losses(self, bpf: Any) -> dict[str, int]:
        stats = self.kernel_stats(bpf)
        out = {k: stats[k] for k in KERNEL_LOSSES}
        out["pyframes_records_malformed"] = self.malformed
        return out

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0
