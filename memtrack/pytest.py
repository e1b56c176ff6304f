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
millisecond). Its requests (the end, the limits' labels) are made before the begin
(memtrack_control.Request): with `capture --python-allocators on` the region holds no
object of the plugin's or the helper's, only pytest's and pluggy's around the call.

`@pytest.mark.memtrack_limit(peak="24 MB", leaked="0 B", leaked_per_stack=...,
allocated=..., calls=...)` gives the test's region limits, as labels (`limit.peak` =
25165824, ...: one more round trip each) that `memtrack check RUN.duckdb` compares with
the region's figures after `process`: peak, the heap at its highest above where it stood
when the body began; leaked, the bytes the body allocated and had not freed when it
returned; leaked_per_stack, the most of those one call stack allocated; allocated and
calls, all it allocated. Sizes as memtrack.sizes reads them (KB, MB: powers of 1024, as
pytest-memray's); a marker on a class or module applies to its tests, the closest
marker's keyword winning.

pytest-memray's markers mean the same limits: `limit_memory("24 MB")` is a peak limit,
`limit_leaks("1 KB")` a leaked_per_stack one (pytest-memray's leaks are per call stack);
every one of them on the test, its class and module applies (the smallest wins, with
memtrack_limit's too). What memtrack cannot honour after the run is refused, not
ignored: `filter_fn` (a Python function over each leaking stack, where `memtrack check`
runs no Python), `current_thread_only=False` (a region is its thread's: True is what
memtrack does anyway) and `limit_leaked_objects` (objects, not bytes). A bad marker fails
its test with one line, under capture only (outside it the markers do nothing, like
every part of the plugin).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from memtrack.control import memtrack_control as control
from memtrack.sizes import parse_size

MARKER = "memtrack_limit"
# the marker's keywords: what each limits (bytes, or a count of calls)
LIMITS = {"peak": True, "leaked": True, "leaked_per_stack": True, "allocated": True,
          "calls": False}
# pytest-memray's markers -> (the limit each sets, the name of its one argument)
MEMRAY_MARKERS = {"limit_memory": ("peak", "limit"),
                  "limit_leaks": ("leaked_per_stack", "location_limit")}
MEMRAY_REFUSED = "limit_leaked_objects"  # counts objects: nothing memtrack records

_problems: list[str] = []  # the first reason a test could not be marked
_active = False  # under memtrack capture (pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    global _active
    _active = control.active()
    config.addinivalue_line(
        "markers", f"{MARKER}(peak=, leaked=, allocated=, calls=): under memtrack capture, "
        "limits that `memtrack check` holds the test's region to (sizes such as '24 MB', "
        "powers of 1024; calls a count)")
    for name, (key, arg) in MEMRAY_MARKERS.items():
        config.addinivalue_line(
            "markers", f"{name}({arg}): pytest-memray's marker; under memtrack capture, "
            f"memtrack_limit({key}=...)")
    config.addinivalue_line("markers", f"{MEMRAY_REFUSED}: pytest-memray's marker; refused "
                            "under memtrack capture (memtrack records no objects)")


def limits(item: pytest.Item) -> dict[str, int]:
    """The test's limits from its memtrack_limit markers (the closest wins per keyword)
    and pytest-memray's (each applies: the smallest wins); a bad marker fails the test
    with one line."""
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
    if item.get_closest_marker(MEMRAY_REFUSED) is not None:
        pytest.fail(f"{MEMRAY_REFUSED}: memtrack records bytes, not the objects that "
                    "outlive a test: no limit it can hold", pytrace=False)
    for name, (key, arg) in MEMRAY_MARKERS.items():
        for mark in item.iter_markers(name):
            value = _memray_limit(name, arg, mark.args, dict(mark.kwargs))
            out[key] = min(out.get(key, value), value)
    return out


def _memray_limit(name: str, arg: str, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> int:
    """The bytes of one pytest-memray marker, or the test failed with why not."""
    if "filter_fn" in kwargs:
        pytest.fail(f"{name}: filter_fn cannot be honoured: `memtrack check` judges the "
                    "limits after the run, where no Python function runs (raise the limit "
                    "instead)", pytrace=False)
    if kwargs.pop("current_thread_only", True) is not True:
        pytest.fail(f"{name}: current_thread_only=False cannot be honoured: memtrack counts "
                    "the test's own thread only", pytrace=False)
    if arg in kwargs:
        args = (*args, kwargs.pop(arg))
    if len(args) != 1 or kwargs:
        pytest.fail(f"{name}: takes one size ({name}(\"24 MB\"), or {arg}=) and "
                    f"current_thread_only=True, got {args!r} {kwargs!r}", pytrace=False)
    try:
        return parse_size(args[0])  # type: ignore[arg-type]
    except ValueError as e:
        pytest.fail(f"{name}: {e}", pytrace=False)


class _Region:
    """A test's region: every request made (and its limits read) before it begins, so
    that none of the plugin's own objects is in it (memtrack_control.Request)."""

    def __init__(self, item: pytest.Item) -> None:
        self.nodeid = item.nodeid
        limited = limits(item)
        self.keys = [f"limit.{key}" for key in limited]
        self.labels = [control.Request("label", f"limit.{key}={value}")
                       for key, value in limited.items()]
        # made now: no iterator made in the region (nor a tuple unpacked: CPython 3.11
        # unpacks one through an iterator object until the loop is specialized)
        self.pending = iter(self.labels)
        self.closing = control.Request("end", self.nodeid)
        self.began = False

    def begin(self) -> None:
        self.began = control.Request("begin", self.nodeid).send()
        if not self.began:
            if not _problems:
                _problems.append(f"{self.nodeid}: {control.last_error}")
            for request in self.labels:
                request.close()
            return
        for request in self.pending:
            if not request.send() and not _problems:
                key = self.keys[self.labels.index(request)]
                _problems.append(f"{self.nodeid}: {key}: {control.last_error}")

    def end(self) -> None:
        if not self.began:
            self.closing.close()
        elif not self.closing.send() and not _problems:
            _problems.append(f"{self.nodeid}: end: {control.last_error}")


def _called_as_function(item: pytest.Item) -> bool:
    """Whether pytest runs the item through pytest_pyfunc_call."""
    return isinstance(item, pytest.Function) and type(item).runtest is pytest.Function.runtest


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, None, None]:
    if not _active or not _called_as_function(pyfuncitem):
        yield
        return
    region = _Region(pyfuncitem)
    region.begin()
    try:
        yield
    finally:
        region.end()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if not _active or _called_as_function(item):
        yield
        return
    region = _Region(item)
    region.begin()
    try:
        yield
    finally:
        region.end()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _problems:
        terminalreporter.write_line(
            f"memtrack: some tests are not regions ({_problems[0]})", yellow=True)
