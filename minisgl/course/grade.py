"""Grade a class: every exercise of every submission, and whether code outside the regions changed.

    python -m minisgl.course.grade SUBMISSIONS_DIR --out DIR [--jobs 2] [--exercises 1 2]

Each entry of SUBMISSIONS_DIR is one student (named by the entry): either a student-edition work
tree (a folder, as written by student_edition.py and then edited), or a patch against the student
edition (`NAME.patch` or `NAME.diff`, as `git diff` writes it in the student's tree).

Per student and exercise N:
- outside the regions: the submission must equal the student edition everywhere except between
  the exercise markers. A change inside a function that holds regions costs those regions'
  exercises their marks; any other change (another function or file, a marker, the tests)
  costs every exercise its marks. The change is named in the failed rules.
- the checks: exercise N's tests run against the reference package with only exercise N's
  regions taken from the submission (make_exercise.generate, as for a known-wrong solution), so
  that a mistake in one exercise costs no marks in another. Submissions with the same code in
  exercise N's regions (comments and spacing aside: an untouched skeleton, a shared solution)
  share one run of its checks. The checks run in --jobs warm worker processes (runner.run_checks,
  in-process pytest; torch imported once per worker), and each finished check prints a progress
  line with the time to go.

Writes DIR/grades.json and DIR/grades.csv: one row per student and exercise with the score
(passed tests / tests of the exercise; 0 when flagged), and the failed rules (each failed test's
message, which names the rule it checks).
"""

from __future__ import annotations

import argparse
import ast
import csv
import difflib
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from minisgl.course.catalog import EXERCISES
from minisgl.course.make_exercise import PACKAGE, Wrong, generate, marked_files, regions, replace_regions
from minisgl.course.student_edition import write_student_edition

from minisgl.frontend.options import OneLineParser, count  # noqa: E402

PATCH_SUFFIXES = (".patch", ".diff")
MAX_PATCH_BYTES = 16 << 20  # a patch of the exercise regions is kilobytes
IGNORED_PARTS = {".git", "__pycache__", ".pytest_cache", "work", ".venv"}  # work/: make_exercise's copies
MAX_JOBS = 256  # worker processes
RULE_CHARS = 400  # a failure message is cut here in the report: it names its rule in its first sentence


@dataclass(frozen=True)
class Grade:
    student: str
    exercise: int
    score: float  # passed tests / tests of the exercise; 0 when flagged
    passed: int
    total: int
    flagged: bool  # code outside the exercise regions changed (no marks)
    failed_rules: list[str]


# --------------------------------------------------------------------------- what a tree holds

def written_regions(tree: Path) -> dict[int, dict[str, str]]:
    """exercise -> region name -> the code between its markers in tree/minisgl (dedented)."""
    found: dict[int, dict[str, str]] = {}
    for rel in marked_files(PACKAGE):
        lines = (tree / "minisgl" / rel).read_text().splitlines(keepends=True)
        for region in regions(lines):
            found.setdefault(region.number, {})[region.name] = textwrap.dedent(
                "".join(lines[region.first + 1:region.last]))
    return found


