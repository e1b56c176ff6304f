"""Python frames (issues 15, 31): CPython 3.10's to 3.13's frames in allocation
stacks, merged with the native ones, through the command line on fixtures/python/frames.py
(functions calling functions, a generator, a method, a lambda, an __init__, code compiled
from a string, a thread, the json C extension, sorted's key function), the same at every
site on each version; the offset table against each version's headers (and 3.13's against
the offsets its runtime publishes); the line-table decoders against each version's own
co_positions() (3.10: co_lines()); versions and builds memtrack does not know: one
warning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from memtrack.capture.pyframes import DEBUG_COOKIE, FIELDS, OFFSETS, find_interpreter
from memtrack.elf.image import ElfImage
from memtrack.process.pyframes import line_ranges, trampolines
from memtrack.schema.artifact import Artifact

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "fixtures" / "python" / "frames.py"
MEMTRACK = [sys.executable, "-m", "memtrack.cli"]
PYTHON = "/usr/bin/python3"
N = 300_000

# offsetof expressions of FIELDS, in order, per version
EXPRS_310 = (
    "offsetof(_PyRuntimeState, gilstate.tstate_current)",
    "offsetof(_PyRuntimeState, interpreters.head)",
    "offsetof(PyInterpreterState, tstate_head)",
    "offsetof(PyThreadState, next)", "offsetof(PyThreadState, thread_id)", "0",
    "offsetof(PyThreadState, frame)",
    "offsetof(PyFrameObject, f_code)", "offsetof(PyFrameObject, f_back)",
    "offsetof(PyFrameObject, f_lasti)", "0",
    "offsetof(PyCodeObject, co_firstlineno)", "offsetof(PyCodeObject, co_firstlineno)",
    "offsetof(PyCodeObject, co_filename)", "offsetof(PyCodeObject, co_name)",
    "offsetof(PyCodeObject, co_linetable)", "0",
    "offsetof(PyASCIIObject, length)", "offsetof(PyASCIIObject, state)",
    "sizeof(PyASCIIObject)", "sizeof(PyCompactUnicodeObject)",
    "offsetof(PyVarObject, ob_size)", "offsetof(PyBytesObject, ob_sval)",
    "0", "0", "0",
    "(offsetof(PyFrameObject, f_lasti) + sizeof(int) + 7) / 8 * 8", "1", "1",
)


def exprs(version: tuple[int, int]) -> tuple[str, ...]:
    if version == (3, 10):
        return EXPRS_310
    v311, cframe = version == (3, 11), version < (3, 13)
    return (
        "offsetof(_PyRuntimeState, gilstate.tstate_current)" if v311 else "0",
        "offsetof(_PyRuntimeState, interpreters.head)",
        "offsetof(PyInterpreterState, threads.head)",
        "offsetof(PyThreadState, next)", "offsetof(PyThreadState, native_thread_id)",
        "offsetof(PyThreadState, cframe)" if cframe else "0",
        "offsetof(_PyCFrame, current_frame)" if cframe else
        "offsetof(PyThreadState, current_frame)",
        "offsetof(_PyInterpreterFrame, f_code)" if cframe else
        "offsetof(_PyInterpreterFrame, f_executable)",
        "offsetof(_PyInterpreterFrame, previous)",
        "offsetof(_PyInterpreterFrame, prev_instr)" if cframe else
        "offsetof(_PyInterpreterFrame, instr_ptr)",
        "offsetof(_PyInterpreterFrame, is_entry)" if v311 else "0",
        "offsetof(PyCodeObject, co_linetable) + 8 - 80",
        "offsetof(PyCodeObject, co_firstlineno)",
        "offsetof(PyCodeObject, co_filename)", "offsetof(PyCodeObject, co_qualname)",
        "offsetof(PyCodeObject, co_linetable)", "offsetof(PyCodeObject, co_code_adaptive)",
        "offsetof(PyASCIIObject, length)", "offsetof(PyASCIIObject, state)",
        "sizeof(PyASCIIObject)", "sizeof(PyCompactUnicodeObject)",
        "offsetof(PyVarObject, ob_size)", "offsetof(PyBytesObject, ob_sval)",
        "offsetof(_PyInterpreterFrame, owner)",
        "0" if v311 else "FRAME_OWNED_BY_CSTACK == 3",
        "1" if cframe else "0",
        "offsetof(_PyInterpreterFrame, localsplus)", "0", "0",
    )


PYENV = Path.home() / ".pyenv/versions"
HEADERS = {(3, 10): PYENV / "3.10.13/include/python3.10",
           (3, 11): Path("/usr/include/python3.11"),
           (3, 12): PYENV / "3.12.1/include/python3.12",
           (3, 13): PYENV / "3.13.0/include/python3.13"}
# Debian's stripped python3.11 and, where pyenv has them, CPython built from source
# (libpython, with DWARF)
INTERPRETERS = {"built-3.10": PYENV / "3.10.13/bin/python3.10",
                "debian-3.11": Path(PYTHON), "built-3.11": PYENV / "3.11.7/bin/python3.11",
                "built-3.12": PYENV / "3.12.1/bin/python3.12",
                "built-3.13": PYENV / "3.13.0/bin/python3.13"}
LIBPYTHON313 = PYENV / "3.13.0/lib/libpython3.13.so.1.0"
PY39 = PYENV / "3.9.18/bin/python3.9"


def sites() -> dict[str, int]:
    out = {}
    for i, line in enumerate(SCRIPT.read_text().splitlines(), start=1):
        if "# site " in line:
            out[line.split("# site ")[1].split()[0]] = i
    return out


@pytest.mark.parametrize("version", sorted(HEADERS), ids=lambda v: f"{v[0]}.{v[1]}")
def test_offsets_match_the_headers(tmp_path: Path, version: tuple[int, int]) -> None:
    """Each row of the offset table is what that version's headers say; the code
    object's fields BPF reads lie in the bytes it hashes."""
    inc = HEADERS[version]
    if not (inc / "internal" / "pycore_runtime.h").exists():
        pytest.skip(f"no {inc} here (scripts/setup installs python3.11-dev; 3.10, 3.12, "
                    "3.13: pyenv)")
    frame = "frameobject.h" if version == (3, 10) else "internal/pycore_frame.h"
    src = tmp_path / "off.c"
    src.write_text(f"#define Py_BUILD_CORE 1\n#include <Python.h>\n#include <{frame}>\n"
                   "#include <internal/pycore_runtime.h>\n"
                   "#include <internal/pycore_interp.h>\n#include <stdio.h>\n#include <stddef.h>\n"
                   "int main(void) {\n" +
                   "".join(f'    printf("%zu\\n", (size_t)({e}));\n' for e in exprs(version)) +
                   "}\n")
    subprocess.run(["gcc", f"-I{inc}", str(src), "-o", str(tmp_path / "off")], check=True)
    got = subprocess.run([str(tmp_path / "off")], capture_output=True, text=True,
                         check=True).stdout.split()
    assert len(exprs(version)) == len(FIELDS)
    assert tuple(map(int, got)) == OFFSETS[version]
    off = dict(zip(FIELDS, OFFSETS[version], strict=True))
    span = range(off["co_span"], off["co_span"] + 88)  # bpf/pyframes.h MT_PY_SPAN
    for f in ("co_firstlineno", "co_filename", "co_qualname", "co_linetable"):
        assert off[f] in span and off[f] + 4 <= span.stop, f
    assert off["f_read"] <= 127  # read into 128 bytes
    widths = {"f_code": 8, "f_previous": 8, "f_prev_instr": 4 if off["instr_index"] else 8,
              "f_is_entry": 1, "f_owner": 1}
    assert all(off[f] + w <= off["f_read"] for f, w in widths.items())


