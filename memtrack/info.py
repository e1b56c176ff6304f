"""`memtrack info`: what an artifact holds, without processing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table

from memtrack.schema import TABLES, EventKind
from memtrack.schema.artifact import Artifact


def collect_info(path: Path) -> dict[str, Any]:
    """Everything `info` prints, as plain data (also the --json output)."""
    art = Artifact.open(path)
    m = art.manifest
    tables: dict[str, Any] = {}
    reads = {}
    for name in TABLES:
        r = art.read(name, required=name == "events")
        reads[name] = r
        tables[name] = {"rows": r.table.num_rows, "truncated": r.truncated}
    ev = reads["events"].table
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
        "warnings": art.warnings,
    }


def show_info(path: Path, *, as_json: bool = False) -> None:
    data = collect_info(path)
    if as_json:
        print(json.dumps(data, indent=2))
        return
    out = Console(highlight=False)
    m = data["manifest"]
    es = m["exit_status"]
    status = (
        f"signal {es['signal']}" if es.get("signal") else
        (f"exit {es['code']}" if es.get("code") is not None else "unknown")
    )
    dur = (m["end_ns"] - m["start_ns"]) / 1e9 if m["end_ns"] else 0.0
    out.print(f"[bold]{data['artifact']}[/bold]  format {m['format_version']}, "
              f"memtrack {m['memtrack_version']}")
    out.print(f"command   {' '.join(m['command']) or '-'}  (pid {m['root_pid']}, {status}, "
              f"{dur:.3f} s)")
    h = m["host"]
    out.print(f"host      {h['hostname']} {h['kernel']} {h['arch']} page {h['page_size']}")
    if m["options"]:
        out.print("options   " + ", ".join(f"{k}={v}" for k, v in sorted(m["options"].items())))

    t = Table(title="files", show_edge=False)
    t.add_column("table")
    t.add_column("rows", justify="right")
    t.add_column("note")
    for name, d in data["tables"].items():
        t.add_row(name, f"{d['rows']:,}", "truncated" if d["truncated"] else "")
    out.print(t)
    if data["event_kinds"]:
        t = Table(title="events by kind", show_edge=False)
        t.add_column("kind")
        t.add_column("count", justify="right")
        for k, v in sorted(data["event_kinds"].items(), key=lambda kv: -kv[1]):
            t.add_row(k, f"{v:,}")
        out.print(t)
    lost = {k: v for k, v in data["losses"].items() if v}
    out.print("losses    " + (", ".join(f"{k}={v:,}" for k, v in lost.items()) or "none"))
    mods = data["modules"]
    out.print(f"modules   {len(mods)}")
    for mod in mods:
        dbg = " +debug" if mod.get("debug_file") else ""
        out.print(f"  {mod['build_id'][:16]}  {mod['path']}{dbg}")
    for w in data["warnings"] + m.get("warnings", []):
        out.print(f"[yellow]warning[/yellow]: {w}", markup=True)
