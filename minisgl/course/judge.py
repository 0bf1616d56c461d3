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
- a memory limit per process (RLIMIT_DATA; RLIMIT_AS would also count the address space that
  libraries reserve and never use): an allocation past it fails, and a failure that it caused,
  or a peak resident size above it (where the OS does not enforce the limit: macOS), is a check
  over the memory limit: no marks;
- a listing of the teacher's checkout before and after (CheckoutWatch): where no Landlock wall
  stood, a change there while it ran is a check that wrote outside its copy (status escaped, no
  marks); behind the wall a change cannot be a check's, and is only reported to the console.

The verdict is decided here, not in the child. The child (judge_child.py) reports each test's
outcome on a pipe, each record tagged with a nonce it read from stdin before any submission code
ran. The judge accepts the report only if it names exactly the tests the reference run named,
each once, and if a canary test planted under a random name, which must fail with a random text,
is reported failed with that text. A report that breaks any of these is forged: no marks. A
run that pytest reports interrupted (a KeyboardInterrupt raised by the checked code) never
reaches the canary: it is interrupted, no marks. A child that dies before reporting every test
crashed: no marks for the tests it did not report.
The region code itself is vetted first (region_policy.py): code that reaches outside the engine
never runs.

Messages for students are built here too, from the test files' own text only: a failure is
shown as the message the test wrote for it (TestTexts), with the values the run put in shown
only where they are numbers or strings of the test file.
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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minisgl.course.catalog import EXERCISES
from minisgl.course.judge_process import (PASSED_ENV, RUN_ENV, CheckoutWatch, ProcessStarter, kill_session,
                                           path_without, kill_run_processes)
from minisgl.course.make_exercise import CONFTEST, PYTEST_INI, Wrong, replace_regions
from minisgl.course.markers import marked_files
from minisgl.course.region_policy import refusal, region_problems

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
    status: str  # passed, failed, hang, crash, memory limit, interrupted, forged, refused, escaped
    tests: tuple[TestVerdict, ...]
    seconds: float
    summary: str = ""  # one line for the status other than passed/failed

    @property
    def mark(self) -> float:
        """The checker's half of the rubric: earned only when every test passes."""
        return 1.0 if self.status == "passed" else 0.0


Template = tuple[str | None, ...]  # a failure message as a test writes it: its text, None where it puts a value in
MAX_TEMPLATES = 64  # the messages one expression can give (each choice, x if c else y, doubles them)
SHOWN_VALUE = re.compile(r"[-+]?\d+(\.\d+)?|True|False|None")  # a value of a message shown as it came


def _templates(expr: ast.expr, names: dict[str, ast.expr]) -> list[Template]:
    """The messages an expression of a test can give: a string; an f-string, whose values are
    holes, except a name of the file bound to a message (`{RULE}`); such a name; a sum or a choice
    (`x if c else y`) of these. Anything else is one hole."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [(expr.value,)]
    if isinstance(expr, ast.Name) and expr.id in names:
        inner = dict(names)
        return _templates(inner.pop(expr.id), inner)  # each name read once: no loop through names
    if isinstance(expr, ast.FormattedValue) and expr.conversion == -1 and expr.format_spec is None:
        return _templates(expr.value, names)
    if isinstance(expr, ast.JoinedStr):
        found: list[Template] = [()]
        for value in expr.values:
            found = [a + b for a in found for b in _templates(value, names)][:MAX_TEMPLATES]
        return found
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return [a + b for a in _templates(expr.left, names) for b in _templates(expr.right, names)][:MAX_TEMPLATES]
    if isinstance(expr, ast.IfExp):
        return (_templates(expr.body, names) + _templates(expr.orelse, names))[:MAX_TEMPLATES]
    return [(None,)]


def _messages(node: ast.AST) -> list[ast.expr]:
    """The failure messages written under `node`: `assert x, MESSAGE`, `raise SomeError(MESSAGE, ...)`
    and `pytest.fail(MESSAGE)`."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert) and sub.msg is not None:
            found.append(sub.msg)
        elif isinstance(sub, ast.Raise) and isinstance(sub.exc, ast.Call) and sub.exc.args:
            found.append(sub.exc.args[0])
        elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "fail"
              and sub.args):
            found.append(sub.args[0])
    return found


def _bound_once(nodes: list[ast.AST]) -> dict[str, ast.expr]:
    """Names assigned exactly once among `nodes` (`RULE = "..."`), with their values: a name bound
    twice could hold either, and stays a hole."""
    bound: dict[str, list[ast.expr]] = {}
    for node in nodes:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(node.value)
    return {name: values[0] for name, values in bound.items() if len(values) == 1}


def _words(text: str) -> str:
    return " ".join(text.split())


