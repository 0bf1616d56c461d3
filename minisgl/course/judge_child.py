"""The child side of one graded check: run pytest on the given tests, report each outcome to the judge.

Run by judge.py inside the check's throw-away copy, in a child that its process starter
(judge_zygote.py) forked, through `run`. The nonce and the report file descriptor are taken
before pytest collects the tests, so before any code of the submission runs. Each record is one JSON line tagged with the nonce. The judge does not take
these records on trust: it also checks that every expected test is reported exactly once, and that
a canary test it planted (one that must fail with a text only the judge knows) is reported failed
with that text.
"""

from __future__ import annotations

import json
import os


def run(nonce: str, report_fd: int, tests: list[str]) -> int:
    """Run `tests` with pytest here, each record tagged with `nonce`, on the pipe `report_fd`."""
    report = os.fdopen(report_fd, "w", buffering=1)

    def send(**record: str) -> None:
        report.write(json.dumps({"nonce": nonce, **record}) + "\n")

    import pytest

    class Reporter:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_logstart(self, nodeid, location):
            send(event="start", id=nodeid)

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or (report.failed or (report.when == "setup" and report.skipped)):
                exception = ""
                if report.failed and hasattr(report.longrepr, "reprcrash"):
                    exception = str(getattr(report.longrepr.reprcrash, "message", "")).split(":")[0]
                send(event="outcome", id=report.nodeid, outcome=report.outcome, when=report.when,
                     exception=exception, message=_failure_lines(report.longreprtext) if report.failed else "")

        def pytest_keyboard_interrupt(self, excinfo):  # the run stops here: the canary never runs
            send(event="interrupted", exception=excinfo.typename)

        def pytest_collectreport(self, report):
            if report.failed:
                send(event="collect-error", id=report.nodeid, message=_failure_lines(report.longreprtext))

    code = pytest.main(["-p", "no:cacheprovider", "-p", "no:terminal", "-c", "pytest.ini", "--rootdir", ".",
                        *tests], plugins=[Reporter()])
    send(event="done", exit_code=str(int(code)))
    report.close()
    return 0


def _failure_lines(text: str) -> str:
    """The `E ...` lines of a pytest failure (what the judge may quote from, after checking them)."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return " ".join(lines or text.strip().splitlines()[-1:])[:4000]
