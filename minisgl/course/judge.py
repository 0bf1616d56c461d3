"""Run one exercise's checks on one version of its regions, where no submission can change the verdict.

Each check gets:
- a throw-away copy made from the student edition (no file of the teacher's is in it), with the
  submission's code between exercise N's markers and the reference code between the others
  (`fill`: a mistake in one exercise costs no marks in another);
- a fresh process in a session of its own (forked by judge_zygote.py, which imported torch and
  pytest once and nothing of the teacher's, and runs from a copy in the run's scratch), its
  working folder, HOME and TMPDIR inside the copy, and an environment, argv and import path
  holding no path of the teacher's checkout;
- on Linux with Landlock, a kernel wall: it may write only inside its copy, may not use TCP, nor
  signal a process outside its own check (judge_zygote.confine);
- a limit in seconds: past it, every process of the session is killed and the check is a hang.
  Whatever it started is killed when it ends: its session, any process working in its copy, and
  any stray re-parented to the zygote (a child subreaper);
- a listing of the teacher's checkout before and after (CheckoutWatch): where no Landlock wall
  stood, a change there while it ran is a check that wrote outside its copy (status escaped, no
  marks); behind the wall a change cannot be a check's, and is only reported to the console.

The verdict is decided here, not in the child. The child (judge_child.py) reports each test's
outcome on a pipe, each record tagged with a nonce it read from stdin before any submission code
ran. The judge accepts the report only if it names exactly the tests the reference run named,
each once, and if a canary test planted under a random name, which must fail with a random text,
is reported failed with that text. A report that breaks any of these is forged: no marks. A
child that dies before reporting every test crashed: no marks for the tests it did not report.
The region code itself is vetted first (region_policy.py): code that reaches outside the engine
never runs.

Messages for students are built here too, from the test files' own text only: a failure message
from the child is shown only as the string of the test's source that it contains.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minisgl.course.catalog import EXERCISES
from minisgl.course.judge_process import (PASSED_ENV, RUN_ENV, CheckoutWatch, ProcessStarter, kill_session,
                                           path_without, kill_run_processes)
from minisgl.course.make_exercise import CONFTEST, PYTEST_INI, Wrong, marked_files, replace_regions
from minisgl.course.region_policy import region_problems

EXCEPTION_NAME = re.compile(r"[A-Za-z_][\w.]{0,80}")
MAX_RECORDS, MAX_RECORD_BYTES = 10_000, 1 << 16  # a check reports a few dozen records of at most 24 KiB


@dataclass(frozen=True)
class TestVerdict:
    test: str  # the node id
    passed: bool
    rule: str = ""  # why it failed, in the test's own words


@dataclass(frozen=True)
class CheckVerdict:
    exercise: int
    status: str  # passed, failed, hang, crash, forged, refused, escaped
    tests: tuple[TestVerdict, ...]
    seconds: float
    summary: str = ""  # one line for the status other than passed/failed

    @property
    def mark(self) -> float:
        """The checker's half of the rubric: earned only when every test passes."""
        return 1.0 if self.status == "passed" else 0.0


