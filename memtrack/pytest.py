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

`@pytest.mark.memtrack_limit(peak="24 MB", leaked="0 B", allocated=..., calls=...)`
gives the test's region limits, as labels (`limit.peak` = 25165824, ...: one more round
trip each) that `memtrack check RUN.duckdb` compares with the region's figures after
`process`: peak, the heap at its highest above where it stood when the body began;
leaked, the bytes the body allocated and had not freed when it returned; allocated and
calls, all it allocated. Sizes as memtrack.sizes reads them (KB, MB: powers of 1024, as
pytest-memray's); a marker on a class or module applies to its tests, the closest
marker's keyword winning. A bad marker fails its test with one line, under capture only
(outside it the marker does nothing, like every part of the plugin).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager

import pytest

from memtrack.control import memtrack_control as control
from memtrack.sizes import parse_size

MARKER = "memtrack_limit"
# the marker's keywords: what each limits (bytes, or a count of calls)
LIMITS = {"peak": True, "leaked": True, "allocated": True, "calls": False}

_problems: list[str] = []  # the first reason a test could not be marked
_active = False  # under memtrack capture (pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    global _active
    _active = control.active()
    config.addinivalue_line(
        "markers", f"{MARKER}(peak=, leaked=, allocated=, calls=): under memtrack capture, "
        "limits that `memtrack check` holds the test's region to (sizes such as '24 MB', "
        "powers of 1024; calls a count)")


def limits(item: pytest.Item) -> dict[str, int]:
    """The test's limits from its memtrack_limit markers (the closest wins per keyword);
    a bad marker fails the test with one line."""
    out: dict[str, int] = {}
    for mark in reversed(list(item.iter_markers(MARKER))):
        if mark.args:
            pytest.fail(f"{MARKER}: takes keywords only ({', '.join(f'{k}=' for k in LIMITS)}), "
                        f"got {mark.args!r}", pytrace=False)
        for key, value in mark.kwargs.items():
            if key not in LIMITS:
                pytest.fail(f"{MARKER}: unknown limit {key!r} (expected "
                            f"{', '.join(LIMITS)})", pytrace=False)
            if value is None:
                out.pop(key, None)
                continue
            try:
                if LIMITS[key]:
                    out[key] = parse_size(value)
                elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    out[key] = value
                else:
                    raise ValueError(f"expected a number of calls, got {value!r}")
            except ValueError as e:
                pytest.fail(f"{MARKER}: {key}: {e}", pytrace=False)
    return out


@contextmanager
def _region(item: pytest.Item) -> Iterator[None]:
    nodeid = item.nodeid
    limited = limits(item)
    began = control.begin(nodeid)
    if not began and not _problems:
        _problems.append(f"{nodeid}: {control.last_error}")
    if began:
        for key, value in limited.items():
            if not control.label(f"limit.{key}", str(value)) and not _problems:
                _problems.append(f"{nodeid}: limit.{key}: {control.last_error}")
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
    with _region(pyfuncitem):
        yield


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if not _active or _called_as_function(item):
        yield
        return
    with _region(item):
        yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _problems:
        terminalreporter.write_line(
            f"memtrack: some tests are not regions ({_problems[0]})", yellow=True)
