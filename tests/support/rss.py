"""The RSS fixtures (fixtures/rss/rss_workloads.c) print `mark NAME pid=.. VmRSS=..`
lines with what they read from /proc/self/status at each point: the oracle the RSS
tests compare against."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
KiB = 1 << 10


@dataclass
class Mark:
    name: str
    pid: int
    vmrss: int
    anon: int
    file: int
    shmem: int
    thp: int  # AnonHugePages


def parse_marks(out: str) -> dict[str, Mark]:
    marks = {}
    for line in out.splitlines():
        if not line.startswith("mark "):
            continue
        _, name, *kv = line.split()
        v = {k: int(x) for k, x in (p.split("=") for p in kv)}
        marks[name] = Mark(name, v["pid"], v["VmRSS"] * KiB, v["RssAnon"] * KiB,
                           v["RssFile"] * KiB, v["RssShmem"] * KiB, v["AnonHugePages"] * KiB)
    return marks


def close(got: int, want: int, rel: float) -> bool:
    return abs(got - want) <= rel * want