def put_regions(tree: Path, code: dict[int, dict[str, str]], dest: Path) -> Path:
    """A copy of tree (its git history left out) in dest, with `code` between the markers of its
    minisgl (the markers kept): e.g. the reference's regions put into the student edition."""
    shutil.copytree(tree, dest, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"))
    for rel in marked_files(dest / "minisgl"):
        path = dest / "minisgl" / rel
        source = path.read_text()
        for number, bodies in code.items():
            source, _ = replace_regions(source, number, Wrong(number, "", "", "", bodies), keep_markers=True)
        path.write_text(source)
    return dest


# Prose is not graded: a student's note in a README, or an exercise text they annotated, costs
# nothing. Every other file (code, tests, configuration) must stay as handed out.
PROSE_SUFFIXES = {".md", ".txt"}


def tree_files(tree: Path) -> set[str]:
    return {p.relative_to(tree).as_posix() for p in tree.rglob("*")
            if p.is_file() and not IGNORED_PARTS & set(p.relative_to(tree).parts)
            and p.suffix not in {".pyc", *PROSE_SUFFIXES}}


# --------------------------------------------------------------------------- edits outside the regions

def _outside(lines: list[str]) -> tuple[list[str], list[int]]:
    """The file with each region's body folded into one line naming the region, and for each of
    its lines the index of the line it came from."""
    out, origin, pos = [], [], 0
    for region in regions(lines):
        out += lines[pos:region.first + 1] + [f"<body of exercise {region.number}: {region.name}>\n"]
        origin += list(range(pos, region.first + 2))
        pos = region.last
    return out + lines[pos:], origin + list(range(pos, len(lines)))


def _exercises_of_function(source: str, line: int) -> set[int]:
    """The exercises with regions inside the innermost function around `line` (0-based), if any."""
    spans = [(node.lineno - 1, node.end_lineno - 1) for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = [span for span in spans if span[0] <= line <= span[1]]
    if not inside:
        return set()
    first, last = min(inside, key=lambda span: span[1] - span[0])
    return {r.number for r in regions(source.splitlines()) if first <= r.first and r.last <= last}


def edits_outside_regions(base: Path, tree: Path) -> dict[int, list[str]]:
    """exercise -> the edits outside the regions that cost it its marks (see the module's text)."""
    every = set(EXERCISES)
    flagged: dict[int, list[str]] = {}

    def flag(numbers: set[int], what: str) -> None:
        for number in sorted(numbers or every):
            flagged.setdefault(number, []).append(f"edited outside the exercise regions: {what}")

    base_files, tree_files_ = tree_files(base), tree_files(tree)
    for name in sorted(base_files - tree_files_):
        flag(every, f"{name} removed")
    for name in sorted(tree_files_ - base_files):
        if name.endswith(".py") or name.startswith(("minisgl/", "tests/")):
            flag(every, f"{name} added")
    for name in sorted(base_files & tree_files_):
        if (base / name).read_bytes() == (tree / name).read_bytes():
            continue
        try:
            before, after = (base / name).read_text(), (tree / name).read_text()
            base_regions = [(r.number, r.name) for r in regions(before.splitlines())]
            after_regions = [(r.number, r.name) for r in regions(after.splitlines())]
        except (UnicodeDecodeError, ValueError):
            flag(every, f"{name} changed (its exercise markers are broken)")
            continue
        if not base_regions:
            flag(every, f"{name} changed")
            continue
        if after_regions != base_regions:
            flag(every, f"{name}: exercise markers changed")
            continue
        outside_before, origin = _outside(before.splitlines(keepends=True))
        outside_after, _ = _outside(after.splitlines(keepends=True))
        matcher = difflib.SequenceMatcher(a=outside_before, b=outside_after, autojunk=False)
        for tag, i1, _, _, _ in matcher.get_opcodes():
            if tag != "equal":
                line = origin[min(i1, len(origin) - 1)]
                flag(_exercises_of_function(before, line), f"{name} line {line + 1} changed")
    return flagged


# --------------------------------------------------------------------------- grading

@dataclass(frozen=True)
class CheckResult:
    """Exercise N's tests on one version of its regions (shared by every submission with that code)."""
    passed: int
    total: int
    score: float  # passed / total; 0 when pytest could not run the tests (a collection error)
    failed_rules: list[str]


@dataclass(frozen=True)
class Submission:
    """What grading needs of one submission, read in the main process: its regions and its flags."""
    student: str
    code: dict[int, dict[str, str]]  # exercise -> region name -> the code between its markers
    flagged: dict[int, list[str]]  # exercise -> the edits outside the regions that cost it its marks
    not_gradable: str = ""  # why no exercise of it can be graded (e.g. a patch that does not apply)


def submission_tree(entry: Path, base: Path, scratch: Path) -> Path:
    """The work tree of a submission: the folder itself, or the student edition with the patch applied."""
    if entry.is_dir():
        return entry
    if not entry.is_file():  # a FIFO would block git apply forever, a device would feed it without end
        raise ValueError(f"{entry.name} is not a regular file")
    if entry.stat().st_size > MAX_PATCH_BYTES:
        raise ValueError(f"{entry.name} holds more than {MAX_PATCH_BYTES >> 20} MiB: not a patch of the exercises")
    tree = scratch / "tree"
    shutil.copytree(base, tree, ignore=shutil.ignore_patterns(".git"))
    done = subprocess.run(["git", "apply", "--whitespace=nowarn", str(entry.resolve())], cwd=tree,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"the patch does not apply to the student edition: {done.stderr.strip()}")
    return tree


def read_submission(entry: Path, base: Path) -> Submission:
    student = entry.name.removesuffix(entry.suffix) if entry.suffix in PATCH_SUFFIXES else entry.name
    with tempfile.TemporaryDirectory(prefix=f"minisgl-grade-{student}-") as tmp:
        try:
            tree = submission_tree(entry, base, Path(tmp))
            return Submission(student, written_regions(tree), edits_outside_regions(base, tree))
        except (ValueError, FileNotFoundError, SyntaxError) as exc:
            return Submission(student, {}, {}, f"not gradable: {exc}")


CheckKey = tuple[int, str]  # (exercise, fingerprint of its region code)


def fingerprint(number: int, bodies: dict[str, str]) -> CheckKey:
    """Which submissions can share one run of exercise `number`'s checks: the same code in its
    regions, comments, blank lines and spacing aside (each region's syntax tree). Empty skeletons
    and copies of one solution are then checked once."""
    parts = []
    for name in sorted(bodies):
        try:
            parts.append(ast.dump(ast.parse("def region():\n" + textwrap.indent(bodies[name] or "pass\n", "    "))))
        except SyntaxError:  # graded as written: the check reports the syntax error
            parts.append(bodies[name])
    return number, hashlib.sha256(repr((sorted(bodies), parts)).encode()).hexdigest()


def run_one_check(number: int, bodies: dict[str, str]) -> CheckResult:
    """Exercise `number`'s tests against the reference package with `bodies` between its markers.
    Runs in a grading worker (grade_class), one check after another in the same process."""
    from minisgl.course.runner import run_checks  # imports pytest and, through the tests, torch: only in the workers

    with tempfile.TemporaryDirectory(prefix=f"minisgl-grade-ex{number}-") as tmp:
        work = Path(tmp) / f"ex{number}"
        try:
            generate(number, work, force=True, wrong=Wrong(number, "submission", "the submission", "", bodies))
        except SyntaxError as exc:
            return CheckResult(0, 0, 0.0, [f"the code between the exercise {number} markers is not valid Python: "
                                           f"{exc}"])
        report = run_checks(work, number)
    passed = sum(o.outcome == "passed" for o in report.outcomes)
    total = max(len(report.outcomes), 1)
    failed = [f"{o.nodeid}: {o.message[:RULE_CHARS]}" for o in report.outcomes if o.outcome == "failed"]
    return CheckResult(passed, total, round(passed / total, 3) if report.exit_code in (0, 1) else 0.0, failed)


def _warm_worker() -> None:
    """Import pytest and torch once per worker, before its first check."""
    import runner  # noqa: F401
    import torch  # noqa: F401


CRASHED = ("the checks killed the grader's worker process (a test blocked in C code past the hang limit, "
           "or a crash): run make_exercise.py check on this submission to see it")


def run_checks_in_workers(checks: dict[CheckKey, dict[str, str]], jobs: int,
                          progress: Callable[[CheckKey, CheckResult], None]) -> dict[CheckKey, CheckResult]:
    """Every check, `jobs` at a time in warm worker processes (torch and pytest imported once per
    worker). A check that kills its worker (a test blocked in C code past the hang limit, a crash)
    breaks the pool: every unfinished check comes back broken. The pool hands out at most jobs + 1
    checks at a time, in order, so the culprit is among the first jobs + 1 broken ones: those run
    again each in a process of its own (only the culprit fails there), the rest in a fresh pool."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    # Workers are kept for every check (runner.run_checks puts the modules back after each one).
    # Not max_tasks_per_child: with it the pool stalled for good once both workers had reached
    # their limit (Python 3.11.7, 40 checks done, no worker left).
    results: dict[CheckKey, CheckResult] = {}
    pending = list(checks)
    while pending:
        broken = []
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_warm_worker) as pool:
            futures = {pool.submit(run_one_check, key[0], checks[key]): key for key in pending}
            for future in as_completed(futures):
                try:
                    results[futures[future]] = future.result()
                    progress(futures[future], results[futures[future]])
                except BrokenProcessPool:
                    broken.append(futures[future])
        broken.sort(key=pending.index)
        suspects, pending = broken[:jobs + 1], broken[jobs + 1:]
        for key in suspects:
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as alone:
                try:
                    results[key] = alone.submit(run_one_check, key[0], checks[key]).result()
                except BrokenProcessPool:
                    results[key] = CheckResult(0, 0, 0.0, [CRASHED])
            progress(key, results[key])
    return results


def grade_class(submissions: Path, out: Path, numbers: list[int], jobs: int) -> list[Grade]:
    entries = sorted(p for p in submissions.iterdir() if p.is_dir() or p.suffix in PATCH_SUFFIXES)
    if not entries:
        raise ValueError(f"no submission (a folder, or a {' or '.join(PATCH_SUFFIXES)} file) in {submissions}")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="minisgl-grade-base-") as tmp:
        base = write_student_edition(Path(tmp) / "student-edition")  # what every submission started from
        subs = [read_submission(entry, base) for entry in entries]
    checks: dict[CheckKey, dict[str, str]] = {}
    sharing: Counter[CheckKey] = Counter()  # check -> the submissions it grades
    for sub in subs:
        for number in numbers:
            if not sub.not_gradable and number not in sub.flagged:
                bodies = sub.code.get(number, {})
                key = fingerprint(number, bodies)
                checks.setdefault(key, bodies)
                sharing[key] += 1
    print(f"{len(subs)} submissions read in {time.monotonic() - start:.0f} s: {sharing.total()} exercises to grade, "
          f"{len(checks)} distinct checks to run (identical region code is checked once), {jobs} at a time",
          flush=True)

    checks_start, done = time.monotonic(), 0

    def progress(key: CheckKey, result: CheckResult) -> None:
        nonlocal done
        done += 1
        elapsed = time.monotonic() - checks_start
        print(f"[{done}/{len(checks)}] exercise {key[0]} ({sharing[key]} submission{'s' * (sharing[key] > 1)}): "
              f"{result.passed}/{result.total} passed; {elapsed:.0f} s, about "
              f"{elapsed / done * (len(checks) - done):.0f} s to go", flush=True)

    results = run_checks_in_workers(checks, jobs, progress)
    grades = []
    for sub in subs:
        for number in numbers:
            if sub.not_gradable:
                grades.append(Grade(sub.student, number, 0.0, 0, len(EXERCISES[number].tests), True,
                                    [sub.not_gradable]))
            elif number in sub.flagged:
                grades.append(Grade(sub.student, number, 0.0, 0, 0, True, sub.flagged[number]))
            else:
                r = results[fingerprint(number, sub.code.get(number, {}))]
                grades.append(Grade(sub.student, number, r.score, r.passed, r.total, False, r.failed_rules))
    write_report(grades, out)
    return grades


def write_report(grades: list[Grade], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "grades.json").write_text(json.dumps([asdict(g) for g in grades], indent=1, ensure_ascii=False) + "\n")
    with open(out / "grades.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "exercise", "score", "passed", "total", "flagged", "failed_rules"])
        for g in grades:
            writer.writerow([g.student, g.exercise, g.score, g.passed, g.total, g.flagged, " | ".join(g.failed_rules)])


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("submissions", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=count(MAX_JOBS), default=os.cpu_count() or 2,
                    help="checks run at once, one worker process each (default: one per core)")
    ap.add_argument("--exercises", type=int, nargs="+", default=sorted(EXERCISES), choices=sorted(EXERCISES))
    args = ap.parse_args(argv)
    if not args.submissions.is_dir():
        ap.error(f"{args.submissions} is not a folder of submissions")
    start = time.monotonic()
    try:
        grades = grade_class(args.submissions, args.out, args.exercises, args.jobs)
    except ValueError as exc:
        ap.error(str(exc))
    students = len({g.student for g in grades})
    print(f"graded {students} submissions x {len(args.exercises)} exercises in {time.monotonic() - start:.0f} s: "
          f"{args.out / 'grades.json'}, {args.out / 'grades.csv'}")
    for g in grades:
        print(f"{g.student:24} exercise {g.exercise}  score {g.score:.2f}{'  FLAGGED' if g.flagged else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
