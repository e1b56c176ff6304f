"""RSS capture against what each fixture read from /proc/self/status at the same points.

These tests drive RssPart with a harness of their own (the capture core is not needed):
load common.h + rss.c, spawn the fixture waiting on stdin, put its pid in mt_tracked,
let it run, drain into an artifact, then check the rss_stat timeline (within 5 %) and
the --track-faults anon replay (within 10 %) against the fixture's marks.
"""

from __future__ import annotations

import ctypes as ct
import os
import subprocess
from pathlib import Path

import pytest
from conftest import build
from support.rss import MiB, close, parse_marks

from memtrack.capture.options import CaptureOptions
from memtrack.capture.parts import BPF_DIR
from memtrack.capture.rss import RssPart
from memtrack.process.lifecycle import of_artifact
from memtrack.process.read import read_artifact
from memtrack.process.rss import peaks_by_pid, resident, rss_peaks
from memtrack.schema import EventKind, RssMember
from memtrack.schema.artifact import Artifact, ArtifactWriter

# The capture core follows forks; this harness only needs the children tracked.
FOLLOW_FORKS = """
TRACEPOINT_PROBE(task, task_newtask) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (!mt_is_tracked(pid) || (args->clone_flags & 0x10000))
        return 0;
    u32 child = args->pid;
    u8 one = 1;
    mt_tracked.update(&child, &one);
    return 0;
}
"""


def harness_capture(args: list[str], out: Path, *, track_faults: bool) -> tuple[Artifact, dict]:
    from bcc import BPF

    exe = build(["rss/rss_workloads.c"], flags=("-O1",))
    part = RssPart(CaptureOptions(track_faults=track_faults))
    assert not part.warnings
    text = (BPF_DIR / "common.h").read_text() + "".join(
        (BPF_DIR / s).read_text() for s in part.sources()) + FOLLOW_FORKS
    b = BPF(text=text, cflags=part.cflags())
    try:
        assert part.attach(b) == []
        proc = subprocess.Popen([str(exe), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, "RSS_FIXTURE_WAIT": "1"})
        b["mt_tracked"][ct.c_uint32(proc.pid)] = ct.c_uint8(1)
        b["mt_config"][0] = ct.c_uint64(1)
        writer = ArtifactWriter(out)
        assert proc.stdin and proc.stdout
        proc.stdin.write(b"g")
        proc.stdin.flush()
        text_out = proc.stdout.read().decode()
        assert proc.wait() == 0
        part.drain(b, writer)
        writer.manifest.losses.update(part.losses(b))
        writer.close()
    finally:
        b.cleanup()
    art = Artifact.open(out)
    assert art.manifest.nonzero_losses() == {}
    return art, parse_marks(text_out)


def anon_at(tl, pid: int, ts: int) -> int:
    """The timeline's anon bytes of `pid` as of `ts`."""
    rows = [r for r in tl.to_pylist() if r["pid"] == pid and r["member"] == RssMember.ANON
            and r["ts"] <= ts]
    return rows[-1]["bytes"] if rows else 0


def own_updates(tl, pid: int, member: RssMember) -> list[dict]:
    return [r for r in tl.to_pylist() if r["pid"] == pid and r["member"] == member
            and r["cause"] == 0]


def analyse(art: Artifact):
    tables = read_artifact(art)
    res = resident(tables, art.manifest, of_artifact(tables, art.manifest))
    return tables.events, res.rss, peaks_by_pid(rss_peaks(res.rss)), res.replay


@pytest.mark.bpf
def test_anon_64mib_peak_and_release(tmp_path: Path) -> None:
    art, marks = harness_capture(["anon"], tmp_path / "a.memtrack", track_faults=True)
    _, tl, peaks, replay = analyse(art)
    pid = marks["peak"].pid
    anon = peaks[pid]["anon"]["bytes"]
    assert close(anon, marks["peak"].anon, 0.05), (anon, marks["peak"])
    assert close(anon - marks["base"].anon, 64 * MiB, 0.05)
    # back down after the unmap: the last update the process made itself
    last = own_updates(tl, pid, RssMember.ANON)[-1]["bytes"]
    assert abs(last - marks["after"].anon) < 0.05 * 64 * MiB
    assert peaks[pid]["total"]["bytes"] >= anon
    assert close(replay.peaks[pid]["bytes"], anon, 0.10), (replay.peaks, anon)


