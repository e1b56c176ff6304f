"""`memtrack info ARTIFACT`: what an artifact holds, without processing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memtrack.commands import CommandError
from memtrack.process.decode import StackRecords
from memtrack.process.read import ArtifactTables
from memtrack.process.spill import OtherEvents
from memtrack.schema import ALLOC_KINDS, TABLES, EventKind
from memtrack.schema.artifact import Artifact, ArtifactError


class EventTally:
    """What `info` needs of the events, counted a batch at a time as read hands them
    over (memtrack.process.read), never all of them at once: the count of each kind and
    of each stack hash (over every event, over the allocations), each pid's first time,
    and the events of the other kinds than the heap's (for the lifecycle)."""

    def __init__(self) -> None:
        self.n = 0
        self.kinds = np.zeros(256, np.int64)
        self.others = OtherEvents()
        self.hashes: list[tuple[np.ndarray, np.ndarray]] = []  # per batch: (hash, count)
        self.alloc_hashes: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, batch: pa.RecordBatch) -> None:
        kind = batch.column("kind").to_numpy()
        h = batch.column("stack_hash").to_numpy()
        self.kinds += np.bincount(kind, minlength=256)
        self.hashes.append(np.unique(h, return_counts=True))
        self.alloc_hashes.append(np.unique(h[np.isin(kind, [int(k) for k in ALLOC_KINDS])],
                                           return_counts=True))
        self.others.add(batch)
        self.n += batch.num_rows
        if len(self.hashes) > 64:  # the counts stay one entry per distinct hash
            self.hashes = [_merged(self.hashes)]
            self.alloc_hashes = [_merged(self.alloc_hashes)]

    def other_events(self) -> pa.Table:
        return self.others.other_events()

    def close(self) -> None:
        self.hashes = [_merged(self.hashes)]
        self.alloc_hashes = [_merged(self.alloc_hashes)]


