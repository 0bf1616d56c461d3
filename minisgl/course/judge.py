"""Run one exercise's checks on one version of its regions, where no submission can change the verdict.

Each check gets:
- a throw-away copy made from the student edition (no file of the teacher's is in it), with the
  submission's code between exercise N's markers and the reference code between the others
  (`fill`: a mistake in one exercise costs no marks in another), written by judge_copy.py;
- a fresh process in a session of its own (forked by judge_zygote.py, which imported torch and
  pytest once and nothing of the teacher's, and runs from a copy in the run's scratch), its
  working folder, HOME and TMPDIR inside the copy, and an environment, argv and import path
  holding no path of the teacher's checkout;
- on Linux with Landlock, a kernel wall: it may write only inside its copy, read only there and
  in the interpreter's and the system's folders, may not use TCP, nor signal a process outside
  its own check (judge_zygote.confine);
- a limit in seconds: past it, every process of the session is killed and the check is a hang.
  Whatever it started is killed when it ends: its session, any process working in its copy, and
  any stray re-parented to the zygote (a child subreaper);
- a memory limit per process (RLIMIT_DATA; RLIMIT_AS would also count the address space that
  libraries reserve and never use): an allocation past it fails, and a failure that it caused,
  or a peak resident size above it (where the OS does not enforce the limit: macOS), is a check
  over the memory limit: no marks;
- a listing of the teacher's checkout before and after (CheckoutWatch): where no Landlock wall
  stood, a change there while it ran is a check that wrote outside its copy (status escaped, no
  marks); behind the wall a change cannot be a check's, and is only reported to the console.

The verdict is decided by the judge, not in the child (judge_verdict.py): a report the child could
have forged earns no marks, and a student sees each failure only in the test file's own words
(judge_messages.py). The region code itself is vetted first (region_policy.py): code that reaches
outside the engine never runs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from minisgl.course.catalog import EXERCISES
from minisgl.course.judge_copy import write_check_copy
from minisgl.course.judge_messages import TestTexts
from minisgl.course.judge_process import (PASSED_ENV, RUN_ENV, CheckoutWatch, ProcessStarter, kill_session,
                                           path_without, kill_run_processes)
from minisgl.course.judge_verdict import CheckVerdict, ReportReader, TestVerdict
from minisgl.course.region_policy import refusal, region_problems

MAX_RECORDS, MAX_RECORD_BYTES = 10_000, 1 << 16  # a check reports a few dozen records of at most 24 KiB


class Judge:
    """Runs checks for one grading run: `edition` is the student edition, `scratch` this run's
    private folder (removed by the caller), `fill` the code put between the other exercises'
    markers, `limit_s` the teacher's limit per check, `memory_gib` the memory a check's process
    may take (0: no limit)."""

    def __init__(self, edition: Path, scratch: Path, fill: dict[int, dict[str, str]], limit_s: float, token: str,
                 vet: Callable[[str], list[str]] = region_problems, guard: Path | None = None,
                 guard_skip: list[Path] = (), confine: bool = True, memory_gib: float = 0.0):
        self.edition, self.scratch, self.fill, self.token = edition, scratch, fill, token
        self.vet = vet  # region code -> why it may not run (tests switch it off to reach the judge's own checks)
        # the teacher's checkout: kept out of each check's import path, PATH and argv, and watched
        self.watch = CheckoutWatch(guard, [scratch, *guard_skip]) if guard is not None else None
        self.confine = confine  # tests switch the Landlock wall off to reach the watch behind it
        self.exercise_tests = edition / "lessons" / "exercises" / "tests"
        self.report_reader = ReportReader(limit_s, TestTexts([edition / "tests", self.exercise_tests]), memory_gib)
        self.expected: dict[int, dict[str, str]] = {}  # exercise -> test -> its outcome on the reference
        self._running: set[int] = set()
        self._stopped = False
        self.starter = ProcessStarter(scratch, [str(guard)] if guard is not None else [])
        self._lock = threading.Condition()
        self._in_scratch = 0  # checks with a copy in the scratch folder (close() waits for them)
        self._serial = 0

    def close(self) -> None:
        """Kill every check still running and the process starter: the end of grading, or an interrupt.
        Returns once no check is left in the scratch folder (its caller removes it next: a check
        still copying would write it back)."""
        with self._lock:
            self._stopped = True
            running = list(self._running)
        for pid in running:
            kill_session(pid)
        self.starter.close()
        kill_run_processes(f"{self.token}:", self.scratch)
        with self._lock:
            self._lock.wait_for(lambda: self._in_scratch == 0, timeout=60)

    @contextmanager
    def _checking(self):
        """A check's time in the scratch folder, from its copy to the copy's removal: none begins
        once the judge is closed."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("grading was stopped")
            self._in_scratch += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_scratch -= 1
                self._lock.notify_all()

    # ------------------------------------------------------------------ one run

    def _run(self, copy: Path, tests: list[str]) -> tuple[list[dict], str, float, int]:
        """Run the child; its records (nonce checked later), how it ended, its wall time and its
        peak resident memory in bytes."""
        nonce = secrets.token_hex(16)
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.update(path_without(self.starter.hidden))
        token = f"{self.token}:{copy.name}:"  # this check's processes, and no other check's
        env.update(HOME=str(copy / "home"), TMPDIR=str(copy / "tmp"), TEMP=str(copy / "tmp"), TMP=str(copy / "tmp"),
                   XDG_CACHE_HOME=str(copy / "home" / ".cache"), PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1",
                   PYTHONUTF8="1", **{RUN_ENV: token})
        read_fd, write_fd = os.pipe()
        start = time.monotonic()
        with self._lock:
            if self._stopped:  # the grader is being interrupted: start nothing more
                os.close(read_fd), os.close(write_fd)
                raise RuntimeError("grading was stopped")
            try:
                pid = self.starter.start(copy, env, tests, nonce, write_fd, self.confine,
                                         int(self.report_reader.memory_gib * (1 << 30)))
            finally:
                os.close(write_fd)
            self._running.add(pid)
        lines: list[bytes] = []

        def read_report() -> None:
            with os.fdopen(read_fd, "rb") as report:
                for line in report:
                    if len(lines) < MAX_RECORDS:  # a flood is read to its end and dropped: no unbounded memory
                        lines.append(line[:MAX_RECORD_BYTES])

        reader = threading.Thread(target=read_report, daemon=True)
        reader.start()
        done = self.starter.wait(pid, self.report_reader.limit_s)
        ended = "hang" if done is None else "exited" if done.code == 0 else "crash"
        kill_session(pid)  # the child, or anything it left in its session
        if done is None:
            done = self.starter.wait(pid, 30)
        kill_run_processes(token, copy)
        with self._lock:
            self._running.discard(pid)
        reader.join(timeout=10)
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                record = {"nonce": None}
            records.append(record if isinstance(record, dict) else {"nonce": None})
        return ([dict(r, _nonce_ok=r.get("nonce") == nonce) for r in records], ended, time.monotonic() - start,
                done.peak_rss if done else 0)

    def _check_in_copy(self, number: int, bodies: dict[str, str]) -> tuple[list[dict], str, float, int, str, str]:
        """Exercise `number`'s checks on `bodies`, in a copy removed after: _run's four results, and
        the canary's test and secret."""
        with self._checking():
            with self._lock:
                self._serial += 1
                copy = self.scratch / f"check-{self._serial}"
            canary, secret = write_check_copy(copy, self.edition, self.exercise_tests, {**self.fill, number: bodies})
            try:
                return (*self._run(copy, [*EXERCISES[number].tests, canary.split("::")[0]]), canary, secret)
            finally:
                shutil.rmtree(copy, ignore_errors=True)

    # ------------------------------------------------------------------ the public steps

    def learn_expected(self, number: int) -> None:
        """Run exercise `number`'s checks on the reference code: the tests they must report, and
        each one's outcome (passed, or skipped where this machine lacks a GPU)."""
        records, ended, _, peak_rss, canary, _ = self._check_in_copy(number, self.fill[number])
        outcomes = {str(r["id"]): str(r["outcome"]) for r in records
                    if r["_nonce_ok"] and r.get("event") == "outcome" and r.get("id") != canary}
        if ended != "exited" or not outcomes or "failed" in outcomes.values():
            bad = sorted(t for t, o in outcomes.items() if o == "failed")
            walled = " behind the Landlock wall (if it passes with --unconfined, the wall needs a path)" if (
                self.confine and (self.starter.confinement or {}).get("landlock")) else ""
            if self.report_reader.over_memory([r for r in records if r["_nonce_ok"]], peak_rss):
                walled += f" under the memory limit of {self.report_reader.memory_gib:g} GiB (raise --memory-limit)"
            raise RuntimeError(f"the reference does not pass exercise {number}'s checks here{walled} ({ended}; "
                               f"failed: {bad[:3]}): no marks would be right")
        self.expected[number] = outcomes

    def check(self, number: int, bodies: dict[str, str]) -> CheckVerdict:
        """The verdict on `bodies` between exercise `number`'s markers."""
        expected = self.expected[number]
        refused = refusal(bodies, self.vet)
        if refused:
            return CheckVerdict(number, "refused", tuple(TestVerdict(t, False, refused) for t in expected), 0.0,
                                refused)
        before = self.watch.listing() if self.watch else {}
        records, ended, seconds, peak_rss, canary, secret = self._check_in_copy(number, bodies)
        changed = self.watch.changed(before, self.watch.listing()) if self.watch else []
        confined = self.confine and bool((self.starter.confinement or {}).get("landlock"))
        if changed:  # the paths go to the teacher's console only: no name of the teacher's reaches a sheet
            print(f"warning: the teacher's checkout changed while a check of exercise {number} ran: "
                  f"{', '.join(changed[:5])}" + (" (the checks are confined by Landlock: not a check's doing; "
                                                 "was the checkout edited during grading?)" if confined else ""),
                  file=sys.stderr, flush=True)
        if changed and not confined:  # no wall kept the check in its copy: it, or one beside it, wrote here
            rule = "wrote outside its copy (into the teacher's checkout)"
            return CheckVerdict(number, "escaped", tuple(TestVerdict(t, False, rule) for t in expected), seconds,
                                f"escaped: {rule}")
        return self.report_reader.verdict(number, records, ended, seconds, canary, secret, expected, peak_rss)
