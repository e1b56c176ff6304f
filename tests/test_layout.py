"""The package layout: docs/DESIGN.md's module map names every module of the tree and
nothing else, and imports go one way between capture and the processing side."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "memtrack"
SOURCE = re.compile(r"^[\w.]+\.(py|c|h)$")


def design_map() -> set[str]:
    """Every file the map of docs/DESIGN.md's "Package layout" names, by path."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    block = text.split("## Package layout", 1)[1].split("```", 2)[1]
    out: set[str] = set()
    dirs: list[tuple[int, str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        head = line.split()[0]
        while dirs and dirs[-1][0] >= indent:
            dirs.pop()
        if head.endswith("/"):
            dirs.append((indent, head))
            continue
        prefix = "".join(d for _, d in dirs)
        for name in line.split():  # file names, then maybe a description
            if not SOURCE.match(name):
                break
            out.add(prefix + name)
    return out


def test_design_map_is_the_tree() -> None:
    tree = {str(p.relative_to(ROOT)) for p in PKG.rglob("*")
            if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts
            and p.name != "__init__.py"}
    mapped = {p for p in design_map() if p.startswith("memtrack/")
              and not p.endswith("__init__.py")}
    assert sorted(tree - mapped) == [], "modules missing from docs/DESIGN.md"
    assert sorted(mapped - tree) == [], "docs/DESIGN.md names modules that do not exist"


def imports(path: Path) -> set[str]:
    """Every memtrack module a file imports (at the top or inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return {m for m in out if m.startswith("memtrack.")}


def package_imports(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imports(p) for p in (PKG / package).rglob("*.py")}


def test_capture_imports_only_the_contract_and_readers() -> None:
    allowed = ("memtrack.capture", "memtrack.schema", "memtrack.elf", "memtrack.dwarf",
               "memtrack.bpf")
    for path, mods in package_imports("capture").items():
        bad = {m for m in mods if not m.startswith(allowed)}
        assert not bad, (path, bad)


def test_processing_side_never_imports_capture() -> None:
    for package in ("process", "addrspace", "symbolize", "report", "elf", "dwarf", "schema"):
        for path, mods in package_imports(package).items():
            assert not {m for m in mods if m.startswith("memtrack.capture")}, path
            assert not {m for m in mods
                        if m.startswith(("memtrack.commands", "memtrack.cli"))}, path
    for lower in ("elf", "dwarf", "schema"):
        for path, mods in package_imports(lower).items():
            assert all(m.startswith(("memtrack.elf", "memtrack.dwarf", "memtrack.schema"))
                       for m in mods), path


def test_address_spaces_sit_below_unwind_and_symbolize() -> None:
    """memtrack.addrspace serves the unwinder and the symbolizer: it reads files and the
    artifact's contract, never a stage or a report."""
    for path, mods in package_imports("addrspace").items():
        assert all(m.startswith(("memtrack.addrspace", "memtrack.elf", "memtrack.dwarf",
                                 "memtrack.schema")) for m in mods), (path, mods)