def _merged(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Counts per value, summed over the parts."""
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    v = np.concatenate([p[0] for p in parts])
    c = np.concatenate([p[1] for p in parts])
    u, inv = np.unique(v, return_inverse=True)
    return u, np.bincount(inv, weights=c, minlength=len(u)).astype(np.int64)


def collect_info(path: Path, *, accept_damaged: bool = False) -> dict[str, Any]:
    """Everything `info` prints, as plain data (also the --json output). The tables are
    read as `process` reads them (memtrack.process.read: bad rows counted and skipped),
    the events a batch at a time."""
    from memtrack.process.read import read_artifact

    art = Artifact.open(path, accept_damaged=accept_damaged)
    m = art.manifest
    tables: dict[str, Any] = {}
    tally = EventTally()
    read = read_artifact(art, tally)
    for name in TABLES:
        t = getattr(read, name, None)  # stack_copies: a debug table process never reads
        bad = read.counters.get(f"{name}_bad_rows", 0)
        rows = tally.n if name == "events" else (
            t if t is not None else art.read(name, required=False).table).num_rows
        tables[name] = {"rows": rows + bad, "truncated": name in art.truncated,
                        "bad_rows": bad}
    kinds = {EventKind(k).name.lower(): int(tally.kinds[k]) for k in EventKind
             if tally.kinds[k]}
    return {
        "artifact": str(path),
        "manifest": m.to_dict(),
        "tables": tables,
        "event_kinds": kinds,
        "losses": m.losses,
        "modules": art.modules(),
        "peak_rss": peak_rss(art, read, tally.others.first_seen),
        "stack_records": stack_records(read.stacks, tally, read.py_stacks),
        "warnings": art.warnings,
    }


def peak_rss(art: Artifact, read: ArtifactTables, first_seen: dict[int, int]
             ) -> list[dict[str, Any]]:
    """Per process: its name and peak resident bytes (total and by member) with the time
    of the total's peak in seconds from the capture's start: `process`'s figures, from
    the same lifecycle and RSS stages (`first_seen`: each pid's first event's time)."""
    from memtrack.process.lifecycle import of_artifact
    from memtrack.process.rss import peaks_by_pid, resident, rss_peaks

    if not read.rss.num_rows:
        return []
    rss = resident(read, art.manifest, of_artifact(read, art.manifest, first_seen),
                   replay=False).rss
    peaks = peaks_by_pid(rss_peaks(rss))
    procs = read.processes.sort_by([("ts", "ascending")])
    names = dict(zip(procs["pid"].to_pylist(), procs["comm"].to_pylist(), strict=True))
    start = art.manifest.start_ns
    rows = []
    for pid, pk in sorted(peaks.items()):
        total = pk.get("total", {"bytes": 0, "ts": start})
        rows.append({
            "pid": pid, "comm": names.get(pid, ""), "total": total["bytes"],
            "at_s": (total["ts"] - start) / 1e9 if start else None,
            **{m: pk[m]["bytes"] if m in pk else 0 for m in ("anon", "file", "shmem", "swap")},
        })
    return rows


def stack_records(stacks: StackRecords, tally: EventTally, py_stacks: Any = None, top: int = 10
                  ) -> dict[str, Any]:
    """Stack records: how many, how many were cut at the budget, distinct hashes, the
    allocations without a stack, and the `top` most frequent stacks by allocations
    referencing them (a Python stack counts for the native record it extends)."""
    from memtrack.process.pyframes import native_hashes

    index = stacks.index
    hashes = index.column("hash").to_numpy()

    def native(counts: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        h, c = counts
        return _merged([(native_hashes(py_stacks, h) if py_stacks is not None else h, c)])

    seen, seen_n = native(_merged(tally.hashes))
    allocs, allocs_n = native(_merged(tally.alloc_hashes))
    used, counts = seen[seen != 0], seen_n[seen != 0]
    order = np.argsort(-counts, kind="stable")[:top]
    first: dict[int, int] = {}  # hash -> its first record
    if hashes.size:
        uniq, idx = np.unique(hashes, return_index=True)
        first = dict(zip(uniq.tolist(), idx.tolist(), strict=True))
    pids = index.column("pid").to_numpy()
    lens = index.column("copy_len").to_numpy()
    rows = []
    for u, c in zip(used[order].tolist(), counts[order].tolist(), strict=True):
        i = first.get(u)
        rows.append({"hash": u, "occurrences": c,
                     "pid": int(pids[i]) if i is not None else None,
                     "copy_len": int(lens[i]) if i is not None else None})
    return {
        "records": int(hashes.size),
        "cut": int(pc.sum(index.column("truncated")).as_py() or 0),
        "distinct_hashes": int(np.unique(hashes).size),
        "payload_bytes": stacks.payload_bytes,
        "allocations": int(allocs_n.sum()),
        "allocations_without_stack": int(allocs_n[allocs == 0].sum()),
        "unresolved_hashes": int(np.setdiff1d(used, hashes).size),
        "top": rows,
    }


def run(artifact: Path, as_json: bool, accept_damaged: bool = False) -> int:
    try:
        show_info(artifact, as_json=as_json, accept_damaged=accept_damaged)
    except ArtifactError as e:
        raise CommandError(str(e)) from None
    return 0


def show_info(path: Path, *, as_json: bool = False, accept_damaged: bool = False) -> None:
    data = collect_info(path, accept_damaged=accept_damaged)
    if as_json:
        print(json.dumps(data, indent=2))
        return
    out = Console(highlight=False, emoji=False)
    m = data["manifest"]
    es = m["exit_status"]
    status = (
        "capture cut short" if not m["complete"] else
        f"signal {es['signal']}" if es.get("signal") else
        (f"exit {es['code']}" if es.get("code") is not None else "unknown")
    )
    dur = (m["end_ns"] - m["start_ns"]) / 1e9 if m["end_ns"] else 0.0
    out.print(f"[bold]{shown(data['artifact'])}[/bold]  format {m['format_version']}, "
              f"memtrack {m['memtrack_version']}")
    out.print(f"command   {shown(' '.join(m['command'])) or '-'}  (pid {m['root_pid']}, {status}, "
              f"{dur:.3f} s)")
    h = m["host"]
    out.print(shown(f"host      {h['hostname']} {h['kernel']} {h['arch']} page "
                    f"{h['page_size']}"))
    if m["options"]:
        out.print(shown("options   " + ", ".join(f"{k}={v}"
                                                for k, v in sorted(m["options"].items()))))

    t = Table(title="files", show_edge=False)
    t.add_column("table")
    t.add_column("rows", justify="right")
    t.add_column("note")
    for name, d in data["tables"].items():
        note = ["truncated"] * d["truncated"] + [f"{d['bad_rows']:,} bad rows skipped"] * bool(
            d["bad_rows"])
        t.add_row(name, f"{d['rows']:,}", ", ".join(note))
    out.print(t)
    if data["event_kinds"]:
        t = Table(title="events by kind", show_edge=False)
        t.add_column("kind")
        t.add_column("count", justify="right")
        for k, v in sorted(data["event_kinds"].items(), key=lambda kv: -kv[1]):
            t.add_row(shown(k), f"{v:,}")
        out.print(t)
    if data["peak_rss"]:
        t = Table(title="peak RSS per process", show_edge=False)
        for col in ("pid", "comm", "total", "at", "anon", "file", "shmem", "swap"):
            t.add_column(col, justify="left" if col == "comm" else "right")
        for r in data["peak_rss"]:
            at = f"{r['at_s']:.3f} s" if r["at_s"] is not None else "-"
            t.add_row(str(r["pid"]), shown(r["comm"]), _mib(r["total"]), at,
                      *(_mib(r[m]) for m in ("anon", "file", "shmem", "swap")))
        out.print(t)
    sr = data["stack_records"]
    if sr["records"]:
        per = sr["records"] / sr["allocations"] if sr["allocations"] else 0.0
        out.print(f"stack records  {sr['records']:,} ({per:.2%} of allocations; "
                  f"{sr['cut']:,} cut at the budget), {sr['distinct_hashes']:,} "
                  f"distinct hashes, {_mib(sr['payload_bytes'])} of payload; allocations "
                  f"without a stack {sr['allocations_without_stack']:,}, hashes without a "
                  f"record {sr['unresolved_hashes']:,}")
        t = Table(title="most frequent stacks", show_edge=False)
        for col in ("stack hash", "allocations", "pid", "copy bytes"):
            t.add_column(col, justify="right")
        for r in sr["top"]:
            t.add_row(f"{r['hash']:016x}", f"{r['occurrences']:,}", str(r["pid"] or "-"),
                      f"{r['copy_len']:,}" if r["copy_len"] is not None else "-")
        out.print(t)
    lost = {k: v for k, v in data["losses"].items() if v}
    out.print(shown("losses    " + (", ".join(f"{k}={v:,}" for k, v in lost.items())
                                    or "none")))
    mods = data["modules"]
    out.print(f"modules   {len(mods)}")
    for mod in mods:
        dbg = " +debug" if mod.get("debug_file") else ""
        out.print(shown(f"  {mod['build_id'][:16]}  {mod['path']}{dbg}"))
    for w in data["warnings"] + m.get("warnings", []):
        out.print(f"[yellow]warning[/yellow]: {shown(w)}")


def shown(text: object) -> str:
    """Text from the artifact (a command, a process name, a path) as rich prints it
    literally: its markup escaped, its control characters as \\xNN escapes."""
    return escape("".join(c if c.isprintable() or c == " " else
                          f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                          for c in str(text)))


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
