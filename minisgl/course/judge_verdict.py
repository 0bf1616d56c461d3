"""The verdict on one check, read from the report its child sent and the way its process ended.

The verdict is decided here, not in the child. The child (judge_child.py) reports each test's
outcome on a pipe, each record tagged with a nonce it read from stdin before any submission code
ran. The judge accepts the report only if it names exactly the tests the reference run named,
each once, and if a canary test planted under a random name, which must fail with a random text,
is reported failed with that text. A report that breaks any of these is forged: no marks. A
run that pytest reports interrupted (a KeyboardInterrupt raised by the checked code) never
reaches the canary: it is interrupted, no marks. A child that dies before reporting every test
crashed: no marks for the tests it did not report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minisgl.course.judge_messages import EXCEPTION_NAME, TestTexts


@dataclass(frozen=True)
class TestVerdict:
    test: str  # the node id
    passed: bool
    rule: str = ""  # why it failed, in the test's own words


@dataclass(frozen=True)
class CheckVerdict:
    exercise: int
    status: str  # passed, failed, hang, crash, memory limit, interrupted, forged, refused, escaped
    tests: tuple[TestVerdict, ...]
    seconds: float
    summary: str = ""  # one line for the status other than passed/failed

    @property
    def mark(self) -> float:
        """The checker's half of the rubric: earned only when every test passes."""
        return 1.0 if self.status == "passed" else 0.0


OUT_OF_MEMORY = re.compile(r"MemoryError|can't allocate memory|Cannot allocate memory|bad_alloc")


def _out_of_memory(record: dict) -> bool:
    """A failure caused by an allocation refused at the memory limit: torch's CPU allocator, or
    Python's MemoryError, or C++'s bad_alloc. (A check could fake one: it would earn nothing.)"""
    return record.get("outcome") == "failed" and bool(
        OUT_OF_MEMORY.search(f"{record.get('exception')} {record.get('message')}"))


@dataclass
class ReportReader:
    """Turns a check's report into its verdict; the judge (Judge, judge.py) holds one. Its summaries
    name the limits (`limit_s` per check, `memory_gib` per process, 0: none); `texts` gives a failed
    test's rule in the test file's own words."""

    limit_s: float
    texts: TestTexts
    memory_gib: float = 0.0

    def over_memory(self, records: list[dict], peak_rss: int) -> bool:
        """Whether a check went past the memory limit: an allocation refused there (Linux enforces
        the limit), or a peak resident size above it (macOS sets the limit but may not enforce it)."""
        return bool(self.memory_gib) and (peak_rss > self.memory_gib * (1 << 30) or any(map(_out_of_memory, records)))

    def verdict(self, number: int, records: list[dict], ended: str, seconds: float, canary: str, secret: str,
                expected: dict[str, str], peak_rss: int = 0) -> CheckVerdict:
        outcomes: dict[str, dict] = {}
        forged, started, interrupted = [], "", ""  # forged: the judge's own words, never the child's text
        for r in records:
            if not r["_nonce_ok"]:
                forged.append("a record without the run's nonce")
            elif r.get("event") == "start":
                started = str(r.get("id"))
            elif r.get("event") == "interrupted":
                said = str(r.get("exception"))
                interrupted = said if EXCEPTION_NAME.fullmatch(said) else "an interrupt"
            elif r.get("event") == "outcome":
                test = str(r.get("id"))
                if test in outcomes and not (outcomes[test].get("outcome") == "passed" and r.get("when") != "call"):
                    forged.append("a test reported twice")
                if test not in expected and test != canary:
                    forged.append("a test the reference run did not report")
                if test not in outcomes or r.get("outcome") == "failed":
                    outcomes[test] = r
        finished = any(r["_nonce_ok"] and r.get("event") == "done" for r in records)
        tested = outcomes.get(canary)
        # an interrupted run never reaches the canary; claiming an interrupt earns nothing either
        if finished and not interrupted and not (
                tested and tested.get("outcome") == "failed" and secret in str(tested.get("message"))):
            forged.append("the canary test was not reported failed")
        if forged:
            return CheckVerdict(number, "forged", tuple(TestVerdict(t, False, "the test report was tampered with")
                                                        for t in expected), seconds,
                                f"forged report: {forged[0]}")
        if interrupted:
            status, summary = "interrupted", f"the check was interrupted ({interrupted} raised by the submission)"
        elif ended == "hang":
            status, summary = "hang", f"hang: the checks ran past the limit of {self.limit_s:g} s"
        elif self.over_memory(records, peak_rss):
            status, summary = "memory limit", f"memory limit: used more than {self.memory_gib:g} GiB"
        elif not finished or ended == "crash":
            status, summary = "crash", "crash: the test process died"
        else:
            status, summary = "", ""  # passed or failed: the tests say
        verdicts = tuple(self._test_verdict(test, outcome, outcomes.get(test), status, summary, test == started)
                         for test, outcome in expected.items())
        status = status or ("passed" if all(v.passed for v in verdicts) else "failed")
        return CheckVerdict(number, status, verdicts, seconds, summary)

    def _test_verdict(self, test: str, expected: str, got: dict | None, status: str, summary: str,
                      last_started: bool) -> TestVerdict:
        """One test's verdict in a check that ended with `status` ('' where it ran to its end)."""
        name = test.split("::")[-1].split("[")[0]
        if got is None:
            why = ("ran past the limit (a loop that never ends, or a wait that never returns)"
                   if status == "hang" and last_started else "did not finish: the check was stopped"
                   if status == "hang" else f"did not run: {summary}" if status == "interrupted"
                   else "did not report: the test process crashed")
            return TestVerdict(test, False, f"{name}: {why}")
        if got.get("outcome") == expected:
            return TestVerdict(test, True)
        if status == "memory limit" and _out_of_memory(got):
            return TestVerdict(test, False, f"{name}: {summary}")
        return TestVerdict(test, False, self.texts.rule(test, str(got.get("message", "")),
                                                        str(got.get("exception", ""))))
