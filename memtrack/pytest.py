"""pytest plugin: under `memtrack capture`, each test is a region named by its node id.

Active only when the tests run under `memtrack capture` (MEMTRACK_CONTROL is in the
environment); pip-installing memtrack registers it (entry point `memtrack.pytest`),
`-p memtrack.pytest` names it explicitly and `-p no:memtrack.pytest` turns it off.

The region is the test's call phase only: fixtures' setup and teardown stay outside
it, and so do the other plugins' wrappers of the call (this one is the innermost), so
that a test's allocations, peak and leaks are the test body's. Each test costs two
round trips to memtrack (well under a millisecond).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from memtrack.control import memtrack_control as control

_problems: list[str] = []  # the first reason a test could not be marked


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if not control.active():
        yield
        return
    began = control.begin(item.nodeid)
    if not began and not _problems:
        _problems.append(f"{item.nodeid}: {control.last_error}")
    try:
        yield
    finally:
        if began and not control.end(item.nodeid) and not _problems:
            _problems.append(f"{item.nodeid}: end: {control.last_error}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _problems:
        terminalreporter.write_line(
            f"memtrack: some tests are not regions ({_problems[0]})", yellow=True)
