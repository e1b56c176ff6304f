"""A `report --html` page: the data it embeds (its `<script id="data">` JSON, read back
as the page's script reads it), and the page loaded in headless Chromium."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.chromium import CHROMIUM, Browser


def page_data(page: Path) -> dict[str, Any]:
    m = re.search(r'<script id="data" type="application/json">(.*?)</script>',
                  page.read_text(), re.S)
    assert m, f"{page}: no embedded data"
    return json.loads(m[1].replace("<\\/", "</"))


@contextlib.contextmanager
def browsing(page: Path) -> Iterator[Browser]:
    """The page in headless Chromium, loaded without error, and no console message by
    the end (the test skips where Chromium is missing)."""
    if CHROMIUM is None:
        pytest.skip("chromium missing: run scripts/setup")
    b = Browser(1280, 900)
    try:
        b.open(page.as_uri())
        assert b.eval("document.body.dataset.status") == "ok"
        yield b
        assert b.console == []
    finally:
        b.close()