# the runtime's own offsets (3.13+: _PyRuntime opens with _Py_DebugOffsets, each field a
# u64; Include/internal/pycore_runtime.h), in its order, and the FIELDS they are
DEBUG_OFFSETS = (
    "cookie", "version", "free_threaded",
    "runtime.size", "runtime.finalizing", "interp_head",
    "interp.size", "interp.id", "interp.next", "threads_head", "interp.gc",
    "interp.imports_modules", "interp.sysdict", "interp.builtins", "interp.ceval_gil",
    "interp.gil_runtime_state", "interp.gil_enabled", "interp.gil_locked",
    "interp.gil_holder",
    "ts.size", "ts.prev", "ts_next", "ts.interp", "cf_current", "ts.thread_id",
    "ts_native_tid", "ts.datastack_chunk", "ts.status",
    "frame.size", "f_previous", "f_code", "f_prev_instr", "frame.localsplus", "f_owner",
    "code.size", "co_filename", "code.name", "co_qualname", "co_linetable",
    "co_firstlineno", "code.argcount", "code.localsplusnames", "code.localspluskinds",
    "co_code",
)


def test_offsets_match_the_runtime() -> None:
    """3.13's row is what its libpython's _PyRuntime says of itself (the _Py_DebugOffsets
    debuggers read), field by field, besides what its headers say."""
    if not LIBPYTHON313.exists():
        pytest.skip(f"no {LIBPYTHON313} here")
    interp = find_interpreter(str(LIBPYTHON313))
    assert interp is not None and interp.version == (3, 13, 0)
    with ElfImage(LIBPYTHON313) as img:
        raw = img.code(interp.runtime_vaddr, 8 * len(DEBUG_OFFSETS))
    assert raw[:8] == DEBUG_COOKIE
    words = dict(zip(DEBUG_OFFSETS, (int.from_bytes(raw[i:i + 8], "little")
                                     for i in range(0, len(raw), 8)), strict=True))
    assert words["version"] >> 16 == 0x030D and words["free_threaded"] == 0
    mine = dict(zip(FIELDS, OFFSETS[(3, 13)], strict=True))
    named = [f for f in DEBUG_OFFSETS if f in mine]
    assert len(named) == 14
    assert {f: words[f] for f in named} == {f: mine[f] for f in named}


