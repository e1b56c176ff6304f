"""The capture's program cache and loader (memtrack.capture.program), the early command
check and the compile note: a cached program is exactly what bcc compiled, a damaged,
foreign or mismatched cache entry is never loaded, and a capture from the cache
records what a compiled one records."""

from __future__ import annotations

import ctypes as ct
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build

from memtrack.capture import program as pg
from memtrack.capture.options import CaptureOptions
from memtrack.schema import EventKind

SOURCE = r"""
BPF_HASH(h, u32, u64, 16);
BPF_ARRAY(a, u64, 4);
BPF_PERCPU_ARRAY(pc, u64, 2);
struct mt_pair { u32 x; u64 y[3]; };
BPF_TABLE("lru_hash", u64, struct mt_pair, lru, 8);
BPF_RINGBUF_OUTPUT(ring, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (pid != MT_PID) return 0;
    u64 one = 1;
    h.update(&pid, &one);
    int k = 1;
    u64 *v = a.lookup(&k);
    if (v) *v += 7;
    v = pc.lookup(&k);
    if (v) *v += 1;
    u64 *r = ring.ringbuf_reserve(sizeof(u64));
    if (r) { *r = 42; ring.ringbuf_submit(r, 0); }
    return 0;
}
"""


def _flags() -> list[str]:
    return [f"-DMT_PID={os.getpid()}"]


@pytest.mark.bpf
def test_cache_holds_exactly_what_bcc_compiled(tmp_path: Path) -> None:
    image = pg.compile_image(SOURCE, _flags())
    assert [m.name for m in image.maps] == ["a", "h", "lru", "pc", "ring"]
    code = image.functions["tracepoint__syscalls__sys_enter_getppid"]
    relocs = image.relocations["tracepoint__syscalls__sys_enter_getppid"]
    assert sorted({m for _, m in relocs}) == [0, 1, 3, 4]  # every map the code uses
    assert all(code[i * 8:i * 8 + 1] == b"\x18" and code[i * 8 + 4:i * 8 + 8] == bytes(4)
               for i, _ in relocs)
    cache = pg.ProgramCache(tmp_path / "bpf")
    assert cache.usable() is None
    key = pg.cache_key(SOURCE, _flags())
    assert cache.get(key) is None
    cache.put(key, image)
    assert cache.get(key) == image
    assert pg.Image.from_json(image.to_json(key), "0" * 64) is None  # another key's entry
    # only the most recently used entries stay
    small = pg.ProgramCache(tmp_path / "bpf", keep=2)
    for other in ("a" * 64, "b" * 64):
        os.utime(tmp_path / "bpf" / f"{key}.json", ns=(1, 1))
        assert small.get(key) == image  # used: now the newest
        small.put(other, image)
    assert sorted(p.stem for p in (tmp_path / "bpf").glob("*.json")) == sorted([key, "b" * 64])