class TestTexts:
    """The strings of each test function (and its module) in the exercise tests: the only text a
    student's message may show."""

    def __init__(self, tests_dirs: list[Path]):
        self._by_file: dict[str, tuple[list[str], dict[str, tuple[list[str], str]]]] = {}
        for folder in tests_dirs:
            for path in folder.glob("test_*.py"):
                tree = ast.parse(path.read_text())
                module = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                functions = {}
                for node in tree.body:
                    if isinstance(node, ast.FunctionDef):
                        strings = [n.value for n in ast.walk(node)
                                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                        functions[node.name] = (strings, (ast.get_docstring(node) or "").split("\n\n")[0])
                self._by_file[path.name] = (module, functions)

    def rule(self, nodeid: str, message: str, exception: str) -> str:
        """The test's own words for this failure: the longest of its strings the message holds,
        else its docstring's first paragraph; and the exception's type when it is not an assert."""
        file, _, name = nodeid.partition("::")
        name = name.split("[")[0]
        module, functions = self._by_file.get(Path(file).name, ([], {}))
        strings, doc = functions.get(name, ([], ""))
        words = " ".join(message.split())
        found = [s for s in {*strings, *module} if len(s.strip()) >= 12 and " ".join(s.split()) in words]
        # the test's name states its rule too: test_a_row_is_freed_at_once -> "a row is freed at once"
        said = max(found, key=len).strip() if found else " ".join(doc.split()) or name.removeprefix("test_").replace(
            "_", " ")
        raised = exception if EXCEPTION_NAME.fullmatch(exception or "") and exception != "AssertionError" else ""
        return f"{name}: {said[:300]}" + (f" (raised {raised})" if raised else "")


class Judge:
    """Runs checks for one grading run: `edition` is the student edition, `scratch` this run's
    private folder (removed by the caller), `fill` the code put between the other exercises'
    markers, `limit_s` the teacher's limit per check."""

    def __init__(self, edition: Path, scratch: Path, fill: dict[int, dict[str, str]], limit_s: float, token: str,
                 vet: Callable[[str], list[str]] = region_problems, guard: Path | None = None,
                 guard_skip: list[Path] = (), confine: bool = True):
        self.edition, self.scratch, self.fill, self.limit_s, self.token = edition, scratch, fill, limit_s, token
        self.vet = vet  # region code -> why it may not run (tests switch it off to reach the judge's own checks)
        # the teacher's checkout: kept out of each check's import path, PATH and argv, and watched
        self.watch = CheckoutWatch(guard, [scratch, *guard_skip]) if guard is not None else None
        self.confine = confine  # tests switch the Landlock wall off to reach the watch behind it
        self.exercise_tests = edition / "lessons" / "exercises" / "tests"
        self.texts = TestTexts([edition / "tests", self.exercise_tests])
        self.expected: dict[int, dict[str, str]] = {}  # exercise -> test -> its outcome on the reference
        self._running: set[int] = set()
        self._stopped = False
        self.starter = ProcessStarter(scratch, [str(guard)] if guard is not None else [])
        self._lock = threading.Lock()
        self._serial = 0

    def close(self) -> None:
        """Kill every check still running and the process starter: the end of grading, or an interrupt."""
        with self._lock:
            self._stopped = True
            running = list(self._running)
        for pid in running:
            kill_session(pid)
        self.starter.close()
        kill_run_processes(f"{self.token}:", self.scratch)

    # ------------------------------------------------------------------ the copy

    def _copy(self, number: int, bodies: dict[str, str]) -> tuple[Path, str, str]:
        with self._lock:
            self._serial += 1
            copy = self.scratch / f"check-{self._serial}"
        shutil.copytree(self.edition, copy, ignore=shutil.ignore_patterns(".git"), symlinks=True)
        for rel, numbers in marked_files(copy / "minisgl").items():
            path = copy / "minisgl" / rel
            source = path.read_text()
            for n in numbers:
                code = bodies if n == number else self.fill.get(n, {})
                source, _ = replace_regions(source, n, Wrong(n, "graded", "", "", code), keep_markers=True)
            path.write_text(source)
        tests = copy / "tests"
        for path in sorted(self.exercise_tests.glob("*.py")):
            shutil.copy(path, tests / path.name)
        (copy / "pytest.ini").write_text(PYTEST_INI)
        (copy / "conftest.py").write_text(CONFTEST)
        canary, secret = f"test_{secrets.token_hex(8)}", secrets.token_hex(16)
        (tests / f"{canary}.py").write_text(f"def {canary}():\n    assert False, {secret!r}\n")
        for folder in ("home", "tmp"):
            (copy / folder).mkdir()
        return copy, f"tests/{canary}.py::{canary}", secret

    # ------------------------------------------------------------------ one run

    def _run(self, copy: Path, tests: list[str]) -> tuple[list[dict], str, float]:
        """Run the child; its records (nonce checked later), how it ended, and its wall time."""
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
                pid = self.starter.start(copy, env, tests, nonce, write_fd, self.confine)
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
        code = self.starter.wait(pid, self.limit_s)
        ended = "hang" if code is None else "exited" if code == 0 else "crash"
        kill_session(pid)  # the child, or anything it left in its session
        if code is None:
            self.starter.wait(pid, 30)
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
        return [dict(r, _nonce_ok=r.get("nonce") == nonce) for r in records], ended, time.monotonic() - start

    def _verdict(self, number: int, records: list[dict], ended: str, seconds: float, canary: str, secret: str,
                 expected: dict[str, str]) -> CheckVerdict:
        outcomes: dict[str, dict] = {}
        forged, started = [], ""
        for r in records:
            if not r["_nonce_ok"]:
                forged.append("a record without the run's nonce")
            elif r.get("event") == "start":
                started = str(r.get("id"))
            elif r.get("event") == "outcome":
                test = str(r.get("id"))
                if test in outcomes and not (outcomes[test].get("outcome") == "passed" and r.get("when") != "call"):
                    forged.append(f"{test} reported twice")
                if test not in expected and test != canary:
                    forged.append(f"an unknown test {test}")
                if test not in outcomes or r.get("outcome") == "failed":
                    outcomes[test] = r
        finished = any(r["_nonce_ok"] and r.get("event") == "done" for r in records)
        tested = outcomes.get(canary)
        if finished and not (tested and tested.get("outcome") == "failed" and secret in str(tested.get("message"))):
            forged.append("the canary test was not reported failed")
        verdicts = []
        for test, outcome in expected.items():
            got = outcomes.get(test)
            if got is None:
                why = ("ran past the limit (a loop that never ends, or a wait that never returns)"
                       if ended == "hang" and test == started else "did not finish: the check was stopped"
                       if ended == "hang" else "did not report: the test process crashed")
                verdicts.append(TestVerdict(test, False, f"{test.split('::')[-1].split('[')[0]}: {why}"))
            elif got.get("outcome") == outcome:
                verdicts.append(TestVerdict(test, True))
            else:
                verdicts.append(TestVerdict(test, False, self.texts.rule(test, str(got.get("message", "")),
                                                                         str(got.get("exception", "")))))
        if forged:
            return CheckVerdict(number, "forged", tuple(TestVerdict(t, False, "the test report was tampered with")
                                                        for t in expected), seconds,
                                f"forged report: {forged[0]}")
        if ended == "hang":
            return CheckVerdict(number, "hang", tuple(verdicts), seconds,
                                f"hang: the checks ran past the limit of {self.limit_s:g} s")
        if not finished or ended == "crash":
            return CheckVerdict(number, "crash", tuple(verdicts), seconds, "crash: the test process died")
        status = "passed" if all(v.passed for v in verdicts) else "failed"
        return CheckVerdict(number, status, tuple(verdicts), seconds)

    # ------------------------------------------------------------------ the public steps

    def learn_expected(self, number: int) -> None:
        """Run exercise `number`'s checks on the reference code: the tests they must report, and
        each one's outcome (passed, or skipped where this machine lacks a GPU)."""
        copy, canary, secret = self._copy(number, self.fill[number])
        try:
            records, ended, _ = self._run(copy, [*EXERCISES[number].tests, canary.split("::")[0]])
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        outcomes = {str(r["id"]): str(r["outcome"]) for r in records
                    if r["_nonce_ok"] and r.get("event") == "outcome" and r.get("id") != canary}
        if ended != "exited" or not outcomes or "failed" in outcomes.values():
            bad = sorted(t for t, o in outcomes.items() if o == "failed")
            walled = " behind the Landlock wall (if it passes with --unconfined, the wall needs a path)" if (
                self.confine and (self.starter.confinement or {}).get("landlock")) else ""
            raise RuntimeError(f"the reference does not pass exercise {number}'s checks here{walled} ({ended}; "
                               f"failed: {bad[:3]}): no marks would be right")
        self.expected[number] = outcomes

    def check(self, number: int, bodies: dict[str, str]) -> CheckVerdict:
        """The verdict on `bodies` between exercise `number`'s markers."""
        expected = self.expected[number]
        problems = [p for code in bodies.values() for p in self.vet(code)]
        if problems:
            rule = "; ".join(dict.fromkeys(problems))[:300]
            return CheckVerdict(number, "refused", tuple(TestVerdict(t, False, rule) for t in expected), 0.0,
                                f"not run: {rule}")
        copy, canary, secret = self._copy(number, bodies)
        before = self.watch.listing() if self.watch else {}
        try:
            records, ended, seconds = self._run(copy, [*EXERCISES[number].tests, canary.split("::")[0]])
        finally:
            shutil.rmtree(copy, ignore_errors=True)
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
        return self._verdict(number, records, ended, seconds, canary, secret, expected)