@pytest.mark.bpf
def test_file_backed_32mib(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    art, marks = harness_capture(["file", str(data)], tmp_path / "f.memtrack",
                                 track_faults=False)
    _, _, peaks, _ = analyse(art)
    pid = marks["peak"].pid
    got = peaks[pid]["file"]["bytes"]
    assert close(got, marks["peak"].file, 0.05), (got, marks["peak"])
    assert close(got - marks["base"].file, 32 * MiB, 0.05)
    assert close(peaks[pid]["total"]["bytes"], marks["peak"].vmrss, 0.05)
    assert not data.exists()


@pytest.mark.bpf
def test_memfd_shmem_16mib(tmp_path: Path) -> None:
    art, marks = harness_capture(["memfd"], tmp_path / "m.memtrack", track_faults=False)
    _, tl, peaks, _ = analyse(art)
    pid = marks["peak"].pid
    got = peaks[pid]["shmem"]["bytes"]
    assert close(got, marks["peak"].shmem, 0.05), (got, marks["peak"])
    assert close(got, 16 * MiB, 0.05)
    assert own_updates(tl, pid, RssMember.SHMEM)[-1]["bytes"] < MiB


@pytest.mark.bpf
def test_fork_child_inherits_and_adds(tmp_path: Path) -> None:
    art, marks = harness_capture(["fork"], tmp_path / "k.memtrack", track_faults=False)
    _, _, peaks, _ = analyse(art)
    parent, child = marks["parent-peak"].pid, marks["child-peak"].pid
    assert parent != child
    assert close(peaks[parent]["anon"]["bytes"], marks["parent-peak"].anon, 0.05)
    got = peaks[child]["anon"]["bytes"]
    assert close(got, marks["child-peak"].anon, 0.05), (got, marks["child-peak"])
    assert close(got, 48 * MiB, 0.05)


@pytest.mark.bpf
def test_madvise_dontneed_punches_a_hole(tmp_path: Path) -> None:
    art, marks = harness_capture(["madvise"], tmp_path / "d.memtrack", track_faults=True)
    ev, tl, peaks, replay = analyse(art)
    pid = marks["peak"].pid
    assert close(peaks[pid]["anon"]["bytes"], marks["peak"].anon, 0.05)
    mad = [r for r in ev.to_pylist() if r["kind"] == EventKind.MADVISE]
    assert len(mad) == 1 and mad[0]["flags"] == 4 and mad[0]["size"] == 48 * MiB
    hole = anon_at(tl, pid, mad[0]["ts"])
    assert close(hole, marks["hole"].anon, 0.05), (hole, marks["hole"])
    assert close(replay.peaks[pid]["bytes"], peaks[pid]["anon"]["bytes"], 0.10)
    rp = [r for r in replay.timeline.to_pylist() if r["ts"] <= mad[0]["ts"]][-1]["bytes"]
    assert close(rp, marks["hole"].anon, 0.10), (rp, marks["hole"])
    refill = max(r["bytes"] for r in own_updates(tl, pid, RssMember.ANON)
                 if r["ts"] > mad[0]["ts"])
    assert close(refill, marks["refill"].anon, 0.05)
    rp = max(r["bytes"] for r in replay.timeline.to_pylist() if r["ts"] > mad[0]["ts"])
    assert close(rp, marks["refill"].anon, 0.10)


@pytest.mark.bpf
def test_mremap_moves_resident_pages(tmp_path: Path) -> None:
    art, marks = harness_capture(["mremap"], tmp_path / "r.memtrack", track_faults=True)
    ev, tl, peaks, replay = analyse(art)
    pid = marks["peak"].pid
    assert close(peaks[pid]["anon"]["bytes"], marks["peak"].anon, 0.05)
    mr = [r for r in ev.to_pylist() if r["kind"] == EventKind.MREMAP]
    assert len(mr) == 1
    assert mr[0]["size"] == 48 * MiB and mr[0]["flags"] >> 8 == 32 * MiB
    assert mr[0]["flags"] & 0xFF == 3 and mr[0]["addr"] != mr[0]["old_addr"]
    assert close(replay.peaks[pid]["bytes"], peaks[pid]["anon"]["bytes"], 0.10)