@pytest.mark.bpf
def test_damaged_foreign_or_linked_entries_are_not_loaded(tmp_path: Path) -> None:
    image = pg.compile_image(SOURCE, _flags())
    cache = pg.ProgramCache(tmp_path / "bpf")
    assert cache.usable() is None
    key = pg.cache_key(SOURCE, _flags())
    cache.put(key, image)
    path = tmp_path / "bpf" / f"{key}.json"
    data = path.read_bytes()
    code = image.functions["tracepoint__syscalls__sys_enter_getppid"].hex().encode()
    at = data.index(code) + 20  # one hex digit of an instruction
    path.write_bytes(data[:at] + (b"0" if data[at:at + 1] != b"0" else b"1") + data[at + 1:])
    assert cache.get(key) is None
    path.write_bytes(data)
    assert cache.get(key) == image
    path.write_bytes(data[:len(data) // 2])  # a write cut short
    assert cache.get(key) is None
    path.write_bytes(data)
    os.chmod(path, 0o664)  # someone else could have written it
    assert cache.get(key) is None
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    assert cache.get(key) is None
    path.unlink()
    real = tmp_path / "elsewhere.json"
    real.write_bytes(data)
    os.chmod(real, 0o600)
    path.symlink_to(real)
    assert cache.get(key) is None
    open_dir = pg.ProgramCache(tmp_path / "open")
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    assert "only it can write" in (open_dir.usable() or "")


def test_cache_key_follows_every_input(tmp_path: Path) -> None:
    events = tmp_path / "events"
    (events / "syscalls" / "sys_enter_getppid").mkdir(parents=True)
    fmt = events / "syscalls" / "sys_enter_getppid" / "format"
    fmt.write_text("field:int __syscall_nr; offset:8; size:4; signed:1;\n")
    key = pg.cache_key(SOURCE, ["-DX=1"], tracefs=events)
    assert pg.cache_key(SOURCE, ["-DX=1"], tracefs=events) == key
    assert pg.cache_key(SOURCE, ["-DX=2"], tracefs=events) != key
    assert pg.cache_key(SOURCE + "\n", ["-DX=1"], tracefs=events) != key
    fmt.write_text("field:int __syscall_nr; offset:12; size:4; signed:1;\n")
    assert pg.cache_key(SOURCE, ["-DX=1"], tracefs=events) != key


@pytest.mark.bpf
def test_loaded_program_works_like_bcc(tmp_path: Path) -> None:
    from memtrack.capture.ringbuf import RingReader

    p = pg.Program(pg.compile_image(SOURCE, _flags()))
    try:
        assert list(p.tracepoint_fds) == [(b"syscalls:sys_enter_getppid",
                                           b"tracepoint__syscalls__sys_enter_getppid")]
        getppid = ct.CDLL(None).getppid
        for _ in range(3):
            getppid()
        h, a, pc = p["h"], p["a"], p[b"pc"]
        assert [k.value for k in h.keys()] == [os.getpid()]
        assert h[h.Key(os.getpid())].value == 1
        del h[h.Key(os.getpid())]
        assert len(list(h.keys())) == 0
        assert a[1].value == 21 and a[0].value == 0
        a[a.Key(2)] = a.Leaf(5)
        assert a[2].value == 5
        assert sum(pc[pc.Key(1)]) == 3
        lru = p["lru"]
        lru[lru.Key(9)] = lru.Leaf(x=3, y=(ct.c_uint64 * 3)(4, 5, 6))
        assert lru[lru.Key(9)].x == 3 and list(lru[lru.Key(9)].y) == [4, 5, 6]
        ring = RingReader(p, "ring")
        assert ring.read_fixed(ct.c_uint64).tolist() == [42, 42, 42]
        ring.close()
        with pytest.raises(KeyError):
            p["nothing"]
        with pytest.raises(pg.LoadError, match="unknown BPF program"):
            p.load_func("nothing", pg.PROG_KPROBE)
    finally:
        p.cleanup()


@pytest.mark.bpf
def test_programs_sharing_a_tracepoint_are_each_detached() -> None:
    """Two programs on one tracepoint (the stacks' and the lifecycle's sys_exit_mmap):
    each attachment is kept and closed. One kept by tracepoint name alone lost the
    first, still attached until memtrack exited, whose exit then waited ~40 ms for each
    such perf event."""
    source = "int first(void *ctx) { return 0; }\nint second(void *ctx) { return 0; }\n"
    p = pg.Program(pg.compile_image(source, []))
    try:
        for fn in ("first", "second"):
            p.attach_tracepoint(tp="syscalls:sys_enter_getppid", fn_name=fn)
        fds = list(p.tracepoint_fds.values())
        assert sorted(p.tracepoint_fds) == [(b"syscalls:sys_enter_getppid", b"first"),
                                            (b"syscalls:sys_enter_getppid", b"second")]
        assert len(set(fds)) == 2
    finally:
        p.cleanup()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.bpf
def test_capture_from_the_cache_records_what_a_compiled_one_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrack.capture.tracker import Tracker
    from memtrack.schema.artifact import Artifact

    exe = build(["capture/allocs.c"])
    options = CaptureOptions(program_cache=str(tmp_path / "bpf"))
    runs = []
    for attempt in ("compiled", "cached"):
        with Tracker(options) as t:
            result = t.spawn([str(exe), "misc"], tmp_path / f"{attempt}.memtrack",
                             env={**os.environ}).wait(timeout=60)
        assert result.status == 0 and result.nonzero_losses() == {}
        events = Artifact.open(tmp_path / f"{attempt}.memtrack").read("events").table
        runs.append([(e["kind"], e["size"]) for e in events.to_pylist()
                     if e["kind"] <= EventKind.FREE])
        if attempt == "compiled":
            assert len(list((tmp_path / "bpf").glob("*.json"))) == 1

            def no_compile(*_: Any) -> pg.Image:
                raise AssertionError("compiled although the cache holds the program")

            monkeypatch.setattr(pg, "compile_image", no_compile)
    assert runs[0] == runs[1] and len(runs[0]) > 5


@pytest.mark.bpf
def test_loops_on_the_kernel_iterator_record_what_bounded_loops_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """common.h MT_LOOP both ways: on the kernel's number iterator (this kernel) and as
    bounded loops (a kernel before 6.7). Both builds hash what `process` recomputes
    from their records (decode: no mismatch, so both compute the one hash function),
    and the two runs have the same events with their stacks grouped alike, native and
    Python; the verifier walks a fraction of the instructions for mt_alloc, the start-up
    cost of a capture with stacks. (Equal native hashes across two runs need the two
    processes to leave the same words on their stacks: ASLR off gives that on a quiet
    machine; in one loaded full run the native hashes differed from the first event on,
    which the old comparison could not tell from a wrong hash, and the record check
    can.)"""
    from memtrack.capture.tracker import Tracker
    from memtrack.process.decode import decode_table
    from memtrack.schema.artifact import Artifact

    assert pg.iterators_possible(), "this kernel (6.7+, BTF) has the number iterator"
    exe = build(["capture/allocs.c"])
    script = ("def f(n):\n"
              "    return [bytearray(1000 + n) for _ in range(3)] if n == 0 else f(n - 1)\n"
              "f(20)")
    options = CaptureOptions(program_cache="off")
    runs, verified = {}, {}
    for flavour in ("iterator", "bounded"):
        if flavour == "bounded":
            monkeypatch.setattr(pg, "iterators_possible", lambda: False)
        with Tracker(options) as t:
            for name, cmd in (("native", [str(exe), "misc"]),
                              ("python", [sys.executable, "-c", script])):
                out = tmp_path / f"{flavour}-{name}.memtrack"
                # the same addresses in both runs (a stack hash covers them)
                result = t.spawn(["setarch", "-R", *cmd], out,
                                 env={**os.environ, "PYTHONHASHSEED": "0"}).wait(timeout=60)
                assert result.status == 0 and result.nonzero_losses() == {}
                art = Artifact.open(out)
                decoded = decode_table(art.read("stacks").table).counters
                assert decoded["stack_records"] > 0 and decoded["decode_mismatch"] == 0 and \
                    decoded["decode_bad_payload"] == 0, (flavour, name, decoded)
                events = art.read("events").table.to_pylist()
                execs = [i for i, e in enumerate(events) if e["kind"] == EventKind.EXEC]
                runs[flavour, name] = [(e["kind"], e["size"], e["stack_hash"])
                                       for e in events[execs[-1]:]  # setarch's are not
                                       if e["kind"] <= EventKind.FREE]
            verified[flavour] = pg.prog_info(t.bpf.funcs[b"mt_alloc"].fd)["verified_insns"]

    def grouped(key: tuple[str, str]) -> list[tuple[int, int, int]]:
        """(kind, size, the first event with the same stack hash; -1: none)."""
        first: dict[int, int] = {}
        return [(kind, size, first.setdefault(h, i) if h else -1)
                for i, (kind, size, h) in enumerate(runs[key])]

    # a Python stack's hash covers the process's pid: compared as a grouping only
    for name in ("native", "python"):
        assert grouped(("iterator", name)) == grouped(("bounded", name)), name
    assert all(sum(1 for *_, h in runs[key] if h) > 3 for key in runs)
    assert verified["iterator"] * 3 < verified["bounded"], verified


@pytest.mark.bpf
@pytest.mark.parametrize("budget", [512 << k for k in range(7)])
def test_every_stack_budget_builds_and_loads(budget: int) -> None:
    """Every program --stack-budget can make (512..32768 bytes, rounded up to a power of
    two): the budget sizes the stack loops, and at some sizes clang unrolled a loop and
    spilled it past the 512-byte BPF stack (a compile error at a few budgets only)."""
    from memtrack.capture.tracker import Tracker

    with Tracker(CaptureOptions(stack_budget=budget, program_cache="off")) as t:
        assert t.uprobes.wait()["mt_alloc"] >= 0


@pytest.mark.bpf
def test_a_program_refused_on_the_loading_thread_fails_the_capture_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator programs load beside the spawn (links.UprobeLinks): a refusal there
    is the capture's error at its first attach, the program never ran, and the
    traced command is not left behind."""
    from memtrack.capture.tracker import CaptureError, Tracker

    load_func = pg.Program.load_func

    def refuse(self: pg.Program, name: str | bytes, *args: Any, **kw: Any) -> pg.Function:
        if name in ("mt_alloc", b"mt_alloc"):
            raise pg.LoadError("Failed to load BPF program mt_alloc: Argument list too long")
        return load_func(self, name, *args, **kw)

    monkeypatch.setattr(pg.Program, "load_func", refuse)
    marker = tmp_path / "ran"
    with Tracker(CaptureOptions()) as t, pytest.raises(CaptureError, match="mt_alloc"):
        t.spawn(["sh", "-c", f"touch {marker}"], tmp_path / "x.memtrack",
                env={**os.environ}).wait(timeout=60)
    assert not marker.exists()


@pytest.mark.bpf
def test_slow_loading_is_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    out = io.StringIO()
    with pg.SlowNote(out, "loading the BPF programs"):
        pass
    assert out.getvalue() == ""
    # The note fires half a second in: during the (slowed) compile, well after the
    # cache lookup; then during a load from the cache.
    monkeypatch.setattr(pg, "SLOW_S", 0.5)
    compile_image = pg.compile_image

    def slow_compile(text: str, cflags: list[str],
                     kfuncs: dict[int, int] | None = None) -> pg.Image:
        time.sleep(1.0)
        return compile_image(text, cflags, kfuncs)

    monkeypatch.setattr(pg, "compile_image", slow_compile)
    cache = pg.ProgramCache(tmp_path / "bpf")
    assert cache.usable() is None
    for expected in ("compiling the BPF programs; later runs load them from the cache",
                     "loading the BPF programs"):
        out = io.StringIO()
        with pg.SlowNote(out, "loading the BPF programs") as note:
            pg.load_program(SOURCE, _flags(), cache, note=note).cleanup()
            time.sleep(1.0)
        assert out.getvalue() == f"memtrack: {expected}...\n"


def test_command_checked_before_anything_loads(tmp_path: Path) -> None:
    from memtrack.capture.tracker import CaptureError, find_command

    assert os.path.samefile(find_command("sh"), shutil.which("sh") or "")
    with pytest.raises(CaptureError, match="cannot run ./nonexistent-prog: No such file"):
        find_command("./nonexistent-prog")
    with pytest.raises(CaptureError, match="cannot run nonexistent-prog: command not found"):
        find_command("nonexistent-prog")
    script = tmp_path / "s.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(CaptureError, match="Permission denied"):
        find_command(str(script))
    with pytest.raises(CaptureError, match="Is a directory"):
        find_command(str(tmp_path))
    os.chmod(script, 0o755)
    assert os.path.samefile(find_command("./s.sh", cwd=tmp_path), script)
    r = subprocess.run([sys.executable, "-m", "memtrack.cli", "capture", "-o",
                        str(tmp_path / "x"), "--program-cache", str(tmp_path / "bpf"), "--",
                        "./nonexistent-prog"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "memtrack: cannot run ./nonexistent-prog: No such file or directory"
    assert not (tmp_path / "bpf").exists() and not (tmp_path / "x").exists()