# Each code object of json.encoder, of the fixture and of edge cases (nested ones too): its line
# table, first line, and the line of each code unit by co_positions() (3.10: co_lines(),
# in bytes), then the version
LINES_PROBE = """
import inspect, json, sys
import json.encoder as enc
todo = [f.__code__ for _, f in inspect.getmembers(enc, inspect.isfunction)]
todo += [m.__code__ for _, m in inspect.getmembers(enc.JSONEncoder, inspect.isfunction)]
todo.append(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"))
# instructions without a line (a finally's copy), a line 200 lines on, one line of over
# 256 bytes of code
edges = ("def f(x):\\n    try:\\n        return x\\n    finally:\\n        x = 1\\n" + "\\n" * 200
         + "def g():\\n    return [" + ",".join(f"a{i}" for i in range(200)) + "]\\n")
todo.append(compile(edges, "<edges>", "exec"))
out = []
while todo:
    c = todo.pop()
    todo += [k for k in c.co_consts if hasattr(k, "co_lines")]
    if hasattr(c, "co_positions"):
        lines = [p[0] or 0 for p in c.co_positions()]
    else:
        lines = [ln or 0 for a, b, ln in c.co_lines() for _ in range(a // 2, b // 2)]
    out.append([c.co_name, c.co_linetable.hex(), c.co_firstlineno, lines])
print(json.dumps([out, sys.version_info[0] << 8 | sys.version_info[1]]))
"""


@pytest.mark.parametrize("interp", sorted(INTERPRETERS))
def test_line_table_matches_cpython(interp: str) -> None:
    """Every instruction's line, from the line table, as that version's co_positions
    (the table's format is the same from 3.11 to 3.13; 3.10's is PEP 626's, read by
    co_lines())."""
    exe = INTERPRETERS[interp]
    if not exe.exists():
        pytest.skip(f"no {exe} here")
    r = subprocess.run([str(exe), "-c", LINES_PROBE, str(SCRIPT)], capture_output=True,
                       text=True, timeout=60, check=True)
    checked = 0
    codes, version = json.loads(r.stdout)
    for name, table, first, want in codes:
        ends, lines = line_ranges(bytes.fromhex(table), first, version)
        for unit, line in enumerate(want):
            j = int((ends <= unit).sum())
            assert lines[j] == line, (name, unit)  # 0: no line
            checked += 1
    assert checked > 500


def test_trampolines_are_code_without_a_line() -> None:
    """3.13's __init__ trampoline (table b'\\xfb': one no-location entry) and an empty
    table are trampolines; compiled code, a cut table, one BPF could not read and any of
    3.10 (its table's bytes are pairs, not location entries) are not."""
    real = compile("x = 1\ny = x\n", "<t>", "exec").co_linetable
    codes = pa.table({"linetable": [b"\xfb", b"", real, real[:2], b"", b"\xf8\xfb",
                                    b"\xfe\xff"],
                      "linetable_size": pa.array([1, 0, len(real), len(real), 24, 2, 2],
                                                 pa.uint32()),
                      "python_version": pa.array([0x030D] * 6 + [0x030A], pa.uint16())})
    assert trampolines(codes).tolist() == [True, True, False, False, False, True, False]
    assert trampolines(codes.slice(2)).tolist() == [False, False, False, True, False]


