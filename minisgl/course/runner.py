"""Run an exercise's checks inside this process, against any copy of minisgl.

`make_exercise.py check` starts one pytest process per run, which is what a learner wants: pytest's
own report. Checking many copies (every known-wrong solution, or every exercise of a submission)
that way pays a fresh interpreter and a fresh `import torch` per copy. `run_checks` instead runs the
same pytest selection in this process: it swaps the `minisgl` (and `tests`) modules for the copy's,
runs pytest in-process, and puts the previous modules back, so that the caller's own `minisgl` is
untouched afterwards.

    report = run_checks(Path("lessons/exercises/work/ex2"), 2)
    report.passed                    # every selected test passed
    for outcome in report.outcomes:  # one per test, in run order
        print(outcome.nodeid, outcome.outcome, outcome.message)

A test that runs longer than `hang_s` is stopped: every thread's stack is taken (the learner's
hint to where it waits) and an exception is raised in the test's thread. A test blocked in C
code cannot take that exception; if it is still running `hang_s` later, the process exits with
the stacks on stderr (as `make_exercise.py check` does at once).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from minisgl.course.catalog import EXERCISES
from minisgl.course.make_exercise import HANG_ADVICE, HANG_S, refresh_tests


@dataclass(frozen=True)
class CheckOutcome:
    nodeid: str  # relative to the work folder, e.g. tests/test_ex2_future_map.py::test_publish
    outcome: str  # "passed", "failed" or "skipped"
    message: str  # for a failure: pytest's first `E` lines (what the learner is told) or the hang report
    details: str = ""  # for a failure: pytest's whole report of it (traceback, chained exceptions)


@dataclass(frozen=True)
class CheckReport:
    exercise: int
    minisgl: Path  # the copy the tests imported
    exit_code: int  # pytest's: 0 all passed, 1 some failed, 2+ collection or usage errors
    outcomes: tuple[CheckOutcome, ...]
    warnings: tuple[str, ...] = ()  # pytest's warnings, e.g. an exception raised in a thread the test started

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and all(o.outcome != "failed" for o in self.outcomes)

    @property
    def first_failure(self) -> CheckOutcome | None:
        return next((o for o in self.outcomes if o.outcome == "failed"), None)


class TestHung(BaseException):
    """Raised in a test's thread when it ran past hang_s (a BaseException: `except Exception` in the
    code under test must not swallow it)."""


def failure_lines(longrepr: str) -> str:
    """The `E ...` lines of a pytest failure, joined: the message the learner reads."""
    lines = longrepr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("E ")), None)
    if start is None:
        return longrepr.strip()
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("E ")), len(lines))
    return " ".join(line[1:].strip() for line in lines[start:end])


class _Collector:
    """pytest plugin: one CheckOutcome per test, and the hang guard around each test."""

    def __init__(self, hang_s: float):
        self.hang_s = hang_s
        self.outcomes: list[CheckOutcome] = []
        self.hang_report: dict[str, str] = {}
        self.warnings: list[str] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        test_thread, finished = threading.get_ident(), threading.Event()

        def stop_the_test() -> None:
            if finished.is_set():  # the test ended as the timer fired: an exception now would hit pytest itself
                return
            with tempfile.TemporaryFile("w+") as stacks:
                faulthandler.dump_traceback(stacks, all_threads=True)
                stacks.seek(0)
                self.hang_report[item.nodeid] = (
                    f"HANG: {item.nodeid} ran longer than {self.hang_s:g} s and was stopped. Every thread's "
                    f"stack:\n{stacks.read()}\n{HANG_ADVICE}")
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(test_thread), ctypes.py_object(TestHung))

        watchdog = threading.Timer(self.hang_s, stop_the_test)
        watchdog.daemon = True
        watchdog.start()
        # the backstop for a test that cannot take the exception (blocked in C): exit with the stacks
        faulthandler.dump_traceback_later(2 * self.hang_s, exit=True, file=sys.__stderr__)
        try:
            yield
        finally:
            finished.set()
            faulthandler.cancel_dump_traceback_later()
            watchdog.cancel()

    def pytest_runtest_logreport(self, report):
        failed_outside_call = report.when != "call" and report.failed
        if report.when == "call" or failed_outside_call or (report.when == "setup" and report.skipped):
            message = details = ""
            if report.failed:
                details = report.longreprtext
                message = self.hang_report.get(report.nodeid) or failure_lines(details)
            self.outcomes.append(CheckOutcome(report.nodeid, report.outcome, message, details))

    def pytest_warning_recorded(self, warning_message, nodeid):
        self.warnings.append(f"{nodeid}: {warning_message.message}")

    def pytest_collectreport(self, report):
        if report.failed:  # e.g. a learner's copy that does not import
            self.outcomes.append(CheckOutcome(report.nodeid, "failed", failure_lines(report.longreprtext),
                                              report.longreprtext))


def _is_swapped(name: str) -> bool:
    """The modules that must come from the copy under test: minisgl and the tests that import it."""
    return name.split(".")[0] in ("minisgl", "tests", "conftest")


@contextmanager
def _imports_from(work: Path) -> Iterator[None]:
    """Within the block, `import minisgl` (and `tests`) find the copy in `work`; afterwards the
    caller's modules are back. (Only these names are swapped: dropping every module imported
    meanwhile would import torch's lazily loaded parts twice.)"""
    kept = {name: module for name, module in sys.modules.items() if _is_swapped(name)}
    for name in kept:
        del sys.modules[name]
    sys.path.insert(0, str(work))
    cwd = os.getcwd()
    os.chdir(work)  # the catalog's node ids are relative to the work folder
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path.remove(str(work))
        for name in [name for name in sys.modules if _is_swapped(name)]:
            del sys.modules[name]
        sys.modules.update(kept)


def run_checks(work: Path, number: int, *, tests: Sequence[str] | None = None, stop_at_first_failure: bool = False,
               hang_s: float = HANG_S) -> CheckReport:
    """Run exercise `number`'s tests (the catalog's selection, or `tests`: node ids relative to
    `work`) against `work/minisgl`, in this process. `work` is an exercise folder (as made by
    `make_exercise.py generate`); its tests/ are refreshed from the repository first."""
    work = Path(work).resolve()
    if not (work / "minisgl" / "__init__.py").exists():
        raise FileNotFoundError(f"no minisgl package in {work}")
    refresh_tests(work)
    collector = _Collector(hang_s)
    args = ["-p", "no:terminal", "-p", "no:cacheprovider", "--rootdir", str(work), "-c", str(work / "pytest.ini")]
    if stop_at_first_failure:
        args.append("-x")
    args += list(tests if tests is not None else EXERCISES[number].tests)
    with _imports_from(work):
        exit_code = int(pytest.main(args, plugins=[collector]))
        imported = Path(sys.modules["minisgl"].__file__).resolve() if "minisgl" in sys.modules else work / "minisgl"
    return CheckReport(number, imported.parent, exit_code, tuple(collector.outcomes), tuple(collector.warnings))
