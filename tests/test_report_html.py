"""`memtrack report --html`: the page renders in headless Chromium (flame graph for each
metric, the heap/RSS plot, the tables) with no console message and no network."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.synth import LEAKS, PEAK, SIZES, write_run
from typer.testing import CliRunner

from memtrack.cli import app

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium missing: run scripts/setup")


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("html")
    run = write_run(d / "run.duckdb")
    out = d / "run.html"
    r = CliRunner().invoke(app, ["report", str(run), "--html", str(out)])
    assert r.exit_code == 0, r.output
    return out


def render(page: Path, fragment: str = "") -> tuple[str, list[str]]:
    p = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0", "--window-size=1200,900", "--dump-dom", page.as_uri() + fragment],
        capture_output=True, text=True, timeout=120,
    )
    console = [ln for ln in p.stderr.splitlines() if ":CONSOLE:" in ln]
    return p.stdout, console


def test_self_contained(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)
    assert "<script src" not in text and "<link" not in text


@pytest.mark.parametrize("metric,total", [
    ("allocated", sum(SIZES)), ("peak", PEAK["bytes"] + 128),
    ("leaked", sum(s for _, s in LEAKS.values()))])
def test_renders(page: Path, metric: str, total: int) -> None:
    dom, console = render(page, f"#metric={metric}")
    assert console == []
    assert 'data-status="ok"' in dom
    rects = re.findall(r'<rect [^>]*class="fg"[^>]*><title>([^<]*)</title>', dom)
    assert rects, "no flame graph rectangles"
    root = rects[0]
    assert root.startswith("all: ") and f"{total / 1024:.2f}K (100.00%)" in root
    names = {t.split(":")[0] for t in rects}
    assert "parent (100)" in names
    lines = re.findall(r'<polyline points="([^"]+)" class="(heap|rss)"', dom)
    assert {c for _, c in lines} == {"heap", "rss"}
    assert all(len(pts.split()) >= 2 for pts, _ in lines)
    assert "Peak memory consumers" in dom and "Hotspots" in dom
