"""RssPart without BPF: tracepoint layouts from format files, what a missing or failing
tracepoint disables (with a warning, never more), and ring records into tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from memtrack.capture.options import CaptureOptions, Tuning
from memtrack.capture.rss import FAULT_DTYPE, HOOKS, RSS_DTYPE, RssPart, tracepoint_fields
from memtrack.schema import EVENT_DTYPE, EventKind
from memtrack.schema.artifact import Artifact, ArtifactWriter

COMMON = """\
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;
"""
FORMATS = {
    ("kmem", "rss_stat"): [("unsigned int mm_id", 8, 4), ("unsigned int curr", 12, 4),
                           ("int member", 16, 4), ("long size", 24, 8)],
    ("syscalls", "sys_enter_madvise"): [("int __syscall_nr", 8, 4), ("unsigned long start", 16, 8),
                                        ("size_t len_in", 24, 8), ("int behavior", 32, 8)],
    ("syscalls", "sys_exit_madvise"): [("int __syscall_nr", 8, 4), ("long ret", 16, 8)],
    ("syscalls", "sys_enter_mremap"): [("int __syscall_nr", 8, 4), ("unsigned long addr", 16, 8),
                                       ("unsigned long old_len", 24, 8),
                                       ("unsigned long new_len", 32, 8),
                                       ("unsigned long flags", 40, 8),
                                       ("unsigned long new_addr", 48, 8)],
    ("syscalls", "sys_exit_mremap"): [("int __syscall_nr", 8, 4), ("long ret", 16, 8)],
    ("exceptions", "page_fault_user"): [("unsigned long address", 8, 8),
                                        ("unsigned long ip", 16, 8),
                                        ("unsigned long error_code", 24, 8)],
    ("exceptions", "page_fault_kernel"): [("unsigned long address", 8, 8),
                                          ("unsigned long ip", 16, 8),
                                          ("unsigned long error_code", 24, 8)],
}


def tracefs(root: Path, skip: tuple[str, str] | None = None,
            shift: dict[tuple[str, str], int] | None = None) -> Path:
    for (cat, ev), fields in FORMATS.items():
        if (cat, ev) == skip:
            continue
        d = root / cat / ev
        d.mkdir(parents=True)
        extra = (shift or {}).get((cat, ev), 0)
        body = "".join(f"\tfield:{decl};\toffset:{off + extra};\tsize:{size};\tsigned:0;\n"
                       for decl, off, size in fields)
        (d / "format").write_text(f"name: {ev}\nID: 1\nformat:\n{COMMON}\n{body}\n"
                                  'print fmt: "x"\n')
    return root


def flags_of(part: RssPart) -> dict[str, str]:
    return dict(f[2:].split("=", 1) if "=" in f else (f[2:], "") for f in part.cflags())


def test_offsets_come_from_the_format_files(tmp_path: Path) -> None:
    root = tracefs(tmp_path, shift={("kmem", "rss_stat"): 8})
    assert tracepoint_fields("kmem", "rss_stat", root)["size"] == (32, 8)
    part = RssPart(CaptureOptions(track_faults=True), tracefs=root)
    assert part.warnings == []
    assert part.roles == {"rss", "events", "faults"}
    f = flags_of(part)
    assert (f["MT_OFF_RSS_MM_ID"], f["MT_OFF_RSS_CURR"], f["MT_OFF_RSS_MEMBER"],
            f["MT_OFF_RSS_SIZE"]) == ("16", "20", "24", "32")
    assert (f["MT_OFF_MREMAP_FLAGS"], f["MT_OFF_SYSEXIT_RET"], f["MT_OFF_FAULT_ERROR_CODE"]) \
        == ("40", "16", "24")
    assert "MT_TRACK_FAULTS" in f and f["MT_RSS_RING_PAGES"] == "2048"
    assert (f["MT_RSS_EVENTS_RING_PAGES"], f["MT_FAULTS_RING_PAGES"]) == ("256", "4096")
    tuned = RssPart(CaptureOptions(tuning=Tuning(rss_ring_pages=64, faults_ring_pages=128)),
                    tracefs=root)
    assert (flags_of(tuned)["MT_RSS_RING_PAGES"], flags_of(tuned)["MT_FAULTS_RING_PAGES"]) \
        == ("64", "128")
    assert RssPart(CaptureOptions(), tracefs=root).roles == {"rss", "events"}
    assert "MT_TRACK_FAULTS" not in flags_of(RssPart(CaptureOptions(), tracefs=root))


def test_missing_tracepoint_disables_only_its_piece(tmp_path: Path) -> None:
    part = RssPart(CaptureOptions(track_faults=True),
                   tracefs=tracefs(tmp_path, skip=("kmem", "rss_stat")))
    assert part.roles == {"events", "faults"}
    (w,) = part.warnings
    assert w.startswith("RSS (kmem:rss_stat) disabled: kmem:rss_stat: cannot read ")
    # its macros still get a value so the C source compiles; the function is not attached
    assert flags_of(part)["MT_OFF_RSS_SIZE"] == "8"
    assert "mt_rss_stat" not in {h.fn_name for h in part.hooks}

    part = RssPart(CaptureOptions(),
                   tracefs=tracefs(tmp_path / "b", skip=("syscalls", "sys_exit_mremap")))
    assert part.roles == {"rss"}  # an entry without its exit would emit nothing
    assert part.warnings == ["madvise/mremap events disabled: syscalls:sys_exit_mremap: "
                             f"cannot read {tmp_path}/b/syscalls/sys_exit_mremap/format "
                             "(No such file or directory)"]


def test_missing_field_is_named(tmp_path: Path) -> None:
    root = tracefs(tmp_path)
    fmt = root / "kmem" / "rss_stat" / "format"
    fmt.write_text(fmt.read_text().replace("curr", "is_curr"))
    part = RssPart(CaptureOptions(), tracefs=root)
    assert part.warnings == ["RSS (kmem:rss_stat) disabled: kmem:rss_stat has no field curr"]


class FakeBPF:
    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse
        self.attached: list[str] = []
        self.detached: list[str] = []

    def attach_tracepoint(self, tp: str, fn_name: str) -> None:
        if tp in self.refuse:
            raise Exception(f"Failed to attach BPF program {fn_name} to tracepoint {tp}")
        self.attached.append(tp)

    def detach_tracepoint(self, tp: str) -> None:
        self.detached.append(tp)


def test_attach_failure_warns_and_disables(tmp_path: Path) -> None:
    part = RssPart(CaptureOptions(track_faults=True), tracefs=tracefs(tmp_path))
    bpf = FakeBPF({"exceptions:page_fault_kernel"})
    warnings = part.attach(bpf)
    assert warnings == ["--track-faults disabled: cannot attach exceptions:page_fault_kernel "
                        "(Failed to attach BPF program mt_fault_kernel to tracepoint "
                        "exceptions:page_fault_kernel)"]
    assert part.roles == {"rss", "events"}
    assert bpf.attached == [f"{h.category}:{h.event}" for h in HOOKS
                            if h.fn_name != "mt_fault_kernel"]
    assert bpf.detached == ["exceptions:page_fault_user", "exceptions:page_fault_kernel"]


class FakeReader:
    def __init__(self, data: dict[str, np.ndarray], bpf: Any, name: str) -> None:
        self.left = [data[name]]

    def read_fixed(self, dtype: np.dtype) -> np.ndarray:
        return self.left.pop() if self.left else np.empty(0, dtype)


def test_drain_writes_each_ring_to_its_table(tmp_path: Path) -> None:
    rss = np.zeros(3, RSS_DTYPE)
    rss["ts"], rss["pid"], rss["member"] = [1, 2, 3], 42, [1, 0, 3]
    rss["external"], rss["bytes"] = [0, 1, 0], [4096, 8192, -1]
    ev = np.zeros(1, EVENT_DTYPE)
    ev["kind"], ev["pid"], ev["addr"], ev["size"], ev["flags"] = EventKind.MADVISE, 42, \
        0x7000, 8192, 4
    fl = np.zeros(2, FAULT_DTYPE)
    fl["ts"], fl["address"], fl["error_code"], fl["kernel"] = [5, 6], [0x7000, 0x8000], 6, [0, 1]
    data = {"mt_rss_ring": rss, "mt_rss_events": ev, "mt_faults_ring": fl}
    part = RssPart(CaptureOptions(track_faults=True), tracefs=tracefs(tmp_path / "t"),
                   reader=lambda bpf, name: FakeReader(data, bpf, name))
    w = ArtifactWriter(tmp_path / "a.memtrack")
    assert part.drain(object(), w) == 6
    assert part.drain(object(), w) == 0
    w.close()
    art = Artifact.open(tmp_path / "a.memtrack")
    assert art.read("rss").table.to_pylist() == [
        {"ts": 1, "pid": 42, "member": 1, "bytes": 4096, "external": False},
        {"ts": 2, "pid": 42, "member": 0, "bytes": 8192, "external": True},
        {"ts": 3, "pid": 42, "member": 3, "bytes": -1, "external": False},
    ]
    (e,) = art.read("events").table.to_pylist()
    assert (e["kind"], e["addr"], e["size"], e["flags"]) == (EventKind.MADVISE, 0x7000, 8192, 4)
    assert [(f["address"], f["error_code"], f["kernel"])
            for f in art.read("faults").table.to_pylist()] == [(0x7000, 6, False),
                                                               (0x8000, 6, True)]