def test_interpreter_found_from_its_symbols(tmp_path: Path) -> None:
    """Debian's stripped python3 is found by _PyRuntime and its version read from the
    file; 3.12 and 3.13 libpythons (pyenv, when there) too; 3.10's has no Py_Version but
    Py_Is; 3.9's neither (not supported); a free-threaded 3.13 says so in its runtime's
    debug offsets."""
    interp = find_interpreter(os.path.realpath(PYTHON))
    assert interp is not None and interp.version is not None
    assert interp.version[:2] == (3, 11) and interp.supported and not interp.free_threaded
    assert find_interpreter("/bin/true") is None
    # an extension module imports _PyRuntime: not an interpreter
    ext = PYENV / "3.11.7/lib/python3.11/lib-dynload/math.cpython-311-x86_64-linux-gnu.so"
    if ext.exists():
        assert find_interpreter(str(ext)) is None
    for v in ("3.12.1", "3.13.0"):
        lib = PYENV / f"{v}/lib/libpython{v[:-2]}.so.1.0"
        if lib.exists():
            other = find_interpreter(str(lib))
            assert other is not None and other.supported and not other.free_threaded
            assert other.version == tuple(map(int, v.split(".")))
    lib = PYENV / "3.10.13/lib/libpython3.10.so.1.0"
    if lib.exists():
        other = find_interpreter(str(lib))
        assert other is not None and other.version == (3, 10) and other.supported
        assert other.describe() == f"CPython 3.10 ({lib})"
    lib = PYENV / "3.9.18/lib/libpython3.9.so.1.0"
    if lib.exists():
        other = find_interpreter(str(lib))
        assert other is not None and other.version is None and not other.supported
        assert other.describe() == f"CPython before 3.10 ({lib})"
    if LIBPYTHON313.exists():
        lib = free_threaded_copy(tmp_path)
        other = find_interpreter(str(lib))
        assert other is not None and other.version == (3, 13, 0) and other.free_threaded
        assert not other.supported
        assert other.describe() == f"CPython 3.13.0 free-threaded ({lib})"


def test_310_needs_the_fs_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """3.10's thread states name their thread by pthread_self() alone, the FS base BPF
    reads from the task (its offset from the kernel's BTF): this kernel has it; where it
    is not known (another architecture, no BTF) a 3.10 process is one warning naming it,
    and the kernel gets no entry for it (native frames); a 3.11 process is walked as
    before."""
    from memtrack.capture import pyframes
    from memtrack.capture.options import CaptureOptions
    from memtrack.capture.procfs import read_maps
    from memtrack.capture.program import kernel_member_offset

    assert pyframes.task_fsbase() is not None
    assert kernel_member_offset(("task_struct", "thread", "fsbase"), tmp_path / "none") is None
    assert kernel_member_offset(("task_struct", "no_such_member")) is None
    exe = INTERPRETERS["built-3.10"]
    if not exe.exists():
        pytest.skip(f"no {exe} here")
    monkeypatch.setattr(pyframes, "task_fsbase", lambda: None)
    part = pyframes.PyFramesPart(CaptureOptions())
    for python, warned in ((exe, True), (Path(sys.executable), False)):
        proc = subprocess.Popen([str(python), "-c", "import time; time.sleep(30)"])
        try:
            time.sleep(0.5)
            maps = read_maps(proc.pid)
            assert maps
            table: dict[int, pyframes.PyProc] = {}
            notes = part.on_stop({pyframes.PROCS: _Table(table)}, proc.pid, maps)
        finally:
            proc.kill()
            proc.wait()
        if warned:
            assert notes == [
                f"python frames: CPython 3.10 ({Path(exe).parent.parent}/lib/"
                "libpython3.10.so.1.0) keeps pthread_self() as its threads' identity, "
                "which memtrack reads from the kernel's BTF (task_struct.thread.fsbase) "
                "on x86_64 only; not found here, its stacks have native frames only"]
            assert table == {}
        else:
            assert notes == [] and list(table) == [proc.pid]
            assert table[proc.pid].task_fsbase == 0 and table[proc.pid].version == 0x030B


class _Table:
    """bpf[PROCS] as on_stop uses it: keyed by c_uint32 pids."""

    def __init__(self, into: dict[int, object]) -> None:
        self.into = into

    def __setitem__(self, key: object, value: object) -> None:
        self.into[key.value] = value  # type: ignore[attr-defined]

    def __delitem__(self, key: object) -> None:
        del self.into[key.value]  # type: ignore[attr-defined]


def free_threaded_copy(tmp_path: Path) -> Path:
    """3.13's libpython with its runtime's debug offsets saying free-threaded (no 3.13t
    build at hand: only what memtrack reads differs; the interpreter runs as before)."""
    lib = tmp_path / "lib" / LIBPYTHON313.name
    lib.parent.mkdir(exist_ok=True)
    shutil.copyfile(LIBPYTHON313, lib)
    with ElfImage(lib) as img:
        interp = find_interpreter(str(LIBPYTHON313))
        assert interp is not None
        at = img.segments.vaddr_to_offset(interp.runtime_vaddr + 16)  # free_threaded
    assert at is not None
    with open(lib, "r+b") as f:
        f.seek(at)
        f.write((1).to_bytes(8, "little"))
    return lib


