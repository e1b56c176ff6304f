"""Hostile artifacts (issue 16): every case of tests/support/hostile.py damages a copy of
one small real capture (marked as captured on another machine), and `info`, `process`
(its default host modules: off), `report` as text and `--html`, `export`, `diff` and
`unwind` run on it through the command line, in a subprocess with a time limit, an
address-space limit (RLIMIT_AS) and an audit hook (tests/support/hostile_run.py) that
names every file opened outside the artifact and the output. Each must exit 0 with the
right output or 2 with one line naming the problem, never print a traceback, and read or
write nothing outside."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.hostile import (
    Case,
    cases,
    libc_dir,
    manifest,
    module_info,
    read_table,
    reseal,
    set_manifest,
)

import memtrack
from memtrack.schema.manifest import Host

ROOT = Path(__file__).resolve().parents[1]
# the memtrack this test imported (a worktree's on PYTHONPATH, say): the runner's too
PACKAGE = Path(memtrack.__file__).resolve().parent
RUNNER = ROOT / "tests" / "support" / "hostile_run.py"
TIME_LIMIT = 120  # seconds per command, on a shared 2-core machine
MEMORY_LIMIT = 6 << 30  # address space per command
READ_ROOTS = [*(p for p in sys.path if p.startswith("/") and not p.startswith("/tmp")),
              sys.prefix, sys.base_prefix, str(PACKAGE), "/usr/lib/debug", "/proc",
              "/sys", "/dev/urandom", "/usr/share/zoneinfo", "/etc/localtime",
              "/etc/machine-id"]  # memtrack reads its own host identity (Host.current)

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ls /` captured with stacks, RSS and its modules (the vDSO, libc with its debug file)."""
    art = tmp_path_factory.mktemp("hostile") / "base.memtrack"
    r = subprocess.run([sys.executable, "-m", "memtrack.cli", "capture", "-o", str(art), "--",
                        "/bin/ls", "/"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    here = Host.current()  # capture names its host: process reads host modules for it
    assert (manifest(art)["host"]["machine_id"], manifest(art)["host"]["boot_id"]) == (
        here.machine_id, here.boot_id)
    return art


def limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def memtrack(work: Path, *cmds: list[str], read: list[Path], write: list[Path]
             ) -> tuple[list[subprocess.CompletedProcess | None], list[str]]:
    """Run memtrack command lines under watch in one interpreter (a command given as
    ["?", ARGS...] only if the one before it exited 0): each one's result (None: not
    run) and the files they opened outside."""
    log = work / "violations.txt"
    log.unlink(missing_ok=True)
    outdir = work / "results"
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "XDG_CACHE_HOME": str(work / "xdg"),
           "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1", "HOSTILE_VIOLATIONS": str(log),
           "PYTHONPATH": str(PACKAGE.parent),
           "HOSTILE_READ": ":".join([*READ_ROOTS, *map(str, read)]),
           "HOSTILE_WRITE": ":".join(["/dev/null", *map(str, write)])}
    argv: list[str] = []
    for i, c in enumerate(cmds):
        if i:
            argv.append("::?" if c[0] == "?" else "::")
        argv += ["memtrack", *(c[1:] if c[0] == "?" else c)]
    r = subprocess.run([sys.executable, str(RUNNER), str(outdir), *argv], capture_output=True,
                       text=True, cwd=work, env=env, timeout=TIME_LIMIT, preexec_fn=limit)
    assert r.returncode == 0, f"the runner died ({r.returncode}): {r.stderr[-3000:]}"
    results: list[subprocess.CompletedProcess | None] = []
    for i, c in enumerate(cmds):
        code = outdir / f"{i}.code"
        results.append(subprocess.CompletedProcess(
            c, int(code.read_text()), (outdir / f"{i}.out").read_text(),
            (outdir / f"{i}.err").read_text()) if code.exists() else None)
    return results, log.read_text().splitlines() if log.exists() else []


def check(r: subprocess.CompletedProcess, bad: list[str], what: str) -> str:
    """The contract every command keeps on any artifact; the output it printed."""
    assert not bad, f"{what}: opened outside the artifact: {bad}"
    assert "Traceback" not in r.stderr and "Error" not in r.stderr.split(":")[0], (
        f"{what}: {r.stderr[-2000:]}")
    assert r.returncode in (0, 2), f"{what}: exit {r.returncode}: {r.stderr[-2000:]}"
    if r.returncode == 2:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("memtrack: "), f"{what}: {r.stderr}"
    return r.stdout + r.stderr


def make(capture: Path, tmp_path: Path, case: Case) -> tuple[Path, Path, list[str]]:
    """The damaged copy, the outside directory (a valid ELF, a manifest) and its listing."""
    art = tmp_path / "run.memtrack"
    shutil.copytree(capture, art, symlinks=True)
    set_manifest(art, host__machine_id="0" * 32)  # uploaded from another machine
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copyfile(libc_dir(art) / module_info(libc_dir(art))["file"], outside / "libc.so.6")
    shutil.copyfile(art / "manifest.json", outside / "manifest.json")
    case.damage(art, outside)  # which may put a file there (a FIFO a mapping names)
    before = sorted(str(p) for p in outside.rglob("*"))
    if case.reseal:
        reseal(art)
    return art, outside, before


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One symbol and CFI cache for every hostile case: none may poison it (checked by
    test_cfi_cache_is_not_poisoned_by_a_corrupt_module, which runs after them)."""
    return tmp_path_factory.mktemp("hostile-cache")


Ran = tuple[list[subprocess.CompletedProcess | None], list[str], Path, list[str]]


def run_case(capture: Path, shared_cache: Path, tmp_path: Path, case: Case) -> Ran:
    """The case's damaged artifact, and every command run on it under watch: (results,
    files opened outside, the outside directory, its listing before)."""
    art, outside, before = make(capture, tmp_path, case)
    out = tmp_path / "out"
    out.mkdir()
    db = out / "run.duckdb"
    results, bad = memtrack(
        tmp_path, ["info", str(art)],
        ["process", str(art), "-o", str(db), "--cache-dir", str(shared_cache)],
        ["?", "report", str(db)], ["?", "report", str(db), "--html", str(out / "r.html")],
        ["?", "export", str(db), "--format", "pprof", "-o", str(out / "r.pb.gz")],
        ["?", "diff", str(db), str(db)],
        ["unwind", str(art), "--record", str(read_table(capture, "stacks")["hash"][0])],
        read=[art, shared_cache, out], write=[shared_cache, out, tmp_path / "xdg"])
    return results, bad, outside, before


@pytest.fixture(scope="module")
def ran(capture: Path, shared_cache: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> dict[str, Future]:
    """Every case run up front, two at a time (each in its own watched interpreter and
    directory; nothing else of the suite runs meanwhile): a fifth of the suite's time
    was these cases one after the other."""
    pool = ThreadPoolExecutor(2)
    futures = {c.name: pool.submit(run_case, capture, shared_cache,
                                   tmp_path_factory.mktemp(f"case-{c.name}"), c)
               for c in cases()}
    pool.shutdown(wait=True)
    return futures


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.xfail(reason=c.known, strict=False)) if c.known else c
    for c in cases()], ids=lambda c: c.name)
def test_hostile_artifact(ran: dict[str, Future], tmp_path: Path, case: Case) -> None:
    results, bad, outside, before = ran[case.name].result()
    info, proc, *reports = results
    said = [check(r, bad, " ".join(r.args[:1])) for r in results if r is not None]
    codes = [info.returncode, proc.returncode]
    if proc.returncode == 0:
        assert all(r is not None and r.returncode == 0 for r in reports[:-1]), reports
    assert sorted(str(p) for p in outside.rglob("*")) == before, "written outside"
    assert not [p for p in tmp_path.parent.rglob("ESCAPED*")], "a build id escaped"
    if case.expect == "ok":
        assert codes == [0, 0], said
    elif case.expect == "error":
        assert codes == [2, 2], said
    if case.says:
        assert any(case.says in s for s in said), (case.says, said)


@pytest.fixture(scope="module")
def run_db(capture: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("hostile-db") / "run.duckdb"
    r = subprocess.run([sys.executable, "-m", "memtrack.cli", "process", str(capture), "-o",
                        str(db), "--quiet"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return db


@pytest.mark.parametrize(("args", "code", "says"), [
    (["report", "{db}", "--top", "-5"], 2, "--top: expected 0 to 1000000, got -5"),
    (["report", "{db}", "--top", "0"], 0, "calls to allocation functions"),
    (["query", "{db}", ""], 2, "query: no SQL given"),
    (["query", "{db}", "select 1 where false"], 0, "(0 rows)"),
    (["query", "{db}", "select now() as t"], 0, "+00:00"),
    (["query", "{db}", "select now() as t", "--format", "json"], 0, '"t": "'),
    (["query", "{db}", "select 1 as a, 2 as a"], 0, "1  2"),
    (["query", "{db}", "select * from read_text('/etc/hostname')"], 2,
     "file system operations are disabled"),
    (["query", "{db}", "copy (select 1) to '{dir}/copied.csv'"], 2,
     "file system operations are disabled"),
    (["query", "{db}", "select count(*) as n from read_text('/etc/hostname')",
      "--allow-files"], 0, "1"),
])
def test_run_database_commands(run_db: Path, tmp_path: Path, args: list[str], code: int,
                               says: str) -> None:
    argv = [a.format(db=run_db, dir=tmp_path) for a in args]
    r = subprocess.run([sys.executable, "-m", "memtrack.cli", *argv], capture_output=True,
                       text=True, cwd=ROOT)
    out = check(r, [], " ".join(args[:1]))
    assert r.returncode == code and says in out, out
    assert not (tmp_path / "copied.csv").exists()


@pytest.mark.parametrize("table", ["frames", "events", "stacks"])
def test_run_database_with_a_table_dropped(run_db: Path, tmp_path: Path, table: str) -> None:
    db = tmp_path / "run.duckdb"
    shutil.copyfile(run_db, db)
    con = duckdb.connect(str(db))
    con.execute(f"DROP TABLE {table} CASCADE")
    con.close()
    for cmd in (["report", str(db)], ["query", str(db), "select 1"]):
        r = subprocess.run([sys.executable, "-m", "memtrack.cli", *cmd], capture_output=True,
                           text=True, cwd=ROOT)
        check(r, [], cmd[0])
        assert r.returncode == 2 and f"a damaged run database: no {table}" in r.stderr, r.stderr


def frames_by_method(db: Path) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT method, count(*) FROM stack_frames GROUP BY ALL "
                           "ORDER BY ALL").fetchall()
    finally:
        con.close()


def process(art: Path, db: Path, *cache: str, env_home: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "memtrack.cli", "process", str(art), "-o",
                        str(db), "--host-modules", "off", *cache], capture_output=True, text=True,
                       cwd=ROOT, env={"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(env_home),
                                      "HOME": str(env_home)})
    check(r, [], "process")
    assert r.returncode == 0, r.stderr
    return r


def test_cfi_cache_is_not_poisoned_by_a_corrupt_module(capture: Path, shared_cache: Path,
                                                       tmp_path: Path) -> None:
    """A libc copy whose .eh_frame is half zeros, under libc's genuine build id, processed
    with a cache first: a good run with that cache unwinds as one with no cache; so does
    one with the cache every hostile case above used."""
    from elftools.elf.elffile import ELFFile

    bad = tmp_path / "bad.memtrack"
    shutil.copytree(capture, bad)
    elf = libc_dir(bad) / module_info(libc_dir(bad))["file"]
    with open(elf, "rb") as f:
        sec = ELFFile(f).get_section_by_name(".eh_frame")
        off, size = sec["sh_offset"], sec["sh_size"]
    data = bytearray(elf.read_bytes())
    data[off + size // 4:off + 3 * size // 4] = bytes(size // 2)
    elf.write_bytes(bytes(data))
    home, cache = tmp_path / "home", tmp_path / "cache"
    process(bad, tmp_path / "bad.duckdb", "--cache-dir", str(cache), env_home=home)
    process(capture, tmp_path / "good.duckdb", "--cache-dir", str(cache), env_home=home)
    process(capture, tmp_path / "fresh.duckdb", "--cache", "off", env_home=home)
    process(capture, tmp_path / "shared.duckdb", "--cache-dir", str(shared_cache),
            env_home=home)
    good = frames_by_method(tmp_path / "good.duckdb")
    assert good == frames_by_method(tmp_path / "fresh.duckdb")
    assert good == frames_by_method(tmp_path / "shared.duckdb")
    assert frames_by_method(tmp_path / "bad.duckdb") != good  # the corruption mattered
    libc = libc_dir(capture).name  # one entry for each libc: the corrupt one is its own
    assert len(list((cache / "cfi").glob(f"{libc}-*.npz"))) == 2
    assert not home.exists()  # --cache-dir and --cache off: nothing under XDG_CACHE_HOME


def test_unwritable_cache_is_a_warning(capture: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    home = tmp_path / "home"
    r = process(capture, tmp_path / "a.duckdb", "--cache-dir", str(blocker / "cache"),
                env_home=home)
    assert "cannot write the unwind cache" in r.stdout + r.stderr
    process(capture, tmp_path / "b.duckdb", "--cache", "off", env_home=home)
    assert frames_by_method(tmp_path / "a.duckdb") == frames_by_method(tmp_path / "b.duckdb")


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=st.sampled_from(["events", "stacks", "mappings", "rss", "processes"]),
       where=st.floats(0.0, 0.999), byte=st.integers(1, 255), sealed=st.booleans())
def test_random_byte_changes(capture: Path, tmp_path_factory: pytest.TempPathFactory,
                             table: str, where: float, byte: int, sealed: bool) -> None:
    """One byte of a table changed anywhere (checksums resealed or not): the contract
    holds; unsealed, a change that still parses is named as damage."""
    tmp = tmp_path_factory.mktemp("fuzz")

    def damage(art: Path, _outside: Path) -> None:
        p = art / f"{table}.arrow"
        data = bytearray(p.read_bytes())
        data[int(len(data) * where)] ^= byte
        p.write_bytes(bytes(data))

    case = Case(f"byte-{table}", damage, reseal=sealed)
    art, _, _ = make(capture, tmp, case)
    out = tmp / "out"
    out.mkdir()
    (r,), bad = memtrack(tmp, ["process", str(art), "-o", str(out / "run.duckdb"),
                               "--host-modules", "off", "--cache", "off"],
                       read=[art, out], write=[out])
    said = check(r, bad, "process")
    if not sealed and r.returncode == 0:
        assert "truncated" in said  # what parsed whole was not what capture wrote
