"""The HTTP process's grammar checks in child processes (minisgl/server/grammar_checker.py): a
check past its time limit, or whose client left, has its child killed; the others go on in
other children, and a killed child is replaced. Each child imports xgrammar (and torch): seconds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisgl.server.grammar_checker import GrammarChecker
from minisgl.server.messages import GrammarSpec

pytestmark = pytest.mark.full  # child processes that import torch, and waits of seconds

ROOT = Path(__file__).resolve().parents[1]
# A schema within every request limit that xgrammar takes long to parse, before any compile: a
# string pattern's repetition bound costs about its square (benchmarks/history/, "Grammar checks
# in child processes").
SLOW = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "[a-z]{0,30000}"}))
FAST = GrammarSpec("regex", "(yes|no) [0-9]+")
LIMIT_S = 1.0


def thread_states(pid: int) -> set[str]:
    """The state letter of each of a process's threads (R running, S sleeping, Z exited); empty once
    it has been reaped (Linux /proc). A killed process's main thread shows Z before the others exit."""
    try:
        return {path.read_text().rsplit(")", 1)[1].split()[0] for path in Path(f"/proc/{pid}/task").glob("*/stat")}
    except FileNotFoundError:  # reaped while it was read
        return set()


def gone(pid: int, within_s: float = 10.0, zombie: bool = False) -> bool:
    """Every thread of the process exits within the time, and it is reaped (unless `zombie`)."""
    deadline = time.monotonic() + within_s
    while (states := thread_states(pid)) and not (zombie and states == {"Z"}):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def pids(checker: GrammarChecker) -> set[int]:
    return {child.process.pid for child in checker.children}


def test_a_check_past_its_limit_kills_its_child_and_the_pool_replaces_it():
    async def main() -> None:
        checker = GrammarChecker(workers=1)
        try:
            await checker.check(FAST, LIMIT_S)
            with pytest.raises(ValueError, match="invalid regex"):
                await checker.check(GrammarSpec("regex", "(a"), LIMIT_S)
            [first] = pids(checker)  # a bad grammar keeps its child
            start = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await checker.check(SLOW, LIMIT_S)
            assert time.monotonic() - start < LIMIT_S + 1.0
            assert gone(first) and pids(checker) == set()
            await checker.check(FAST, LIMIT_S)  # in a new child
            [second] = pids(checker)
            os.kill(second, signal.SIGKILL)  # from outside, while idle: nobody waits on its pipe
            assert gone(second, zombie=True)
            await checker.check(FAST, LIMIT_S)  # finds it dead, reaps it, and starts a third
            [third] = pids(checker)
            assert thread_states(second) == set() and len({first, second, third}) == 3
        finally:
            checker.close()
        assert gone(third)

    asyncio.run(main())


def test_a_slow_check_holds_up_no_other_and_a_cancelled_one_ends_its_child():
    """While one child parses the slow grammar (its client still there), the other checks the
    next grammars; the slow one's client leaving (its check cancelled) kills its child."""
    async def main() -> None:
        checker = GrammarChecker(workers=2)
        try:
            await checker.check(FAST, LIMIT_S)  # one child, ready
            slow = asyncio.ensure_future(checker.check(SLOW, 60.0))
            await asyncio.sleep(0.5)
            [busy] = pids(checker)
            start = time.monotonic()
            for _ in range(3):
                await checker.check(FAST, LIMIT_S)  # the first in a second child, started for it
            assert not slow.done() and time.monotonic() - start < 15.0
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            assert gone(busy) and len(pids(checker)) == 1
        finally:
            checker.close()

    asyncio.run(main())


CHECKS_AND_WAITS = f"""
import asyncio, sys
from minisgl.server.grammar_checker import GrammarChecker
from minisgl.server.messages import GrammarSpec

async def main():
    checker = GrammarChecker(workers=1)
    asyncio.ensure_future(checker.check(GrammarSpec("json_schema", {SLOW.text!r}), 600.0))
    await asyncio.sleep(0.5)
    print(*(child.process.pid for child in checker.children), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_child_ends_with_the_http_process_even_mid_parse():
    """An HTTP process killed (or gone at once on a second Ctrl-C) closes nothing in order."""
    parent = subprocess.Popen([sys.executable, "-c", CHECKS_AND_WAITS], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        child = int(parent.stdout.readline())
        time.sleep(4.0)  # it has imported xgrammar and parses
        assert "R" in thread_states(child)
    finally:
        parent.kill()
        parent.wait()
    assert gone(child, zombie=True)  # whoever adopted it may not have reaped it yet


def test_closing_refuses_the_checks_running_and_waiting_and_starts_no_child():
    """The server's drain closes the checker: a check in progress and one waiting for its turn end
    with CheckerClosed (the app's 503), their child is gone, and a later check starts none."""
    from minisgl.server.grammar_checker import CheckerClosed

    async def main() -> None:
        checker = GrammarChecker(workers=1)
        running = asyncio.ensure_future(checker.check(SLOW, 60.0))
        waiting = asyncio.ensure_future(checker.check(FAST, 60.0))
        while not (checker.children and next(iter(checker.children)).ready):
            await asyncio.sleep(0.05)
        [pid] = pids(checker)
        checker.close()
        for check in (running, waiting):
            with pytest.raises(CheckerClosed):
                await check
        with pytest.raises(CheckerClosed):
            await checker.check(FAST, 60.0)
        assert checker.children == set() and gone(pid)

    asyncio.run(main())
