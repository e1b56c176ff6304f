"""memory_metadata.json: who each traced process was, and its peak resident memory.

One entry per process (memtrack.process.lifecycle): a pid that the kernel hands
out again during the capture gets a second entry. Peaks come from the RSS stage
(memtrack.process.rss) and, with --track-faults, the anon replay
(memtrack.process.anon_replay). Times are CLOCK_MONOTONIC ns as in the artifact;
`clock.wall_offset_ns` turns them into Unix time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from memtrack.process.anon_replay import REPLAY_LIMITS
from memtrack.process.lifecycle import Lifecycle, exit_status, of_artifact
from memtrack.process.read import read_artifact
from memtrack.process.rss import Resident, peaks_by_pid, resident, rss_peaks
from memtrack.schema.artifact import Artifact
from memtrack.schema.manifest import Manifest

METADATA_VERSION = 1


def build(artifact: Path | str, manifest: Manifest, lifecycle: Lifecycle, res: Resident
          ) -> dict[str, Any]:
    """The content of memory_metadata.json as plain data, from the stages' results."""
    m = manifest
    by_pid = lifecycle.by_pid()
    peaks = peaks_by_pid(rss_peaks(res.rss))
    tl_pid = res.rss["pid"].to_numpy()
    tl_ts = res.rss["ts"].to_numpy()
    # the root's status as capture saw it (its wait status), when no exit event has it
    root_exit = dict(m.exit_status.__dict__) if m.exit_status.code is not None \
        or m.exit_status.signal is not None else None
    processes = []
    for proc in lifecycle.processes:
        entry: dict[str, Any] = {
            "pid": proc.pid,
            "ppid": proc.ppid,
            **proc.identity(by_pid),
            "start_ns": proc.start_ns,
            "exit_ns": proc.exit_ns,
            "exit_status": exit_status(proc.exit_raw) if proc.exit_raw is not None
            or proc.pid != m.root_pid else root_exit,
            "exec_ns": proc.execs,
            "history": [
                {"ts": r["ts"], "comm": r["comm"], "exe": r["exe"], "cmdline": r["cmdline"]}
                for r in proc.idents
            ],
        }
        pk = peaks.get(proc.pid, {})
        if len(by_pid[proc.pid]) > 1:
            # pid reused: take the peaks of this process's own span only
            lo, hi = proc.start_ns or 0, proc.exit_ns if proc.exit_ns is not None else 2**64 - 1
            span = (tl_pid == proc.pid) & (tl_ts >= lo) & (tl_ts <= hi)
            pk = peaks_by_pid(rss_peaks(res.rss.filter(pa.array(span)))).get(proc.pid, {})
        entry["peak_rss"] = pk
        if res.replay is not None:
            entry["anon_replay"] = {
                "peak": res.replay.peaks.get(proc.pid),
                "caveats": res.replay.caveats.get(proc.pid, []),
            }
        processes.append(entry)
    return {
        "version": METADATA_VERSION,
        "artifact": str(artifact),
        "command": m.command,
        "root_pid": m.root_pid,
        "clock": {"source": m.clock.source, "wall_offset_ns": m.clock.wall_offset_ns},
        "page_size": m.host.page_size,
        "processes": processes,
        **({"anon_replay_limits": list(REPLAY_LIMITS)} if res.replay is not None else {}),
    }


def path_for(out_db: Path) -> Path:
    """Where `process` writes a run's metadata: named after its database (RUN.duckdb ->
    RUN.memory_metadata.json), so that runs processed into one directory keep theirs."""
    return out_db.with_name(out_db.stem + ".memory_metadata.json")


def write(data: dict[str, Any], path: Path | str) -> Path:
    """Write memory_metadata.json content to `path` (atomically); returns the path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def memory_metadata(art: Artifact) -> dict[str, Any]:
    """memory_metadata.json of an artifact, through the same stages `process` runs."""
    tables = read_artifact(art)
    lifecycle = of_artifact(tables, art.manifest)
    return build(art.path, art.manifest, lifecycle, resident(tables, art.manifest, lifecycle))


def write_memory_metadata(art: Artifact, path: Path | str) -> Path:
    """Write memory_metadata.json for `art` to `path`; returns the path."""
    return write(memory_metadata(art), path)


def _json_default(o: object) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    raise TypeError(f"cannot serialize {type(o).__name__}")
