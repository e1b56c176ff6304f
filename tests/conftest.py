"""Shared test plumbing: the `bpf` marker policy, building fixture programs, and the
`tracker` fixture (tests/support/capture.py) for the capture tests.

Tests marked `@pytest.mark.bpf` need root and a working bcc. Where those are missing
they skip with the reason, except when MEMTRACK_REQUIRE_BPF=1 (CI), where the missing
capability is a failure: a BPF test must never silently not run there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
CONTROL = ROOT / "memtrack" / "control"  # memtrack_control.h: every build has -I there
BUILD_DIR = Path(os.environ.get("MEMTRACK_TEST_BUILD", ROOT / "build" / "fixtures"))

pytest_plugins = ("support.capture",)


@functools.cache
def bpf_unavailable_reason() -> str | None:
    """Why BPF tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (CAP_BPF + CAP_PERFMON)"
    try:
        import bcc  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"bcc is not importable ({e}); run scripts/setup"
    if not Path("/sys/kernel/tracing/uprobe_events").exists():
        return "tracefs is not mounted or the kernel has no uprobes; run scripts/setup"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = bpf_unavailable_reason()
    if reason is None:
        return
    required = os.environ.get("MEMTRACK_REQUIRE_BPF") == "1"
    for item in items:
        if "bpf" in item.keywords:
            if required:
                item.user_properties.append(("bpf_missing", reason))
            else:
                item.add_marker(pytest.mark.skip(reason=f"BPF: {reason}"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    for key, reason in item.user_properties:
        if key == "bpf_missing":
            pytest.fail(f"MEMTRACK_REQUIRE_BPF=1 but BPF is unavailable: {reason}")


def build(sources: list[str | Path], *, name: str | None = None, flags: tuple[str, ...] = (),
          libs: tuple[str, ...] = (), shared: bool = False, cxx: bool | None = None) -> Path:
    """Compile fixture sources (paths relative to fixtures/) into a cached binary.

    The output name carries a hash of the sources, flags and compiler, so a changed
    fixture is rebuilt and parallel test runs never see a half-written file.
    """
    paths = [p if Path(p).is_absolute() else FIXTURES / p for p in sources]
    paths = [Path(p) for p in paths]
    if cxx is None:
        cxx = any(p.suffix in (".cc", ".cpp", ".cxx") for p in paths)
    compiler = shutil.which("g++" if cxx else "gcc")
    assert compiler, "gcc/g++ missing: run scripts/setup"
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    # Headers the sources may include: every header beside a source, under fixtures/
    # (fixtures include each other's by relative path) and in -I directories.
    flags = (f"-I{CONTROL}", *flags)
    inc_dirs = {p.parent for p in paths} | {FIXTURES}
    inc_dirs |= {Path(f[2:]) for f in flags if f.startswith("-I")}
    for d in sorted(inc_dirs):
        pattern = "**/*.h" if d == FIXTURES else "*.h"
        for hdr in sorted(d.glob(pattern)):
            h.update(hdr.read_bytes())
    h.update(repr((flags, libs, shared, compiler)).encode())
    stem = name or paths[0].stem
    out = BUILD_DIR / f"{stem}-{h.hexdigest()[:12]}{'.so' if shared else ''}"
    if out.exists():
        return out
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    cmd = [compiler, *map(str, paths), "-o", str(tmp), *flags]
    if shared:
        cmd += ["-shared", "-fPIC"]
    cmd += list(libs)
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def small_synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic artifact (bench/synth_artifact.py): 12 k events, 1,500 stacks
    that unwind to _start."""
    from test_process_jobs import synth

    art = tmp_path_factory.mktemp("synth") / "small.memtrack"
    synth().generate(art, 12_000, 1_500, threads=4, depth=12, quiet=True)
    return art