class TestTexts:
    """The failure messages of each test function (and of its module's helpers), as the test files
    write them: the only text a student's rule may show. A rule is the message the student saw,
    with each value in it shown only where it is a number or a string of the test file (anything
    else, which the checked code could have put there, shows as `…`)."""

    def __init__(self, tests_dirs: list[Path]):
        # file -> (its templates, its strings, test name -> (the test's templates, its docstring's first paragraph))
        self._by_file: dict[str, tuple[list[Template], set[str], dict[str, tuple[list[Template], str]]]] = {}
        for folder in tests_dirs:
            for path in folder.glob("test_*.py"):
                tree = ast.parse(path.read_text())
                names = _bound_once(tree.body)
                strings = {_words(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                           and isinstance(n.value, str)}
                functions, everywhere = {}, []
                for node in tree.body:
                    own = dict(names, **_bound_once(list(ast.walk(node)))) if isinstance(node, ast.FunctionDef) \
                        else names
                    found = [t for message in _messages(node) for t in _templates(message, own)]
                    everywhere += found
                    if isinstance(node, ast.FunctionDef):
                        functions[node.name] = (found, (ast.get_docstring(node) or "").split("\n\n")[0])
                self._by_file[path.name] = (everywhere, strings, functions)

    def rule(self, nodeid: str, message: str, exception: str) -> str:
        """The test's own words for this failure: the message it wrote that the failure holds (its
        own messages before its file's helpers'), else its docstring's first paragraph, else its
        name; and the exception's type when it is not an assert."""
        file, _, name = nodeid.partition("::")
        name = name.split("[")[0]
        everywhere, strings, functions = self._by_file.get(Path(file).name, ([], set(), {}))
        templates, doc = functions.get(name, ([], ""))
        words = _words(message)
        said = next((best for group in (templates, everywhere) if (best := max(
            (r for r in (_render(t, words, strings) for t in group) if r), default=None))), None)
        # the test's name states its rule too: test_a_row_is_freed_at_once -> "a row is freed at once"
        said_text = said[1] if said else _words(doc) or name.removeprefix("test_").replace("_", " ")
        raised = exception if EXCEPTION_NAME.fullmatch(exception or "") and exception != "AssertionError" else ""
        return f"{name}: {said_text}" + (f" (raised {raised})" if raised else "")


def _render(template: Template, words: str, strings: set[str]) -> tuple[int, str] | None:
    """Where `words` (a failure, whitespace collapsed) holds the template's text, in order: how
    much text matched and the template's sentence, each hole shown as the failure fills it if that
    is a number or a string of the test file, else as `…`. None if the text is not all there (or
    is under 12 characters: too little to tell one message from another)."""
    parts: list[str | None] = []
    for part in template:  # adjacent texts, and adjacent holes, are one
        if part is not None and parts and parts[-1] is not None:
            parts[-1] += part
        elif part is not None or not parts or parts[-1] is not None:
            parts.append(part)
    found, pos, matched = [], 0, 0  # found: (start, end) of each text part in words
    for part in parts:
        text = _words(part) if part is not None else ""
        start = words.find(text, pos) if text else pos
        if start < 0:
            return None
        found.append((start, start + len(text)))
        pos, matched = start + len(text), matched + len(text)
    if matched < 12:
        return None
    shown = []
    for i, part in enumerate(parts):
        if part is not None:
            shown.append(part)
            continue
        value = words[found[i - 1][1] if i else 0:found[i + 1][0] if i + 1 < len(parts) else len(words)].strip()
        if i == 0:  # the exception's name before the message
            value = re.sub(r"^[A-Za-z_][\w.]*: ", "", value)
        if i == len(parts) - 1:  # pytest's explanation of the assert after it
            value = value.split(" assert ")[0]
        shown.append(value if SHOWN_VALUE.fullmatch(value) or _words(value).strip("'\"") in strings else "…")
    return matched, _words("".join(shown))


OUT_OF_MEMORY = re.compile(r"MemoryError|can't allocate memory|Cannot allocate memory|bad_alloc")


def _out_of_memory(record: dict) -> bool:
    """A failure caused by an allocation refused at the memory limit: torch's CPU allocator, or
    Python's MemoryError, or C++'s bad_alloc. (A check could fake one: it would earn nothing.)"""
    return record.get("outcome") == "failed" and bool(
        OUT_OF_MEMORY.search(f"{record.get('exception')} {record.get('message')}"))


class Judge:
    """Runs checks for one grading run: `edition` is the student edition, `scratch` this run's
    private folder (removed by the caller), `fill` the code put between the other exercises'
    markers, `limit_s` the teacher's limit per check, `memory_gib` the memory a check's process
    may take (0: no limit)."""

    memory_gib: float = 0.0

    def __init__(self, edition: Path, scratch: Path, fill: dict[int, dict[str, str]], limit_s: float, token: str,
                 vet: Callable[[str], list[str]] = region_problems, guard: Path | None = None,
                 guard_skip: list[Path] = (), confine: bool = True, memory_gib: float = 0.0):
        self.edition, self.scratch, self.fill, self.limit_s, self.token = edition, scratch, fill, limit_s, token
        self.memory_gib = memory_gib
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
                                         int(self.memory_gib * (1 << 30)))
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
        done = self.starter.wait(pid, self.limit_s)
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

    def _over_memory(self, records: list[dict], peak_rss: int) -> bool:
        """Whether a check went past the memory limit: an allocation refused there (Linux enforces
        the limit), or a peak resident size above it (macOS sets the limit but may not enforce it)."""
        return bool(self.memory_gib) and (peak_rss > self.memory_gib * (1 << 30) or any(map(_out_of_memory, records)))

    def _verdict(self, number: int, records: list[dict], ended: str, seconds: float, canary: str, secret: str,
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
        elif self._over_memory(records, peak_rss):
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

    def _check_in_copy(self, number: int, bodies: dict[str, str]) -> tuple[list[dict], str, float, int, str, str]:
        """Exercise `number`'s checks on `bodies`, in a copy removed after: _run's four results, and
        the canary's test and secret."""
        with self._checking():
            copy, canary, secret = self._copy(number, bodies)
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
            if self._over_memory([r for r in records if r["_nonce_ok"]], peak_rss):
                walled += f" under the memory limit of {self.memory_gib:g} GiB (raise --memory-limit)"
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
        return self._verdict(number, records, ended, seconds, canary, secret, expected, peak_rss)
