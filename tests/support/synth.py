"""Synthetic artifacts and run databases with known allocations: the data the process,
report and export tests share. Every figure they check derives from this."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.process.pipeline import process
from memtrack.schema import EVENTS, MAPPINGS, NUM_REGS, PROCESSES, RSS, Allocator, EventKind
from memtrack.schema.artifact import ArtifactWriter
from memtrack.schema.enums import CLONE_VFORK, CLONE_VM
from support.stackrecords import SP0, regions_kept, ring_record

K = EventKind
LIBC = int(Allocator.LIBC)
END_NS = 3000

# The children are vforks (CLONE_VM): they share pid 100's memory, so they inherit no
# copy of its blocks (tests/test_process.py pairs the same events with plain forks).
VFORK = CLONE_VM | CLONE_VFORK
# (ts, pid, tid, kind, flags, addr, old_addr, size, stack_hash)
EVENT_ROWS = [
    (1000, 100, 100, K.MALLOC, 0, 0xA0, 0, 512, 11),  # A: temporary
    (1100, 100, 100, K.FREE, 0, 0xA0, 0, 0, 0),
    (1200, 100, 100, K.MALLOC, 0, 0xB0, 0, 1024, 12),  # B: realloc'd into D
    (1250, 100, 101, K.MALLOC, 0, 0xF0, 0, 300, 13),  # F: thread 101, freed by 100
    (1300, 100, 100, K.MALLOC, 0, 0xC0, 0, 2048, 15),  # C: make_big, another line
    (1400, 100, 100, K.REALLOC, 0, 0xD0, 0xB0, 4096, 14),  # D: realloc of B (peak here)
    (1500, 100, 100, K.FREE, 0, 0xC0, 0, 0, 0),
    (1600, 100, 100, K.CALLOC, 0, 0xE0, 0, 1000, 11),  # E: leaked
    (1700, 100, 100, K.FREE, 0, 0xF0, 0, 0, 0),
    (1800, 100, 100, K.FORK, VFORK, 200, 0, 0, 0),  # child 200
    (1900, 200, 200, K.MALLOC, 0, 0x60, 0, 64, 13),  # G: child, ends at its exit
    (1950, 200, 200, K.FREE, 0, 0xE0, 0, 0, 0),  # pid 100's block: unmatched
    (2000, 200, 200, K.EXIT, 1, 0, 0, 3 << 8, 0),
    (2100, 100, 100, K.ALIGNED_ALLOC, 0, 0x80, 0, 512, 14),  # H: temporary
    (2200, 100, 100, K.FREE, 0, 0x80, 0, 0, 0),
    (2250, 100, 100, K.FREE, 0, 0xDEAD, 0, 0, 0),  # never allocated: unmatched
    (2300, 100, 100, K.FORK, VFORK, 200, 0, 0, 0),  # pid 200 reused
    (2400, 200, 200, K.FREE, 0, 0x60, 0, 0, 0),  # G's address, other instance: unmatched
    (2500, 200, 200, K.MALLOC, 0, 0x70, 0, 128, 0),  # X: leaked by the second 200
    (2600, 200, 200, K.EXIT, 1, 0, 0, 9, 0),  # killed by SIGKILL
]
# alloc_id order: A B F C D E G H X
SIZES = [512, 1024, 300, 2048, 4096, 1000, 64, 512, 128]
PEAK = {"pid": 100, "ts": 1400, "bytes": 300 + 2048 + 4096, "alive": [2, 3, 4]}
LEAKS = {5: ("end", 1000), 4: ("end", 4096), 6: ("exit", 64), 8: ("exit", 128)}
TEMPORARY = [0, 7]
UNMATCHED_FREES = 3


def events_table(rows: list[tuple] | None = None) -> pa.Table:
    """EVENT_ROWS (or `rows` in their layout) as an events table."""
    cols = list(zip(*(rows or EVENT_ROWS), strict=True))
    data = {
        "ts": cols[0], "pid": cols[1], "tid": cols[2], "kind": [int(k) for k in cols[3]],
        "allocator": [LIBC if k in (1, 2, 3, 4, 5) else 0 for k in cols[3]],
        "flags": cols[4], "addr": cols[5], "old_addr": cols[6], "size": cols[7],
        "stack_hash": cols[8],
    }  # fmt: skip
    return pa.table(data, schema=EVENTS)


def write_artifact(path: Path, events: pa.Table | None = None, *,
                   command: tuple[str, ...] = ("p", "-x"), comm: str = "parent") -> Path:
    w = ArtifactWriter(path)
    w.write("events", events if events is not None else events_table())
    w.write("processes", pa.table({
        "ts": [900, 1800, 2300], "pid": [100, 200, 200], "ppid": [1, 100, 100],
        "comm": [comm, "child", "child2"], "exe": ["/bin/p", "/bin/p", "/bin/p"],
        "cmdline": [["p", "-x"], ["p"], ["p"]], "ns_pid": [100, 200, 200]},
        schema=PROCESSES))  # fmt: skip
    w.write("rss", pa.table({
        "ts": [1000, 1400, 1500], "pid": [100, 100, 100], "member": [1, 1, 0],
        "bytes": [4096, 65536, 8192], "external": [False] * 3}, schema=RSS))  # fmt: skip
    w.write("mappings", MAPPINGS.empty_table())
    w.manifest.root_pid = 100
    w.manifest.start_ns = 900
    w.manifest.end_ns = END_NS
    w.manifest.command = list(command)
    w.close()
    return path


def write_storm(path: Path, processes: int) -> Path:
    """A fork/exec storm: pid 100 (a shell) forks `processes` children one after
    another, 1 ms apart, each of which execs, allocates three blocks (its RSS growing
    with each), frees one and exits (the others leaked at its exit)."""
    rows, rss, procs = [], [], [(900, 100, 1, "sh", "/bin/sh", ["sh"], 100)]
    ts = 1000
    for i in range(processes):
        pid = 1000 + i
        rows += [(ts, 100, 100, K.FORK, 0, pid, 0, 0, 0), (ts + 1, pid, pid, K.EXEC, 0, 0, 0, 0, 0)]
        procs.append((ts + 1, pid, 100, f"job{i}", "/bin/job", ["job", str(i)], pid))
        for j in range(3):
            rows.append((ts + 2 + j, pid, pid, K.MALLOC, 0, 0x1000 + 64 * j, 0, 100 + j, 11))
            rss.append((ts + 2 + j, pid, 1, 4096 * (j + 1), False))
        rows += [(ts + 5, pid, pid, K.FREE, 0, 0x1000, 0, 0, 0),
                 (ts + 6, pid, pid, K.EXIT, 1, 0, 0, 0, 0)]
        ts += 1_000_000
    w = ArtifactWriter(path)
    w.write("events", events_table(rows))
    w.write("processes", pa.table(dict(zip(PROCESSES.names, zip(*procs, strict=True),
                                           strict=True)), schema=PROCESSES))
    w.write("rss", pa.table(dict(zip(RSS.names, zip(*rss, strict=True), strict=True)),
                            schema=RSS))
    w.write("mappings", MAPPINGS.empty_table())
    w.manifest.root_pid = 100
    w.manifest.start_ns = 900
    w.manifest.end_ns = ts
    w.manifest.command = ["sh", "storm"]
    w.close()
    return path


# The stacks of the stack hashes above, so that report and export tests control every
# frame: hash -> frames innermost first (depth 0 is the allocator itself); NAME:LINE is
# NAME at another line of its file. They are real: MODULE (/bin/p) is an ELF built from
# a generated source in which each NAME is a function of its own file NAME.c, and each
# stack is a stack record that `process` unwinds with the module's CFI and symbolizes
# with its DWARF, as it does a capture's.
STACKS = {
    11: ["malloc", "make_small", "work", "main"],
    12: ["malloc", "make_big", "work", "main"],
    13: ["malloc", "thread_fn"],
    14: ["realloc", "grow", "main"],
    15: ["malloc", "make_big:31", "work", "main"],
}
CUT = {13}  # stacks cut short: unwinding needed more than the copy (no outermost frame)
ALLOCATORS = ["calloc", "free", "malloc", "realloc"]  # what capture probed


BUILD_ID = "ab" * 20
MAPPED = (0x5500_0000, 0x5501_0000)  # where /bin/p lies in pid 100
NAMES = sorted({n for fr in STACKS.values() for n in fr if ":" not in n})
EVAL = "_PyEval_EvalFrameDefault"  # runs the Python frames of a stack (python=...)
FUNCTIONS = [*NAMES, EVAL]  # MODULE's, 0x100 bytes apart from 0x1000
OTHER_LINE = 0x80  # NAME:LINE is this far into NAME


def vaddr_of(entry: str) -> int:
    """Where NAME (or NAME:LINE) lies in MODULE."""
    name, _, line = entry.partition(":")
    return 0x1000 + 0x100 * FUNCTIONS.index(name) + (OTHER_LINE if line else 0)


def return_address(entry: str) -> int:
    """The return address into NAME (or NAME:LINE) in pid 100: one past its vaddr."""
    return MAPPED[0] + vaddr_of(entry) + 1


def name_line(entry: str) -> tuple[str, int]:
    """A frame's function and line: NAME at 10 + its index, or NAME:LINE."""
    name, _, line = entry.partition(":")
    return name, int(line) if line else 10 + FUNCTIONS.index(name)


