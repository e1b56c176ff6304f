"""RSS, --track-faults and memory_metadata.json end to end through the capture core's
Tracker: each fixture's peaks against what it read from /proc/self/status itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from conftest import build
from support.capture import spawn
from support.rss import Mark, MiB, close, parse_marks

from memtrack.capture.options import CaptureOptions
from memtrack.commands.info import collect_info
from memtrack.process.lifecycle import of_artifact
from memtrack.process.metadata import write_memory_metadata
from memtrack.process.read import read_artifact
from memtrack.process.rss import peaks_by_pid, resident, rss_peaks
from memtrack.schema import EventKind, RssMember
from memtrack.schema.artifact import Artifact

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def tracker() -> Any:
    from memtrack.capture.tracker import Tracker

    with Tracker(CaptureOptions(stacks=False, track_faults=True, modules=False)) as t:
        assert not [w for w in t.warnings if "RSS" in w or "faults" in w]
        yield t


@pytest.fixture(scope="module")
def workloads() -> Path:
    return build(["rss/rss_workloads.c"], flags=("-O1",))


class Run:
    def __init__(self, tracker: Any, tmp_path: Path, cmd: list[str]) -> None:
        out = tmp_path / "stdout"
        self.path = tmp_path / "run.memtrack"
        self.result = spawn(tracker, cmd, self.path, out)
        assert self.result.status == 0
        assert self.result.nonzero_losses() == {}
        self.stdout = out.read_text()
        self.marks: dict[str, Mark] = parse_marks(self.stdout)
        self.art = Artifact.open(self.path)
        tables = read_artifact(self.art)
        self.events = tables.events
        res = resident(tables, self.art.manifest, of_artifact(tables, self.art.manifest))
        self.timeline = res.rss
        self.peaks = peaks_by_pid(rss_peaks(self.timeline))
        assert res.replay is not None
        self.replay = res.replay

    def kind(self, kind: EventKind) -> list[dict]:
        return self.events.filter(pc.equal(self.events["kind"], int(kind))).to_pylist()

    def anon_at(self, pid: int, ts: int) -> int:
        t = self.timeline
        sel = pc.and_(pc.and_(pc.equal(t["pid"], pid), pc.equal(t["member"], int(RssMember.ANON))),
                      pc.less_equal(t["ts"], ts))
        return t.filter(sel)["bytes"][-1].as_py()

    def replay_at(self, pid: int, ts: int) -> int:
        t = self.replay.timeline
        sel = pc.and_(pc.equal(t["pid"], pid), pc.less_equal(t["ts"], ts))
        return t.filter(sel)["bytes"][-1].as_py()


def test_anon_64mib_with_fault_replay(tracker: Any, workloads: Path, tmp_path: Path) -> None:
    r = Run(tracker, tmp_path, [str(workloads), "anon"])
    pid = r.result.pid
    peak, base, after = r.marks["peak"], r.marks["base"], r.marks["after"]
    assert peak.pid == pid
    anon = r.peaks[pid]["anon"]["bytes"]
    assert close(anon, peak.anon, 0.05), (anon, peak)
    assert close(anon - base.anon, 64 * MiB, 0.05)
    assert close(r.peaks[pid]["total"]["bytes"], peak.vmrss, 0.05)
    (unmap,) = [e for e in r.kind(EventKind.MUNMAP) if e["size"] == 64 * MiB]
    assert abs(r.anon_at(pid, unmap["ts"]) - after.anon) < 0.05 * 64 * MiB
    # --track-faults: the replay agrees with rss_stat within 10 %, before and after
    assert close(r.replay.peaks[pid]["bytes"], anon, 0.10), (r.replay.peaks[pid], anon)
    assert abs(r.replay_at(pid, unmap["ts"]) - after.anon) < 0.10 * 64 * MiB
    assert r.replay.caveats[pid] == []
    # the process's exit resets it
    assert r.timeline["bytes"][-1].as_py() == 0


def test_file_memfd_and_replay_ignores_shared(tracker: Any, workloads: Path,
                                              tmp_path: Path) -> None:
    r = Run(tracker, tmp_path, [str(workloads), "file", str(tmp_path / "data")])
    pid = r.result.pid
    assert close(r.peaks[pid]["file"]["bytes"], r.marks["peak"].file, 0.05)
    assert close(r.peaks[pid]["file"]["bytes"] - r.marks["base"].file, 32 * MiB, 0.05)
    assert close(r.peaks[pid]["total"]["bytes"], r.marks["peak"].vmrss, 0.05)
    m = Run(tracker, tmp_path / "m", [str(workloads), "memfd"]) if (tmp_path / "m").mkdir() \
        is None else None
    assert m is not None
    pid = m.result.pid
    assert close(m.peaks[pid]["shmem"]["bytes"], m.marks["peak"].shmem, 0.05)
    assert close(m.peaks[pid]["total"]["bytes"], m.marks["peak"].vmrss, 0.05)
    # memfd pages are shmem: the anon replay stays near the baseline
    assert m.replay.peaks[pid]["bytes"] < m.marks["peak"].anon + MiB


def test_fork_child_seeded_from_parent(tracker: Any, workloads: Path, tmp_path: Path) -> None:
    r = Run(tracker, tmp_path, [str(workloads), "fork"])
    parent, child = r.result.pid, r.marks["child-peak"].pid
    assert r.marks["parent-peak"].pid == parent and child != parent
    (fk,) = [e for e in r.kind(EventKind.FORK) if e["addr"] == child]
    first = r.timeline.filter(pc.equal(r.timeline["pid"], child)).slice(0, 1).to_pylist()[0]
    assert first["ts"] == fk["ts"] and first["cause"] == 2
    assert close(r.anon_at(child, fk["ts"]), r.marks["parent-peak"].anon, 0.05)
    for pid, mark in ((parent, r.marks["parent-peak"]), (child, r.marks["child-peak"])):
        pk = r.peaks[pid]
        assert close(pk["anon"]["bytes"], mark.anon, 0.05), (pid, pk, mark)
        assert close(pk["total"]["bytes"], mark.vmrss, 0.05), (pid, pk, mark)
        assert close(r.replay.peaks[pid]["bytes"], pk["anon"]["bytes"], 0.10), \
            (pid, r.replay.peaks[pid], pk)
    assert close(r.peaks[child]["anon"]["bytes"], 48 * MiB, 0.05)


def test_madvise_and_mremap(tracker: Any, workloads: Path, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    r = Run(tracker, tmp_path / "d", [str(workloads), "madvise"])
    pid = r.result.pid
    assert close(r.peaks[pid]["anon"]["bytes"], r.marks["peak"].anon, 0.05)
    assert close(r.peaks[pid]["total"]["bytes"], r.marks["peak"].vmrss, 0.05)
    (mad,) = r.kind(EventKind.MADVISE)
    assert close(r.anon_at(pid, mad["ts"]), r.marks["hole"].anon, 0.05)
    assert close(r.replay.peaks[pid]["bytes"], r.peaks[pid]["anon"]["bytes"], 0.10)
    assert close(r.replay_at(pid, mad["ts"]), r.marks["hole"].anon, 0.10)
    (unmap,) = [e for e in r.kind(EventKind.MUNMAP) if e["size"] == 64 * MiB]
    assert close(r.replay_at(pid, unmap["ts"] - 1), r.marks["refill"].anon, 0.10)
    assert abs(r.replay_at(pid, unmap["ts"]) - r.marks["after"].anon) < MiB

    (tmp_path / "r").mkdir()
    r = Run(tracker, tmp_path / "r", [str(workloads), "mremap"])
    pid = r.result.pid
    assert close(r.peaks[pid]["anon"]["bytes"], r.marks["peak"].anon, 0.05)
    assert close(r.peaks[pid]["total"]["bytes"], r.marks["peak"].vmrss, 0.05)
    (mr,) = r.kind(EventKind.MREMAP)
    assert close(r.replay.peaks[pid]["bytes"], r.peaks[pid]["anon"]["bytes"], 0.10)
    # the moved pages left with the mapping: after the munmap the replay is back down
    (unmap,) = [e for e in r.kind(EventKind.MUNMAP) if e["addr"] == mr["addr"]]
    assert abs(r.replay_at(pid, unmap["ts"]) - r.marks["after"].anon) < MiB


def test_transparent_huge_pages(tracker: Any, workloads: Path, tmp_path: Path) -> None:
    r = Run(tracker, tmp_path, [str(workloads), "thp"])
    pid = r.result.pid
    peak = r.marks["peak"]
    if peak.thp < 32 * MiB:
        pytest.skip(f"the kernel gave only {peak.thp >> 20} MiB of huge pages (THP off?)")
    assert close(r.peaks[pid]["anon"]["bytes"], peak.anon, 0.05)
    # one fault per 2 MiB window: the replay counts each as a whole huge page
    assert r.replay.huge_windows >= peak.thp >> 21
    assert close(r.replay.peaks[pid]["bytes"], r.peaks[pid]["anon"]["bytes"], 0.10)
    assert any(c.startswith("thp-inferred") for c in r.replay.caveats[pid])


def test_pipeline_metadata_and_info(tracker: Any, tmp_path: Path) -> None:
    data = tmp_path / "words"
    data.write_text("memtrack follows pipelines\n" * 1000)
    cmd = ["sh", "-c", f"cat {data} | tr a-z A-Z | wc -c"]
    r = Run(tracker, tmp_path, cmd)
    assert r.stdout.strip() == str(27 * 1000)
    out = write_memory_metadata(r.art, tmp_path / "memory_metadata.json")
    meta = json.loads(out.read_text())
    assert any("swap-out" in x for x in meta["anon_replay_limits"])
    procs = meta["processes"]
    root = r.result.pid
    assert meta["root_pid"] == root and meta["command"] == cmd
    by_comm = {p["comm"]: p for p in procs}
    assert sorted(by_comm) == ["cat", "sh", "tr", "wc"], procs
    assert len(procs) == 4
    assert by_comm["sh"]["pid"] == root and by_comm["sh"]["cmdline"] == cmd
    for name, argv in (("cat", ["cat", str(data)]), ("tr", ["tr", "a-z", "A-Z"]),
                       ("wc", ["wc", "-c"])):
        p = by_comm[name]
        assert p["ppid"] == root, p
        assert p["cmdline"] == argv and p["exe"].endswith("/" + name)
        assert p["exit_status"] == {"code": 0, "signal": None}
        assert by_comm["sh"]["start_ns"] < p["start_ns"] < p["exit_ns"]
        assert p["peak_rss"]["total"]["bytes"] > 0
        assert p["anon_replay"]["peak"]["bytes"] > 0
    assert by_comm["sh"]["exit_status"] == {"code": 0, "signal": None}
    info = collect_info(r.path)
    rows = {x["comm"]: x for x in info["peak_rss"]}
    assert sorted(rows) == ["cat", "sh", "tr", "wc"]
    tl = r.timeline.to_pylist()
    for name, x in rows.items():
        peak = by_comm[name]["peak_rss"]
        assert x["total"] == peak["total"]["bytes"] > 0
        assert [x[m] for m in ("anon", "file", "shmem", "swap")] == [
            peak[m]["bytes"] if m in peak else 0 for m in ("anon", "file", "shmem", "swap")]
        # the total's peak is file + anon + shmem as of that moment: no member above
        # its own peak, the sum exactly the total
        pid, ts = by_comm[name]["pid"], peak["total"]["ts"]
        assert x["at_s"] == pytest.approx((ts - r.art.manifest.start_ns) / 1e9)
        now: dict[int, int] = {}
        members = (RssMember.ANON, RssMember.FILE, RssMember.SHMEM)
        seen = []
        for row in tl:
            if row["pid"] != pid or row["ts"] > ts:
                continue
            now[row["member"]] = row["bytes"]
            if row["ts"] == ts:
                seen.append([now.get(int(m), 0) for m in members])
        at_peak = [v for v in seen if sum(v) == x["total"]]
        assert at_peak, (name, seen, x)
        assert all(v <= x[m] for v, m in zip(at_peak[0], ("anon", "file", "shmem"),
                                              strict=True))
