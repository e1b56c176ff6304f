"""pytest plugin: under `memtrack capture`, each test is a region named by its node id.

Active only when the tests run under `memtrack capture` (MEMTRACK_CONTROL is in the
environment when pytest starts: a test that sets it changes nothing). Installing
memtrack registers it (entry point `memtrack.pytest`); `-p memtrack.pytest` names it
explicitly and `-p no:memtrack.pytest` turns it off.

The region is the test function's call and nothing around it: fixtures' setup and
teardown stay outside, and so does pytest's own work of the call phase (it sets
PYTEST_CURRENT_TEST: a setenv, two mallocs the environment keeps) and the other
plugins' wrappers of it, so that a test's allocations, peak and leaks are its body's.
A test function is marked where pytest calls it (pytest_pyfunc_call, this wrapper the
innermost); an item that is not called so (unittest, doctest, other plugins' items)
around its whole call phase. Each test costs two round trips to memtrack (well under a
millisecond).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager

import pytest

from memtrack.control import memtrack_control as control

_problems: list[str] = []  # the first reason a test could not be marked
_active = False  # under memtrack capture (pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    global _active
    _active = control.active()


@contextmanager
def _region(nodeid: str) -> Iterator[None]:
    began = control.begin(nodeid)
    if not began and not _problems:
        _problems.append(f"{nodeid}: {control.last_error}")
    try:
        yield
    finally:
        if began and not control.end(nodeid) and not _problems:
            _problems.append(f"{nodeid}: end: {control.last_error}")


def _called_as_function(item: pytest.Item) -> bool:
    """Whether pytest runs the item through pytest_pyfunc_call."""
    return isinstance(item, pytest.Function) and type(item).runtest is pytest.Function.runtest


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, None, None]:
    if not _active or not _called_as_function(pyfuncitem):
        yield
        return
    with _region(pyfuncitem.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if not _active or _called_as_function(item):
        yield
        return
    with _region(item.nodeid):
        yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _problems:
        terminalreporter.write_line(
            f"memtrack: some tests are not regions ({_problems[0]})", yellow=True)