def module_source() -> str:
    """MODULE's C: each function naked (its CFA is rsp + 8 throughout, the return address
    at rsp), 256-byte aligned, on the line name_line gives in its own file; main's CFI
    says rip is undefined (a stack that reaches it is complete)."""
    lines = {e.partition(":")[2] for fr in STACKS.values() for e in fr if ":" in e}
    out = ["/* generated by tests/support/synth.py */"]
    for name in FUNCTIONS:
        _, line = name_line(name)
        cfi = ".cfi_undefined rip; " if name == "main" else ""
        out.append(f'#line {line} "{name}.c"')
        if name == "make_big":
            (other,) = lines
            out += [f"__attribute__((naked, used, aligned(256))) void {name}(void) "
                    f'{{ __asm__("{cfi}nop; .skip {OTHER_LINE - 1}, 0x90");',
                    f'#line {other} "{name}.c"', '__asm__("nop; ret"); }']
        else:
            out.append(f"__attribute__((naked, used, aligned(256))) void {name}(void) "
                       f'{{ __asm__("{cfi}nop; ret"); }}')
    return "\n".join(out) + "\n"


def module() -> Path:
    """MODULE, built once (tests/conftest.py caches it by its source): compiled to
    assembly first, where the compilation directory becomes "" (the files are NAME.c,
    not a path under the directory the tests ran in)."""
    from conftest import BUILD_DIR, build

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    text = module_source()
    src = BUILD_DIR / f"synth_p-{hashlib.sha256(text.encode()).hexdigest()[:12]}.s"
    if not src.exists():
        c = src.with_suffix(f".{os.getpid()}.c")
        c.write_text(text)
        asm = subprocess.run(["gcc", "-S", "-gdwarf-4", "-gno-column-info", "-O0", "-fno-builtin",
                              "-fPIC", "-o", "-",
                              c.name], check=True, capture_output=True, text=True,
                             cwd=c.parent).stdout
        c.unlink()
        cwd = f'"{c.parent}"'
        asm = asm.replace(f".file 0 {cwd}", '.file 0 ""').replace(f".string\t{cwd}",
                                                                   '.string\t""')
        tmp = src.with_suffix(f".{os.getpid()}.s")
        tmp.write_text(asm)
        os.replace(tmp, src)
    return build([src], name="synth_p", shared=True,
                 flags=("-nostdlib", f"-Wl,--build-id=0x{BUILD_ID}"))