def capture_and_process(tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
                        python: str = PYTHON) -> duckdb.DuckDBPyConnection:
    tmp_path.mkdir(exist_ok=True)
    art, db = tmp_path / "run.memtrack", tmp_path / "run.duckdb"
    r = subprocess.run([*MEMTRACK, "capture", "-o", str(art), *extra, "--", python,
                        str(SCRIPT)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return duckdb.connect(str(db), read_only=True)


def frames_of(con: duckdb.DuckDBPyConnection, size: int) -> list[tuple[str, str, int, str]]:
    rows = con.execute("""
        SELECT name, coalesce(file, ''), coalesce(line, 0), method FROM stack_lines
        WHERE stack_id = (SELECT stack_id FROM allocations WHERE size = ?)
        ORDER BY position""", [size]).fetchall()
    assert rows, f"no allocation of {size} bytes"
    return rows


def physical(con: duckdb.DuckDBPyConnection, size: int) -> list[str]:
    """The method of each stack frame (inline levels not apart) of the allocation of
    `size` bytes, from its allocation site outward."""
    return [m for (m,) in con.execute("""
        SELECT method FROM stack_frames WHERE stack_id = (
            SELECT stack_id FROM allocations WHERE size = ?) ORDER BY depth""",
                                      [size]).fetchall()]


def python_part(frames: list[tuple[str, str, int, str]]) -> list[tuple[str, str, int]]:
    return [(n, os.path.basename(f) if f.startswith("/") else f, ln)
            for n, f, ln, m in frames if m == "python"]


def named(interp: str, name: str) -> str:
    """A function as memtrack names it on that interpreter: 3.10's code objects have no
    qualified name (co_name, the qualified name's last part)."""
    return name.rsplit(".", 1)[-1] if interp.endswith("3.10") else name


def chains(interp: str) -> dict[int, list[tuple[str, str, int]]]:
    """The Python frames of each allocation of frames.py, by size, on that interpreter."""
    s = sites()
    mod = ("<module>", "frames.py", s["module"])
    # bytearray(n) asks for n + 1 bytes
    want = {
        N + 2: [("leaf", "frames.py", s["leaf"]), ("middle", "frames.py", s["middle"]),
                ("main", "frames.py", s["main"]), mod],
        N + 11: [("gen", "frames.py", s["gen"]), ("main", "frames.py", s["main_gen"]), mod],
        N + 21: [("Box.method", "frames.py", s["method"]),
                 ("main", "frames.py", s["main_method"]), mod],
        N + 31: [("<lambda>", "frames.py", s["lambda"]),
                 ("main", "frames.py", s["main_lambda"]), mod],
        N + 41: [("from_string", "<generated>", 2), ("<module>", "<generated>", 3),
                 ("main", "frames.py", s["main_exec"]), mod],
        # the instruction after each call is on the next line
        N + 61: [("spread", "frames.py", s["spread"]),
                 ("main", "frames.py", s["main_spread"]), mod],
        # sorted's C code calls the key function
        N + 81: [("keyed", "frames.py", s["keyed"]), ("main", "frames.py", s["main_sorted"]),
                 mod],
    }
    # a class call, specialized after its first calls (3.13: through an __init__
    # trampoline frame, which is not shown)
    for i in range(71, 75):
        want[N + i] = [("Holder.__init__", "frames.py", s["init"]),
                       ("build", "frames.py", s["build"]),
                       ("main", "frames.py", s["main_build"]), mod]
    return {size: [(named(interp, f), file, line) for f, file, line in chain]
            for size, chain in want.items()}


# frames.py's allocations as the program itself sees them: bytearray made a subclass
# whose __new__ takes traceback.extract_stack() (name: co_name; line: f_lineno) of each
# big one, by the size it asks malloc for; the runner's own frames (run_path) left out
OWN_VIEW = """
import builtins, json, os, runpy, sys, traceback
real, seen = builtins.bytearray, {}
class bytearray(real):
    def __new__(cls, n=0, *args):
        if type(n) is int and n > 300000:
            seen[n + 1] = [(f.name, os.path.basename(f.filename), f.lineno)
                           for f in reversed(traceback.extract_stack()[:-1])
                           if f.filename != "<string>" and "runpy" not in f.filename]
        return real.__new__(cls, n, *args)
builtins.bytearray = bytearray
runpy.run_path(sys.argv[1], run_name="__main__")
print(json.dumps(seen))
"""


def own_view(exe: Path) -> dict[int, list[tuple[str, str, int]]]:
    r = subprocess.run([str(exe), "-c", OWN_VIEW, str(SCRIPT)], capture_output=True,
                       text=True, timeout=120, check=True)
    return {int(k): [tuple(f) for f in v] for k, v in json.loads(r.stdout).items()}


@pytest.mark.bpf
@pytest.mark.parametrize("interp", sorted(INTERPRETERS))
def test_python_frames_merged(tmp_path: Path, interp: str) -> None:
    """--python-stacks mixed: every native frame, the Python runs in place of the
    evaluation frames that ran them."""
    exe = INTERPRETERS[interp]
    if not exe.exists():
        pytest.skip(f"no {exe} here")
    s = sites()
    con = capture_and_process(tmp_path, "--python-stacks", "mixed", python=str(exe))
    own = own_view(exe)
    for size, chain in [*chains(interp).items(), (N + 51, None)]:
        frames = frames_of(con, size)
        got = python_part(frames)
        # the program's own view (function names: co_name on every version)
        assert [(n.rsplit(".", 1)[-1], f, ln) for n, f, ln in got] == own[size], size
        if chain is None:
            continue  # the thread's, from threading's bootstrap: below
        assert got == chain, (size, frames)
        # native frames (the allocator, bytearray's C code) above the Python ones, the
        # interpreter's start below them, no evaluation frame left in between
        first = next(i for i, f in enumerate(frames) if f[3] == "python")
        assert first >= 2 and frames[0][3] == "regs"
        assert "PyByteArray_Resize" in [f[0] for f in frames[:first]]
        assert frames[-1][0] == "_start"
        assert "_PyEval_EvalFrameDefault" not in [f[0] for f in frames]
    # the generator ran in its own evaluation call: native frames between it and main
    # (3.10: every frame is its own call)
    gen = frames_of(con, N + 11)
    i = [f[0] for f in gen].index("gen")
    assert gen[i + 1][3] != "python"
    keyed = frames_of(con, N + 81)
    i = [f[0] for f in keyed].index("keyed")
    assert keyed[i + 1][3] != "python"
    # the thread: its own chain, from threading's bootstrap, not main's
    th = python_part(frames_of(con, N + 51))
    assert th[0] == ("in_thread", "frames.py", s["thread"])
    assert [f[0] for f in th[1:]] == [named(interp, f) for f in THREAD]
    # json: the C encoder's native frames above JSONEncoder.iterencode
    iterencode = named(interp, "JSONEncoder.iterencode")
    rows = con.execute("""
        SELECT DISTINCT a.stack_id FROM allocations a JOIN stack_lines l USING (stack_id)
        WHERE l.name = ?""", [iterencode]).fetchall()
    assert rows
    for (sid,) in rows:
        fr = con.execute("""
            SELECT l.name, l.file, l.line, l.method, m.path FROM stack_lines l
            LEFT JOIN modules m USING (module_id) WHERE stack_id = ? ORDER BY position""",
                         [sid]).fetchall()
        names = [f[0] for f in fr]
        it = names.index(iterencode)
        assert any("_json" in (f[4] or "") for f in fr[:it]), fr
        callers = [(f[0], f[2]) for f in fr[it + 1:] if f[3] == "python"][:3]
        assert callers == [(named(interp, "JSONEncoder.encode"), callers[0][1]),
                           ("dumps", callers[1][1]), ("main", s["main_json"])]
    counters = con.execute("SELECT value FROM meta WHERE key = 'counters'").fetchone()[0]
    assert '"python_code_missing": 0' in counters
    # info follows a Python stack to the native record it extends
    r = subprocess.run([*MEMTRACK, "info", str(tmp_path / "run.memtrack"), "--json"],
                       capture_output=True, text=True, timeout=600, check=True)
    info = json.loads(r.stdout)
    assert info["tables"]["py_stacks"]["rows"] > 0 and info["tables"]["py_codes"]["rows"] > 0
    assert info["stack_records"]["unresolved_hashes"] == 0
    # runs with no evaluation frame left to replace go outermost: only where the native
    # unwinding stopped short
    short = con.execute("""
        SELECT s.complete FROM stacks s JOIN stack_frames f USING (stack_id)
        WHERE f.depth = s.depth - 1 AND f.method = 'python'""").fetchall()
    assert not any(c for (c,) in short)


THREAD = ["Thread.run", "Thread._bootstrap_inner", "Thread._bootstrap"]


@pytest.mark.bpf
@pytest.mark.parametrize("interp", ["built-3.10", "debian-3.11", "built-3.13"])
def test_python_cut(tmp_path: Path, interp: str) -> None:
    """--python-stacks python (the default): the allocator and its caller, then the
    Python frames, nothing of the native stack under them: one stack record per Python
    call path."""
    exe = INTERPRETERS[interp]
    if not exe.exists():
        pytest.skip(f"no {exe} here")
    s = sites()
    con = capture_and_process(tmp_path, python=str(exe))
    for size, chain in chains(interp).items():
        frames = frames_of(con, size)
        assert python_part(frames) == chain, (size, frames)
        # the allocator and its caller (stack frames: the caller may have inline
        # levels, 3.10's _PyObject_Malloc), then Python frames only
        methods = physical(con, size)
        assert methods[:2] == ["regs", "cfi"] and set(methods[2:]) == {"python"}, frames
        stop = con.execute("""SELECT stop, complete, truncated FROM stacks WHERE stack_id =
            (SELECT stack_id FROM allocations WHERE size = ?)""", [size]).fetchone()
        assert stop == ("python", False, False)
    th = python_part(frames_of(con, N + 51))
    assert th[0] == ("in_thread", "frames.py", s["thread"])
    assert [f[0] for f in th[1:]] == [named(interp, f) for f in THREAD]
    # json's C encoder called from JSONEncoder.iterencode: below it, the Python callers
    iterencode = named(interp, "JSONEncoder.iterencode")
    rows = con.execute("""
        SELECT DISTINCT stack_id FROM stack_lines WHERE name = ?
        AND stack_id IN (SELECT stack_id FROM allocations)""", [iterencode]).fetchall()
    assert rows
    for (sid,) in rows:
        names = [n for (n,) in con.execute(
            "SELECT name FROM stack_lines WHERE stack_id = ? ORDER BY position", [sid]
        ).fetchall()]
        it = names.index(iterencode)
        assert names[it + 1:it + 4] == [named(interp, "JSONEncoder.encode"), "dumps",
                                        "main"], names
    counters = json.loads(con.execute(
        "SELECT value FROM meta WHERE key = 'counters'").fetchone()[0])
    assert counters["python_runs_unplaced"] == 0 and counters["python_code_missing"] == 0
    # every allocation made while Python code ran has a Python cut, none other does
    cut, py = con.execute("""
        SELECT count(*) FILTER (WHERE s.stop = 'python'),
               count(*) FILTER (WHERE s.stack_id IN (
                   SELECT stack_id FROM stack_frames WHERE method = 'python'))
        FROM allocations a JOIN stacks s USING (stack_id)""").fetchone()
    assert cut == py > 0
    # process --python-frames off: a Python cut alone, the allocator and its caller
    db = tmp_path / "native.duckdb"
    r = subprocess.run([*MEMTRACK, "process", str(tmp_path / "run.memtrack"), "-o", str(db),
                        "--python-frames", "off"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    native = duckdb.connect(str(db), read_only=True)
    assert physical(native, N + 2) == ["regs", "cfi"]


def native_only(con: duckdb.DuckDBPyConnection) -> None:
    frames = frames_of(con, N + 2)
    assert not python_part(frames)
    assert "_PyEval_EvalFrameDefault" in [f[0] for f in frames]
    assert frames[-1][0] == "_start"
    assert con.execute("SELECT count(*) FROM stack_frames WHERE method = 'python'"
                       ).fetchone()[0] == 0


@pytest.mark.bpf
def test_python_frames_off(tmp_path: Path) -> None:
    """capture --python-frames off: the native frames only, the evaluation frames in
    place; process --python-frames off on an artifact that has them (with the whole
    native stacks: --python-stacks mixed): the same."""
    native_only(capture_and_process(tmp_path / "capture", "--python-frames", "off"))
    art, db = tmp_path / "run.memtrack", tmp_path / "native.duckdb"
    capture_and_process(tmp_path, "--python-stacks", "mixed").close()
    r = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db), "--python-frames",
                        "off"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    native_only(duckdb.connect(str(db), read_only=True))
    r = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db), "--python-frames",
                        "maybe"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.strip() == (
        "memtrack: --python-frames maybe: expected on or off")


@pytest.mark.bpf
@pytest.mark.parametrize("build", ["3.9", "3.13-free-threaded"])
def test_unknown_build_is_one_note(tmp_path: Path, build: str) -> None:
    """A CPython the offset table does not know (3.9: neither Py_Version nor Py_Is; a
    free-threaded 3.13: other layouts): one warning naming it and its file, native
    frames only."""
    env = dict(os.environ)
    if build == "3.9":
        exe, lib = PY39, PYENV / "3.9.18/lib/libpython3.9.so.1.0"
        name = "CPython before 3.10"
    else:
        exe, name = INTERPRETERS["built-3.13"], "CPython 3.13.0 free-threaded"
        if exe.exists():
            lib = free_threaded_copy(tmp_path)
            env["LD_LIBRARY_PATH"] = str(lib.parent)  # before the executable's RUNPATH
    if not exe.exists():
        pytest.skip(f"no {exe} here")
    art, db = tmp_path / "run.memtrack", tmp_path / "run.duckdb"
    r = subprocess.run([*MEMTRACK, "capture", "-o", str(art), "--", str(exe), "-c",
                        "x = bytearray(300000)"], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if "python frames:" in ln]
    assert notes == [f"memtrack: warning: python frames: {name} ({lib}) is not a build "
                     "memtrack knows (known: 3.10, 3.11, 3.12, 3.13, with the GIL); its "
                     "stacks have native frames only"]
    assert Artifact.open(art).read("py_stacks").table.num_rows == 0
    r = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    con = duckdb.connect(str(db), read_only=True)
    frames = [f[0] for f in frames_of(con, 300001)]
    assert "_PyEval_EvalFrameDefault" in frames and frames[-1] == "_start"


def small_objects(con: duckdb.DuckDBPyConnection) -> dict[int, int]:
    """Allocations made at the small-object site, by size."""
    line = sites()["small"]
    return dict(con.execute("""
        SELECT a.size, count(*) FROM allocations a WHERE a.stack_id IN (
            SELECT stack_id FROM stack_lines WHERE name = 'small.<locals>.<listcomp>'
            AND line = ? AND method = 'python') GROUP BY 1""", [line]).fetchall())


@pytest.mark.bpf
def test_pymalloc_against_malloc(tmp_path: Path) -> None:
    """What a user sees of objects: with the default pymalloc, requests of 512 bytes and
    less are served from pymalloc's arenas (mmap'd, not malloc'd) and do not appear;
    with PYTHONMALLOC=malloc every object is a malloc with its Python frames (bytes of
    60 and 61: 33 + n bytes each, 1000 of each). The list holding them grows past 512
    bytes by malloc either way."""
    default = capture_and_process(tmp_path / "pymalloc")
    seen = small_objects(default)
    assert seen and min(seen) > 512
    assert python_part(frames_of(default, N + 2))[0] == ("leaf", "frames.py", sites()["leaf"])
    every = capture_and_process(tmp_path / "malloc", env={"PYTHONMALLOC": "malloc"})
    every_seen = small_objects(every)
    assert every_seen[93] == 1000 and every_seen[94] == 1000
    assert python_part(frames_of(every, N + 2))[0] == ("leaf", "frames.py", sites()["leaf"])


@pytest.mark.parametrize("case", ["format-2.5", "3.10"])
def test_line_table_read_by_its_version(tmp_path: Path, case: str) -> None:
    """py_codes of an artifact before format 2.6 (no python_version) reads as version 0,
    its tables as location tables (3.11 to 3.13); a 3.10 code record's table is read as
    PEP 626's: through `process`, the frame's line either way (3.10: an instruction in
    its second range, a line on)."""
    from support import synth

    from memtrack.schema import MANIFEST

    art = synth.write_synth(tmp_path / "run.memtrack", python={11: "work"})
    codes = Artifact.open(art).read("py_codes").table
    assert codes["python_version"].to_pylist() == [0x030B]
    m = json.loads((art / MANIFEST).read_text())
    first = synth.name_line("work")[1]
    want = first
    if case == "format-2.5":
        codes = codes.drop_columns(["python_version"])
        m["format_version"] = "2.5"
    else:
        # 8 code units on the first line, then 8 on the next; the frame at unit 9
        for name, value in (("linetable", pa.array([b"\x10\x00\x10\x01"])),
                            ("linetable_size", pa.array([4], pa.uint32())),
                            ("python_version", pa.array([0x030A], pa.uint16()))):
            codes = codes.set_column(codes.schema.get_field_index(name), name, value)
        stacks = Artifact.open(art).read("py_stacks").table
        stacks = stacks.set_column(stacks.schema.get_field_index("instr"), "instr",
                                   pa.array([[9]], pa.list_(pa.uint32())))
        _rewrite(art, "py_stacks", stacks, m)
        want = first + 1
    _rewrite(art, "py_codes", codes, m)
    (art / MANIFEST).write_text(json.dumps(m))
    read = Artifact.open(art).read("py_codes").table
    assert read["python_version"].to_pylist() == [0 if case == "format-2.5" else 0x030A]
    db = tmp_path / "run.duckdb"
    r = subprocess.run([*MEMTRACK, "process", str(art), "-o", str(db), "-q"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("""SELECT DISTINCT line FROM stack_lines
        WHERE method = 'python' AND name = 'work'""").fetchall() == [(want,)]


def _rewrite(art: Path, name: str, table: pa.Table, manifest: dict) -> None:
    from memtrack.schema.artifact import file_checksum, table_file

    f = art / table_file(name)
    with pa.ipc.new_stream(str(f), table.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    manifest["checksums"][table_file(name)] = file_checksum(f)
