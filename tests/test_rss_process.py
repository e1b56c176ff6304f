"""RSS timeline rules, peaks, the fault replay and memory_metadata.json on synthetic data."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from support import synth
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.process.anon_replay import reconstruct_anon
from memtrack.process.lifecycle import lifecycle
from memtrack.process.metadata import memory_metadata, write_memory_metadata
from memtrack.process.rss import effective_rss, peaks_by_pid, rss_peaks
from memtrack.schema import EVENTS, FAULTS, MAPPINGS, PROCESSES, RSS, EventKind, RssMember
from memtrack.schema.artifact import Artifact, ArtifactWriter
from memtrack.schema.enums import (
    MADV_DONTNEED,
    MADV_FREE,
    MADV_HUGEPAGE,
    MAP_ANONYMOUS,
    MAP_POPULATE,
    MAP_PRIVATE,
    MAP_SHARED,
    RssCause,
)

P = 4096
ANON, FILE, SHMEM = RssMember.ANON, RssMember.FILE, RssMember.SHMEM
PROT_RW = 0x3 << 32
NONE = 2**64 - 1


def events(*rows: dict) -> pa.Table:
    base = {"tid": 0, "allocator": 0, "flags": 0, "addr": 0, "old_addr": 0, "size": 0,
            "stack_hash": 0}
    full = [{**base, "tid": r["pid"], **r} for r in rows]
    return pa.Table.from_pylist(full, schema=EVENTS)


def rss(*rows: tuple) -> pa.Table:
    """(ts, pid, member, bytes[, external])"""
    return pa.Table.from_pylist(
        [{"ts": r[0], "pid": r[1], "member": int(r[2]), "bytes": r[3],
          "external": len(r) > 4 and r[4]} for r in rows], schema=RSS)


def faults(*rows: tuple) -> pa.Table:
    """(ts, pid, address, error_code)"""
    return pa.Table.from_pylist(
        [{"ts": r[0], "pid": r[1], "tid": r[1], "address": r[2], "error_code": r[3],
          "kernel": False} for r in rows], schema=FAULTS)


def fork(ts: int, parent: int, child: int) -> dict:
    return {"ts": ts, "pid": parent, "kind": EventKind.FORK, "addr": child, "flags": 0x11}


def series(tl: pa.Table, pid: int, member: RssMember) -> list[tuple[int, int, int]]:
    return [(r["ts"], r["bytes"], r["cause"]) for r in tl.to_pylist()
            if r["pid"] == pid and r["member"] == member]


def test_external_updates_only_lower_and_need_a_base() -> None:
    tl = effective_rss(rss((1, 10, ANON, 500, True), (2, 10, ANON, 100), (3, 10, ANON, 200, True),
                          (4, 10, ANON, 50, True), (5, 10, ANON, 80, True),
                          (6, 10, ANON, 300), (7, 10, ANON, 400, True)), lifecycle(events()))
    assert series(tl, 10, ANON) == [(2, 100, 0), (3, 100, 1), (4, 50, 1), (5, 50, 1),
                                    (6, 300, 0), (7, 300, 1)]
    assert peaks_by_pid(rss_peaks(tl))[10]["anon"] == {"bytes": 300, "ts": 6}


def test_fork_seeds_children_and_grandchildren_exec_and_exit_reset() -> None:
    ev = events(fork(5, 10, 11), fork(8, 11, 12),
                {"ts": 9, "pid": 12, "kind": EventKind.EXEC, "addr": 12},
                {"ts": 20, "pid": 11, "kind": EventKind.EXIT, "flags": 1, "size": 0})
    tl = effective_rss(rss((1, 10, ANON, 1000), (2, 10, FILE, 500), (6, 10, ANON, 2000),
                          (7, 11, ANON, 1500), (10, 12, ANON, 64),
                          (21, 11, ANON, 0, True), (22, 11, ANON, 9999)), lifecycle(ev))
    assert series(tl, 11, ANON) == [(5, 1000, RssCause.FORK), (7, 1500, 0),
                                    (20, 0, RssCause.EXIT)]
    assert series(tl, 11, FILE) == [(5, 500, RssCause.FORK), (20, 0, RssCause.EXIT)]
    assert series(tl, 12, ANON) == [(8, 1500, RssCause.FORK), (9, 0, RssCause.EXEC),
                                    (10, 64, 0)]
    assert series(tl, 12, FILE) == [(8, 500, RssCause.FORK), (9, 0, RssCause.EXEC)]
    peaks = peaks_by_pid(rss_peaks(tl))
    assert peaks[11]["anon"] == {"bytes": 1500, "ts": 7}
    assert peaks[11]["total"] == {"bytes": 2000, "ts": 7}
    assert peaks[10]["total"] == {"bytes": 2500, "ts": 6}
    assert peaks[12]["anon"] == {"bytes": 1500, "ts": 8}
    assert set(peaks[12]) == {"anon", "file", "total"}


A = 0x7F0000000000  # 2 MiB aligned


def mmap(ts: int, pid: int, addr: int, pages: int, flags: int, fd: int = NONE) -> dict:
    return {"ts": ts, "pid": pid, "kind": EventKind.MMAP, "addr": addr, "size": pages * P,
            "flags": flags | PROT_RW, "old_addr": fd}


def writes(ts: int, pid: int, addr: int, pages: int, code: int = 6) -> list[tuple]:
    return [(ts, pid, addr + i * P, code) for i in range(pages)]


def final(rep, pid: int) -> int:
    return [r["bytes"] for r in rep.timeline.to_pylist() if r["pid"] == pid][-1]


def test_replay_counts_private_writes_only_and_unmap() -> None:
    B = A + (1 << 30)
    ev = events(mmap(1, 10, A, 64, MAP_PRIVATE | MAP_ANONYMOUS),
                mmap(2, 10, B, 16, MAP_SHARED, fd=3),
                {"ts": 20, "pid": 10, "kind": EventKind.MUNMAP, "addr": A, "size": 32 * P})
    fl = faults(*writes(3, 10, A, 64), *writes(4, 10, A, 64),  # second pass: no new page
                *writes(5, 10, B, 16),  # shared: shmem, not anon
                (6, 10, A + (1 << 28), 4),  # read fault: zero page
                (7, 10, A + (1 << 28), 7))  # write to the zero page: a real page
    rep = reconstruct_anon(fl, ev, MAPPINGS.empty_table(), lifecycle(ev), thp="never")
    assert rep.peaks[10] == {"bytes": 65 * P, "ts": 7}
    assert final(rep, 10) == 33 * P
    assert rep.caveats[10] == []


def test_replay_madvise_mremap_brk() -> None:
    C = A + (1 << 31)
    ev = events(mmap(1, 10, A, 100, MAP_PRIVATE | MAP_ANONYMOUS),
                {"ts": 3, "pid": 10, "kind": EventKind.MADVISE, "addr": A + 10 * P,
                 "size": 40 * P, "flags": MADV_DONTNEED},
                {"ts": 4, "pid": 10, "kind": EventKind.MADVISE, "addr": A + 60 * P,
                 "size": 10 * P, "flags": MADV_FREE},
                {"ts": 6, "pid": 10, "kind": EventKind.MREMAP, "addr": C, "old_addr": A,
                 "size": 150 * P, "flags": 3 | (100 * P) << 8},
                {"ts": 8, "pid": 10, "kind": EventKind.MUNMAP, "addr": A, "size": 100 * P},
                {"ts": 9, "pid": 10, "kind": EventKind.BRK, "addr": 0x600000 + 8 * P,
                 "old_addr": 0x600000},
                {"ts": 11, "pid": 10, "kind": EventKind.BRK, "addr": 0x600000 + 2 * P,
                 "old_addr": 0x600000 + 8 * P})
    fl = faults(*writes(2, 10, A, 100),
                *writes(7, 10, C, 150),  # 60 moved resident: the hole and the growth are new
                *writes(10, 10, 0x600000, 8))
    rep = reconstruct_anon(fl, ev, MAPPINGS.empty_table(), lifecycle(ev), thp="never")
    tl = {r["ts"]: r["bytes"] for r in rep.timeline.to_pylist()}
    assert tl[2] == 100 * P and tl[3] == 60 * P and 4 not in tl  # FREE keeps pages
    assert tl[7] == 150 * P
    assert 8 not in tl  # the old range is empty after the move
    assert tl[10] == 158 * P and tl[11] == 152 * P
    assert rep.caveats[10] == ["madv-free: lazily freed pages leave RSS only on reclaim, "
                               "which faults miss"]


def test_replay_fork_inherits_exec_resets() -> None:
    ev = events(mmap(1, 10, A, 10, MAP_PRIVATE | MAP_ANONYMOUS), fork(3, 10, 11),
                {"ts": 6, "pid": 11, "kind": EventKind.EXEC, "addr": 11},
                {"ts": 8, "pid": 11, "kind": EventKind.EXIT, "flags": 1})
    fl = faults(*writes(2, 10, A, 10),
                *writes(4, 11, A, 10, code=7),  # copy on write: no change
                *writes(5, 11, A + 20 * P, 5),  # beyond: new pages
                *writes(7, 11, A, 3))
    rep = reconstruct_anon(fl, ev, MAPPINGS.empty_table(), lifecycle(ev), thp="never")
    child = [(r["ts"], r["bytes"]) for r in rep.timeline.to_pylist() if r["pid"] == 11]
    assert child == [(3, 10 * P), (5, 15 * P), (6, 0), (7, 3 * P), (8, 0)]
    assert rep.peaks[11] == {"bytes": 15 * P, "ts": 5}
    assert rep.peaks[10] == {"bytes": 10 * P, "ts": 2}


def test_replay_huge_pages_where_eligible() -> None:
    win = 512
    ev = events(mmap(1, 10, A, 3 * win, MAP_PRIVATE | MAP_ANONYMOUS),
                {"ts": 2, "pid": 10, "kind": EventKind.MADVISE, "addr": A, "size": 2 * win * P,
                 "flags": MADV_HUGEPAGE},
                mmap(8, 10, A + (1 << 30), 4, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE))
    fl = faults((3, 10, A + 5 * P, 6),  # one fault maps the whole first window
                *writes(4, 10, A + win * P, 20),  # many faults: the huge allocation failed
                (5, 10, A + 2 * win * P, 6))  # not madvised: a small page
    rep = reconstruct_anon(fl, ev, MAPPINGS.empty_table(), lifecycle(ev), thp="madvise")
    assert rep.huge_windows == 1
    assert rep.peaks[10]["bytes"] == (win + 20 + 1 + 4) * P
    rep = reconstruct_anon(fl, ev, MAPPINGS.empty_table(), lifecycle(ev), thp="always")
    assert rep.huge_windows == 2  # the third window too
    assert rep.peaks[10]["bytes"] == (2 * win + 20 + 4) * P


def test_replay_snapshot_sets_mapping_kinds() -> None:
    maps = pa.Table.from_pylist([
        {"ts": 1, "pid": 10, "start": A, "end": A + 8 * P, "offset": 0, "perms": "rw-s",
         "dev": "00:01", "inode": 7, "path": "/memfd:x (deleted)", "build_id": None},
        {"ts": 1, "pid": 10, "start": A + 8 * P, "end": A + 16 * P, "offset": 0,
         "perms": "rw-p", "dev": "00:00", "inode": 0, "path": "", "build_id": None},
    ], schema=MAPPINGS)
    fl = faults(*writes(2, 10, A, 16))
    rep = reconstruct_anon(fl, events(), maps, lifecycle(events()), thp="never")
    assert rep.peaks[10]["bytes"] == 8 * P


def pipeline_artifact(path: Path) -> Artifact:
    w = ArtifactWriter(path)
    m = w.manifest
    m.command, m.root_pid, m.start_ns, m.end_ns = ["sh", "-c", "cat f | tr a b | wc -c"], 100, 1, 99
    m.exit_status.code = 0
    w.write("processes", pa.Table.from_pylist([
        {"ts": 1, "pid": 100, "ppid": 1, "comm": "sh", "exe": "/usr/bin/dash",
         "cmdline": ["sh", "-c", "cat f | tr a b | wc -c"]},
        {"ts": 11, "pid": 101, "ppid": 100, "comm": "cat", "exe": "/usr/bin/cat",
         "cmdline": ["cat", "f"]},
        {"ts": 12, "pid": 102, "ppid": 100, "comm": "tr", "exe": "/usr/bin/tr",
         "cmdline": ["tr", "a", "b"]},
        {"ts": 13, "pid": 103, "ppid": 100, "comm": "wc", "exe": "/usr/bin/wc",
         "cmdline": ["wc", "-c"]},
    ], schema=PROCESSES))
    w.write("events", events(
        fork(2, 100, 101), fork(3, 100, 102), fork(4, 100, 103), fork(5, 100, 104),
        {"ts": 11, "pid": 101, "kind": EventKind.EXEC, "addr": 101},
        {"ts": 12, "pid": 102, "kind": EventKind.EXEC, "addr": 102},
        {"ts": 13, "pid": 103, "kind": EventKind.EXEC, "addr": 103},
        {"ts": 20, "pid": 101, "kind": EventKind.EXIT, "flags": 1, "size": 0},
        {"ts": 21, "pid": 102, "kind": EventKind.EXIT, "flags": 1, "size": 13},
        {"ts": 22, "pid": 103, "kind": EventKind.EXIT, "flags": 1, "size": 3 << 8},
        {"ts": 23, "pid": 104, "kind": EventKind.EXIT, "flags": 1, "size": 0},
        {"ts": 30, "pid": 100, "kind": EventKind.EXIT, "flags": 1, "size": 0},
    ))
    w.write("rss", rss((14, 101, ANON, 4 * P), (15, 101, FILE, 10 * P), (16, 101, ANON, 2 * P),
                       (17, 103, SHMEM, 3 * P)))
    w.close()
    return Artifact.open(path)


def test_memory_metadata_for_a_pipeline(tmp_path: Path) -> None:
    art = pipeline_artifact(tmp_path / "p.memtrack")
    out = write_memory_metadata(art, tmp_path / "memory_metadata.json")
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(memory_metadata(art)))
    procs = {p["pid"]: p for p in data["processes"]}
    assert [p["pid"] for p in data["processes"]] == [100, 101, 102, 103, 104]
    assert {p: (procs[p]["comm"], procs[p]["ppid"]) for p in procs} == {
        100: ("sh", 1), 101: ("cat", 100), 102: ("tr", 100), 103: ("wc", 100),
        104: ("sh", 100)}  # 104 never exec'd: the subshell is its parent's copy
    assert procs[101]["cmdline"] == ["cat", "f"] and procs[101]["exe"] == "/usr/bin/cat"
    assert (procs[101]["start_ns"], procs[101]["exit_ns"]) == (2, 20)
    assert procs[100]["start_ns"] == 1 and procs[100]["exit_ns"] == 30
    assert procs[101]["exec_ns"] == [11] and procs[104]["exec_ns"] == []
    assert [h["comm"] for h in procs[101]["history"]] == ["cat"]
    assert procs[102]["exit_status"] == {"code": None, "signal": 13}
    assert procs[103]["exit_status"] == {"code": 3, "signal": None}
    assert procs[100]["exit_status"] == {"code": 0, "signal": None}
    assert procs[101]["peak_rss"]["anon"] == {"bytes": 4 * P, "ts": 14}
    assert procs[101]["peak_rss"]["total"] == {"bytes": 14 * P, "ts": 15}
    assert procs[103]["peak_rss"]["shmem"] == {"bytes": 3 * P, "ts": 17}
    assert procs[102]["peak_rss"] == {}
    assert "anon_replay" not in procs[101]


def test_reused_pid_gets_a_second_life(tmp_path: Path) -> None:
    ev = events(fork(2, 100, 101), {"ts": 5, "pid": 101, "kind": EventKind.EXIT, "flags": 1},
                fork(8, 100, 101), {"ts": 12, "pid": 101, "kind": EventKind.EXIT, "flags": 1,
                                    "size": 9})
    r = rss((1, 100, ANON, 10 * P), (3, 101, ANON, 50 * P), (6, 101, ANON, 0, True),
            (7, 101, ANON, 99 * P), (9, 101, ANON, 20 * P))
    tl = effective_rss(r, lifecycle(ev))
    assert series(tl, 101, ANON) == [(2, 10 * P, RssCause.FORK), (3, 50 * P, 0),
                                      (5, 0, RssCause.EXIT), (8, 10 * P, RssCause.FORK),
                                      (9, 20 * P, 0), (12, 0, RssCause.EXIT)]
    w = ArtifactWriter(tmp_path / "r.memtrack")
    w.manifest.root_pid = 100
    w.write("events", ev)
    w.write("rss", r)
    w.close()
    procs = memory_metadata(Artifact.open(tmp_path / "r.memtrack"))["processes"]
    of_101 = [(p["start_ns"], p["exit_ns"], p["exit_status"], p["peak_rss"]["anon"])
              for p in procs if p["pid"] == 101]
    assert of_101 == [(2, 5, {"code": 0, "signal": None}, {"bytes": 50 * P, "ts": 3}),
                      (8, 12, {"code": None, "signal": 9}, {"bytes": 20 * P, "ts": 9})]


def test_info_and_process_agree_on_peak_rss(tmp_path: Path) -> None:
    """`info` runs the lifecycle and RSS stages `process` runs, on the same inputs: each
    pid's peak RSS (file + anon + shmem) and anon peak are the run's, through the CLI.
    A fork/exec storm (each child's RSS seeded at its fork, reset at its exec and exit)
    and synth's run (pid 200 handed out twice)."""
    runner = CliRunner()
    for art in (synth.write_storm(tmp_path / "storm.memtrack", 4),
                synth.write_artifact(tmp_path / "synth.memtrack")):
        db = art.with_suffix(".duckdb")
        r = runner.invoke(app, ["process", str(art), "-o", str(db), "-q"])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["info", str(art), "--json"])
        assert r.exit_code == 0, r.output
        info = {p["pid"]: (p["total"], p["anon"]) for p in json.loads(r.stdout)["peak_rss"]}
        r = runner.invoke(app, ["query", str(db), "SELECT pid, max(rss) AS total, max(anon) "
                                "AS anon FROM rss_timeline GROUP BY pid ORDER BY pid",
                                "--format", "json"])
        assert r.exit_code == 0, r.output
        run = {p["pid"]: (p["total"], p["anon"]) for p in json.loads(r.stdout)}
        assert info == run
        # the storm's children, synth's pid 100 and its child 200 (seeded at its fork)
        assert len(run) == (4 if art.name == "storm.memtrack" else 2)


def test_thp_mode_read_from_the_host_or_an_old_manifests_options() -> None:
    """Capture records the THP mode with the host (format 2.6); an older artifact's
    manifest kept it in options.extra, and still reads so."""
    from memtrack.process.anon_replay import thp_mode
    from memtrack.schema.manifest import Host, Manifest

    def decoded(d: dict) -> Manifest:
        return Manifest.decode(json.dumps(d).encode())

    assert thp_mode(decoded({"format_version": "2.6", "host": {"thp_enabled": "never"},
                             "options": {"rss": True}})) == "never"
    assert thp_mode(decoded({"format_version": "2.5",
                             "options": {"extra": {"thp_enabled": "always"}}})) == "always"
    assert thp_mode(decoded({"format_version": "2.5", "options": {"extra": {}}})) == "madvise"
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert f"[{Host.current().thp_enabled}]" in text