def stack_records(stacks: dict[int, list[str]], python: dict[int, str]) -> tuple[
        pa.Table, dict[int, int]]:
    """Stack records of pid 100 (STACKS rows) that unwind to `stacks` in MODULE, and the
    hash each key stands for (its record's skeleton hash). A stack whose frames named
    python[key] are Python frames has EVAL in their place in its native record."""
    from memtrack.capture.stackring import records_to_batches

    records, hashes = [], {}
    for key, frames in sorted(stacks.items()):
        native = native_frames(frames, python.get(key))
        regs = np.zeros(NUM_REGS, np.uint64)
        regs[7], regs[16] = SP0, MAPPED[0] + vaddr_of(native[0])
        words = np.array([return_address(f) for f in native[1:]], np.uint64)
        records.append(ring_record(words, SP0, regs, regions_kept(MAPPED[0], SP0), tid=100, pid=100,
                                   cut=key in CUT, ts=900))
    out = records_to_batches(records)
    assert out.malformed == 0
    for key, h in zip(sorted(stacks), out.stacks.column("hash").to_pylist(), strict=True):
        hashes[key] = h
    return pa.Table.from_batches([out.stacks]), hashes


def native_frames(frames: list[str], python: str | None) -> list[str]:
    """The native frames of a stack: its frames named `python` one EVAL frame."""
    if python is None:
        return frames
    first = frames.index(python)
    return [*frames[:first], EVAL, *(f for f in frames[first:] if f != python)]


