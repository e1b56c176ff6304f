"""`memtrack report --html`: the page in headless Chromium, driven as a user would (its
buttons clicked, its search typed into, the mouse over its plots). Each view shows the
fixture's call tree and figures, with no console message and no network; a screenshot
of each view is saved ($MEMTRACK_SCREENS, else /tmp/memtrack-screens/synthetic)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import duckdb
import pytest
from support.chromium import CHROMIUM, Browser, screens_dir
from support.synth import ALLOCATORS, LEAKS, PEAK, SIZES, TEMPORARY, write_run
from typer.testing import CliRunner

from memtrack.cli import app
from memtrack.report import folded
from memtrack.report.reader import RunReader
from memtrack.report.text import human_bytes

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium missing: run scripts/setup")

TOTALS = {"allocated": sum(SIZES), "calls": len(SIZES), "peak": PEAK["bytes"] + 128,
          "leaked": sum(s for _, s in LEAKS.values()), "temporary": len(TEMPORARY)}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("html") / "run.duckdb")


@pytest.fixture(scope="module")
def page(run: Path) -> Path:
    out = run.with_suffix(".html")
    r = CliRunner().invoke(app, ["report", str(run), "--html", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def browser() -> Any:
    b = Browser(1280, 900)
    yield b
    b.close()


@pytest.fixture(scope="module")
def screens() -> Path:
    return screens_dir() / "synthetic"


def load(browser: Browser, page: Path, fragment: str = "") -> None:
    browser.console.clear()
    browser.open(page.as_uri() + fragment)
    assert browser.eval("document.body.dataset.status") == "ok"


def flame_rects(browser: Browser) -> list[dict[str, Any]]:
    return browser.eval("""[...document.querySelectorAll('#flame rect.fg')].map(r => ({
        name: r.dataset.name, depth: +r.dataset.depth, value: +r.dataset.value,
        x: +r.getAttribute('x'), w: +r.getAttribute('width'),
        match: r.classList.contains('match')}))""")


def drawn_tree(rects: list[dict[str, Any]]) -> dict[str, int]:
    """The flame graph's stacks as drawn: each rectangle's path of names up to the root
    (the rectangle above it whose span holds it), and its value minus its children's
    (what the stack ending there weighs)."""
    by_depth: dict[int, list[dict[str, Any]]] = {}
    for r in rects:
        by_depth.setdefault(r["depth"], []).append(r)
    path: dict[int, str] = {}
    out = {}
    for r in sorted(rects, key=lambda r: (r["depth"], r["x"])):
        parents = [p for p in by_depth.get(r["depth"] - 1, [])
                   if p["x"] - 0.01 <= r["x"] and r["x"] + r["w"] <= p["x"] + p["w"] + 0.6]
        assert r["depth"] == 0 or len(parents) == 1, r
        up = path[id(parents[0])] + ";" if parents else ""
        path[id(r)] = up + r["name"]
        kids = sum(c["value"] for c in by_depth.get(r["depth"] + 1, [])
                   if r["x"] - 0.01 <= c["x"] and c["x"] + c["w"] <= r["x"] + r["w"] + 0.6)
        if r["value"] > kids:
            out[path[id(r)]] = r["value"] - kids
    return out


@pytest.mark.parametrize("metric", list(TOTALS))
def test_flame_graph_is_the_call_tree(browser: Browser, page: Path, run: Path, screens: Path,
                                      metric: str) -> None:
    load(browser, page, f"#metric={metric}")
    rects = flame_rects(browser)
    assert rects[0]["name"] == "all" and rects[0]["value"] == TOTALS[metric]
    want = {}
    with duckdb.connect(str(run), read_only=True) as con:
        for ln in folded.folded(RunReader(con).costs(), metric, pids=True).splitlines():
            stack, v = ln.rsplit(" ", 1)
            want["all;" + stack] = int(v)
    assert drawn_tree(rects) == want
    on = browser.eval("document.querySelector('#metric button.on').dataset.metric")
    assert on == metric
    # every rectangle is on screen where it is drawn, not covered
    hidden = browser.eval("""[...document.querySelectorAll('#flame rect.fg')].filter(r => {
        r.scrollIntoView({block: "center"});
        const b = r.getBoundingClientRect();
        return b.width > 2 && document.elementFromPoint(b.left + b.width / 2,
                                                        b.top + b.height / 2) !== r;
    }).map(r => r.dataset.name)""")
    assert hidden == []
    browser.screenshot(screens / f"flame-{metric}.png", "#flame")
    assert browser.console == []


def test_metric_buttons_switch_the_view(browser: Browser, page: Path) -> None:
    load(browser, page)
    assert flame_rects(browser)[0]["value"] == TOTALS["allocated"]
    browser.mouse(*browser.point("#metric button[data-metric='temporary']"), "click")
    rects = flame_rects(browser)
    assert rects[0]["value"] == TOTALS["temporary"] == 2
    assert drawn_tree(rects) == {"all;parent (100);main;work;make_small": 1,
                                 "all;parent (100);main;grow": 1}


def test_search(browser: Browser, page: Path, screens: Path) -> None:
    load(browser, page)
    browser.mouse(*browser.point("#search"), "click")
    browser.type("make_sm")
    rects = flame_rects(browser)
    assert {r["name"] for r in rects if r["match"]} == {"make_small"}
    assert browser.eval("document.getElementById('matched').textContent") == (
        f"matched {100 * 1512 / sum(SIZES):.1f}% of bytes allocated")
    shown = browser.eval("""[...document.querySelectorAll('table.sites tr.site')]
        .filter(r => !r.classList.contains('hidden'))
        .map(r => r.closest('table').dataset.section + ':' + r.children[1].textContent)""")
    assert shown == ["calls:make_small", "leaks:make_small", "temporary:make_small"]
    hot = browser.eval("""[...document.querySelectorAll('#hotspots tr[data-search]')]
        .filter(r => !r.classList.contains('hidden')).map(r => r.children[0].textContent)""")
    assert hot == ["make_small"]
    browser.eval("window.scrollTo(0, 0)")
    browser.screenshot(screens / "search.png")
    # a search by file name finds the sites whose backtraces pass through it
    browser.eval("const s = document.getElementById('search'); s.value = '';"
                 "s.dispatchEvent(new Event('input'))")
    browser.type("work.c")
    shown = browser.eval("""[...document.querySelectorAll('table[data-section=calls] tr.site')]
        .filter(r => !r.classList.contains('hidden')).map(r => r.children[1].textContent)""")
    assert sorted(shown) == ["make_big", "make_big", "make_small"]
    assert browser.console == []


def test_backtraces_per_row(browser: Browser, page: Path, screens: Path) -> None:
    load(browser, page)
    rows = "table[data-section=leaks] tr"
    assert browser.eval(f"[...document.querySelectorAll('{rows}.bt')]"
                        ".every(r => r.classList.contains('hidden'))")
    for i in range(4):  # open every leak's backtraces
        browser.mouse(*browser.point(f"{rows}.site:nth-of-type({2 * i + 2}) .toggle"), "click")
    traces = browser.eval(f"""[...document.querySelectorAll('{rows}.bt')].map(r => [
        !r.classList.contains('hidden'),
        [...r.querySelectorAll('li')].map(li => li.firstChild.textContent)])""")
    assert traces == [[True, ["grow", "main"]], [True, ["make_small", "work", "main"]],
                      [True, ["[no stack]"]], [True, ["thread_fn", "[truncated]"]]]
    files = browser.eval(f"[...document.querySelectorAll('{rows}.bt li .file')]"
                         ".map(s => s.textContent.trim())")
    assert files[:2] == ["grow.c:10", "main.c:11"]
    assert browser.eval(f"document.querySelector('{rows}.bt li.cut').textContent") == \
        "[truncated]"
    browser.screenshot(screens / "tables.png", "#tables")
    assert browser.console == []


def test_hotspots_name_no_allocator(browser: Browser, page: Path) -> None:
    load(browser, page)
    names = browser.eval("[...document.querySelectorAll('#hotspots tr[data-search]')]"
                         ".map(r => r.children[0].textContent)")
    assert names[0] == "grow" and not set(names) & set(ALLOCATORS)
    assert set(names) == {"grow", "make_big", "make_small", "thread_fn", "[no stack]", "main",
                          "work"}


def heap_at(run: Path, pid: int, t: float) -> int | None:
    with duckdb.connect(str(run), read_only=True) as con:
        row = con.execute("""SELECT heap_bytes FROM heap_timeline WHERE pid = ? AND
            ts <= 900 + ? ORDER BY event_id DESC LIMIT 1""", [pid, t * 1e9]).fetchone()
    return row[0] if row else None


def test_timeline_axes_and_hover(browser: Browser, page: Path, run: Path,
                                 screens: Path) -> None:
    load(browser, page)
    plots = browser.eval("[...document.querySelectorAll('svg.plot')].map(s => +s.dataset.pid)")
    assert plots == [100, 200]
    ticks = browser.eval("""[...document.querySelectorAll('svg.plot')][0] &&
        [...document.querySelector('svg.plot').querySelectorAll('.xtick')]
        .map(t => t.textContent)""")
    assert len(ticks) >= 6 and all(re.fullmatch(r"[\d.]+ µs", t) for t in ticks)  # 2.1 µs
    yticks = browser.eval("[...document.querySelector('svg.plot').querySelectorAll('.ytick')]"
                          ".map(t => t.textContent)")
    assert yticks[0] == "0 KiB" and all(re.fullmatch(r"[\d.]+ KiB", t) for t in yticks)
    assert browser.eval("document.querySelector('svg.plot').getBoundingClientRect().width") > 1100
    # where times are on the x axis, from two of its tick labels
    (x0, l0), (x1, l1) = browser.eval("""(() => {
        const t = [...document.querySelector("svg.plot[data-pid='100']")
                   .querySelectorAll('.xtick')];
        return [t[0], t[t.length - 1]].map(e => [e.getBoundingClientRect().left
            + e.getBoundingClientRect().width / 2, parseFloat(e.textContent)]); })()""")
    seen = set()
    for us in (0.55, 0.65, 0.75):  # after 1400, 1500, 1600 ns: three heap sizes
        _, y = browser.point("svg.plot[data-pid='100']", 0.5, 0.3)
        browser.mouse(x0 + (x1 - x0) * (us - l0) / (l1 - l0), y)
        d = browser.eval("Object.assign({}, document.querySelector(\"svg.plot[data-pid='100']\")"
                         ".dataset)")
        want = heap_at(run, 100, float(d["t"]))
        assert (int(d["heap"]) if d["heap"] else None) == want
        readout = browser.eval("document.querySelector(\"svg.plot[data-pid='100'] .readout\")"
                               ".textContent")
        assert re.fullmatch(r"[\d.]+ µs {3}heap \S+ \S+ {3}RSS \S+ \S+", readout), readout
        assert f"heap {human_bytes(want)}   RSS {human_bytes(int(d['rss']))}" in readout
        seen.add(want)
    assert seen == {6444, 4396, 5396}
    browser.screenshot(screens / "timeline.png", "#timeline")
    assert browser.console == []


def test_self_contained(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)
    assert "<script src" not in text and "<link" not in text


def test_program_text_is_text(run: Path, tmp_path: Path, browser: Browser) -> None:
    """A command or a function name holding markup is shown as it is, never run."""
    db = tmp_path / "markup.duckdb"
    db.write_bytes(run.read_bytes())
    evil = "<img src=x onerror=alert(1)></script><b>"
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'command'", [f'["{evil}"]'])
        con.execute("UPDATE frames SET name = ? WHERE name = 'grow'", [evil])
    out = tmp_path / "markup.html"
    assert CliRunner().invoke(app, ["report", str(db), "--html", str(out)]).exit_code == 0
    load(browser, out)
    assert browser.eval("document.querySelectorAll('img').length") == 0
    assert browser.eval("document.getElementById('command').textContent") == evil
    assert evil in [r["name"] for r in flame_rects(browser)]
    assert browser.console == []
