"""`memtrack info ARTIFACT`: what an artifact holds, without processing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memtrack.commands import CommandError
from memtrack.schema import ALLOC_KINDS, TABLES, EventKind
from memtrack.schema.artifact import Artifact, ArtifactError


def collect_info(path: Path) -> dict[str, Any]:
    """Everything `info` prints, as plain data (also the --json output). The tables are
    read as `process` reads them (memtrack.process.read: bad rows counted and skipped)."""
    from memtrack.process.read import read_artifact

    art = Artifact.open(path)
    m = art.manifest
    tables: dict[str, Any] = {}
    read = read_artifact(art)
    for name in TABLES:
        t = getattr(read, name, None)  # stack_copies: a debug table process never reads
        bad = read.bad_rows.get(name, 0)
        rows = (t if t is not None else art.read(name, required=False).table).num_rows
        tables[name] = {"rows": rows + bad, "truncated": name in art.truncated,
                        "bad_rows": bad}
    ev = read.events
    kinds: dict[str, int] = {}
    if ev.num_rows:
        counts = pc.value_counts(ev["kind"]).to_pylist()
        for c in counts:
            try:
                kinds[EventKind(c["values"]).name.lower()] = c["counts"]
            except ValueError:
                kinds[f"unknown({c['values']})"] = c["counts"]
    return {
        "artifact": str(path),
        "manifest": m.to_dict(),
        "tables": tables,
        "event_kinds": kinds,
        "losses": m.losses,
        "modules": art.modules(),
        "peak_rss": peak_rss(art, read.rss, ev, read.processes),
        "stack_records": stack_records(read.stacks, ev, read.py_stacks),
        "warnings": art.warnings,
    }


def peak_rss(art: Artifact, rss: Any, events: Any, processes: Any) -> list[dict[str, Any]]:
    """Per process: its name and peak resident bytes (total and by member) with the time
    of the total's peak in seconds from the capture's start."""
    from memtrack.process.lifecycle import lifecycle
    from memtrack.process.rss import effective_rss, peaks_by_pid, rss_peaks

    if not rss.num_rows:
        return []
    peaks = peaks_by_pid(rss_peaks(effective_rss(rss, lifecycle(events))))
    procs = processes.sort_by([("ts", "ascending")])
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


def stack_records(stacks: Any, events: Any, py_stacks: Any = None, top: int = 10
                  ) -> dict[str, Any]:
    """Stack records: how many, how many were cut at the budget, distinct hashes, the
    allocations without a stack, and the `top` most frequent stacks by allocations
    referencing them (a Python stack counts for the native record it extends)."""
    import numpy as np

    from memtrack.process.pyframes import native_hashes

    hashes = stacks.column("hash").to_numpy()
    h = events.column("stack_hash").to_numpy() if events.num_rows else np.zeros(0, np.uint64)
    if py_stacks is not None:
        h = native_hashes(py_stacks, h)
    kinds = events.column("kind").to_numpy() if events.num_rows else np.zeros(0, np.uint8)
    alloc = np.isin(kinds, [int(k) for k in ALLOC_KINDS])
    used, counts = np.unique(h[h != 0], return_counts=True)
    order = np.argsort(-counts, kind="stable")[:top]
    first: dict[int, int] = {}  # hash -> its first record
    if hashes.size:
        uniq, idx = np.unique(hashes, return_index=True)
        first = dict(zip(uniq.tolist(), idx.tolist(), strict=True))
    pids = stacks.column("pid").to_numpy()
    lens = stacks.column("copy_len").to_numpy()
    rows = []
    for u, c in zip(used[order].tolist(), counts[order].tolist(), strict=True):
        i = first.get(u)
        rows.append({"hash": u, "occurrences": c,
                     "pid": int(pids[i]) if i is not None else None,
                     "copy_len": int(lens[i]) if i is not None else None})
    return {
        "records": int(hashes.size),
        "cut": int(pc.sum(stacks.column("truncated")).as_py() or 0),
        "distinct_hashes": int(np.unique(hashes).size),
        "payload_bytes": int(pc.sum(pc.binary_length(stacks.column("payload"))).as_py() or 0),
        "allocations": int(alloc.sum()),
        "allocations_without_stack": int((alloc & (h == 0)).sum()),
        "unresolved_hashes": int(np.setdiff1d(used, hashes).size),
        "top": rows,
    }


def run(artifact: Path, as_json: bool) -> int:
    try:
        show_info(artifact, as_json=as_json)
    except ArtifactError as e:
        raise CommandError(str(e)) from None
    return 0


def show_info(path: Path, *, as_json: bool = False) -> None:
    data = collect_info(path)
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