PY_CODE = 0x7000  # the code object of the Python frames


def python_stacks(stacks: dict[int, list[str]], python: dict[int, str],
                  natives: dict[int, int]) -> tuple[pa.Table, pa.Table]:
    """(py_stacks, py_codes) of the stacks with Python frames: each under its own key as
    its hash (the events carry it), its run of frames entered from C at its outermost;
    the code object is named python[key], in python[key].py, on name_line's line."""
    from memtrack.schema import PY_CODES, PY_STACKS

    rows: dict[str, list] = {k: [] for k in PY_STACKS.names}
    codes: dict[str, list] = {k: [] for k in PY_CODES.names}
    for key, name in sorted(python.items()):
        n = stacks[key].count(name)
        for k, v in zip(rows, (key, natives[key], 100, 100, False, [PY_CODE] * n, [0] * n,
                               [False] * (n - 1) + [True]), strict=True):
            rows[k].append(v)
        # one entry of the location table: 8 code units on the first line
        for k, v in zip(codes, (PY_CODE, 100, 0x7F00_0000_0000, name, f"{name}.py",
                                name_line(name)[1], bytes([0x80 | 10 << 3 | 7, 0, 0]), 3,
                                0x030B),
                        strict=True):
            codes[k].append(v)
    return pa.table(rows, schema=PY_STACKS), pa.table(codes, schema=PY_CODES)


# The processes stage_tables knew: pid 200's second process has no row of its own
PROCESS_ROWS = {"ts": [900, 1800], "pid": [100, 200], "ppid": [1, 100],
                "comm": ["parent", "child"], "exe": ["/bin/p", "/bin/p"],
                "cmdline": [["p", "-x"], ["p"]], "ns_pid": [100, 200]}
RSS_ROWS = {"ts": [1000, 1400, 1500], "pid": [100, 100, 100], "member": [1, 1, 0],
            "bytes": [4096, 65536, 8192], "external": [False] * 3}


def write_synth(path: Path, events: pa.Table | None = None,
                stacks: dict[int, list[str]] = STACKS, *, python: dict[int, str] | None = None,
                end_ns: int = END_NS, rss: pa.Table | None = None,
                region_names: pa.Table | None = None, region_labels: pa.Table | None = None,
                stops: pa.Table | None = None, command: tuple[str, ...] = ("p", "-x"),
                allocators: list[str] = ALLOCATORS, losses: dict[str, int] | None = None
                ) -> Path:
    """An artifact of EVENT_ROWS (or `events`) whose stack hashes 11.. are `stacks`' keys:
    their stack records, MODULE mapped at MAPPED in pid 100 and copied in, the processes
    of PROCESS_ROWS, RSS_ROWS (or `rss`), the regions `region_names` names (with the
    `region_labels`) and the `stops`, for a capture that ended at `end_ns` having probed
    `allocators` in /bin/p and counted `losses`."""
    python = python or {}
    records, hashes = stack_records(stacks, python)
    ev = events if events is not None else events_table()
    carried = {**hashes, **{k: k for k in python}}  # a Python stack's events carry its key
    old = ev.column("stack_hash").to_pylist()
    ev = ev.set_column(ev.schema.get_field_index("stack_hash"), "stack_hash",
                       pa.array([carried.get(h, h) for h in old], pa.uint64()))
    w = ArtifactWriter(path, overwrite=True)
    w.write("events", ev)
    w.write("stacks", records)
    if python:
        py_stacks, py_codes = python_stacks(stacks, python, hashes)
        w.write("py_stacks", py_stacks)
        w.write("py_codes", py_codes)
    w.write("processes", pa.table(PROCESS_ROWS, schema=PROCESSES))
    w.write("rss", rss if rss is not None else pa.table(RSS_ROWS, schema=RSS))
    if region_names is not None:
        w.write("region_names", region_names)
    if region_labels is not None:
        w.write("region_labels", region_labels)
    if stops is not None:
        w.write("stops", stops)
    w.write("mappings", pa.table({
        "ts": [900], "pid": pa.array([100], pa.uint32()), "start": [MAPPED[0]],
        "end": [MAPPED[1]], "offset": [0], "perms": ["r-xp"], "dev": ["fd:01"],
        "inode": [42], "path": ["/bin/p"], "build_id": [BUILD_ID]}, schema=MAPPINGS))
    w.add_module(BUILD_ID, "/bin/p", module())
    w.manifest.root_pid = 100
    w.manifest.start_ns = 900
    w.manifest.end_ns = end_ns
    w.manifest.command = list(command)
    w.manifest.probes = [{"path": "/bin/p", "function": f} for f in allocators]
    w.manifest.losses.update(losses or {})
    w.close()
    return path


def write_run(path: Path, events: pa.Table | None = None,
              stacks: dict[int, list[str]] = STACKS, **synth: Any) -> Path:
    """A run database of EVENT_ROWS (or `events`) with STACKS (or `stacks`, of the same
    names) as their stacks, written by `process` from write_synth's artifact (beside
    it, PATH.memtrack; `synth`: write_synth's options)."""
    art = write_synth(path.with_suffix(".memtrack"), events, stacks, **synth)
    process(art, path, progress=False, host_modules=False)
    return path


def random_events(seed: int, n: int = 3000) -> pa.Table:
    """A random stream (time-ordered) over few addresses, so that they are reused: every
    allocation kind, frees of blocks never seen, reallocs (in place, moved, of nothing),
    failed allocations, threads that start and exit, forks (plain and vfork; some pids
    reused) whose children allocate and free before their exec or exit, and
    grandchildren."""
    from memtrack.schema.enums import CLONE_THREAD

    rng = np.random.default_rng(seed)
    rows = []
    ts = 1000
    pids, tids = [100], {100: [100]}
    next_pid = 200
    for _ in range(n):
        ts += int(rng.integers(0, 3))
        p = pids[int(rng.integers(len(pids)))]
        t = tids[p][int(rng.integers(len(tids[p])))]
        r = rng.random()
        addr = int(rng.integers(1, 60)) * 16
        size = int(rng.integers(1, 5000))
        if r < 0.35:
            k = (K.MALLOC, K.CALLOC, K.ALIGNED_ALLOC)[int(rng.integers(3))]
            rows.append((ts, p, t, k, 0, 0 if rng.random() < 0.02 else addr, 0, size,
                         int(rng.integers(0, 9))))
        elif r < 0.7:
            rows.append((ts, p, t, K.FREE, 0, addr if rng.random() > 0.03 else 0, 0, 0, 0))
        elif r < 0.85:
            rows.append((ts, p, t, K.REALLOC, 0, addr if rng.random() > 0.1 else 0,
                         int(rng.integers(0, 60)) * 16, size, int(rng.integers(0, 9))))
        elif r < 0.9 and len(pids) < 8:
            child = next_pid if rng.random() < 0.8 or next_pid == 200 else 200
            next_pid += 1
            rows.append((ts, p, t, K.FORK, CLONE_VM if rng.random() < 0.3 else 0, child,
                         0, 0, 0))
            if child not in pids:
                pids.append(child)
            tids[child] = [child]
        elif r < 0.93:
            new = t + 1000 + int(rng.integers(0, 5))
            rows.append((ts, p, t, K.FORK, CLONE_THREAD | CLONE_VM, new, 0, 0, 0))
            if new not in tids[p]:
                tids[p].append(new)
        elif r < 0.95 and p != 100:
            rows.append((ts, p, p, K.EXEC, 0, 0, 0, 0, 0))
        elif r < 0.97 and t != p:
            rows.append((ts, p, t, K.EXIT, 0, 0, 0, 0, 0))
            tids[p].remove(t)
        elif r < 0.97 and p != 100:
            rows.append((ts, p, p, K.EXIT, 1, 0, 0, 0, 0))
            pids.remove(p)
    return events_table(rows)
