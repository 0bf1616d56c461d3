"""Grade a class: every exercise of every submission, into a grade sheet.

    python -m minisgl course grade SUBMISSIONS --out DIR [--jobs 2] [--exercises 1 2] [--check-limit 180]
                                   [--memory-limit 8]

Each entry of SUBMISSIONS is one student, named by the entry: a work tree (a folder of the
student edition, edited), a zip of one (`NAME.zip`) or a patch against it (`NAME.patch` or
`NAME.diff`, from `git diff` in the student's tree, in any encoding PowerShell or Git writes). Entries may be malformed (a
symlink, a FIFO, a patch that does not apply): each is one "not gradable" row. Hidden entries
and the folders of tools and OSes (`work`, `build`, `venv`, `__MACOSX`, ...) are skipped, the
folders among them named on the console. SUBMISSIONS may be anywhere, this checkout included.
Every exercise is graded unless --exercises names some (the run's first line says which).

How a submission is read (submission.py): normalized (line ends, BOMs, OS litter), its code
between the markers taken per exercise; an edit inside a function that holds exercise N's
region costs exercise N; any other edit is reported and costs nothing.

How an exercise is checked (judge.py): in a fresh process, in a throw-away copy of the student
edition with the submission's code between that exercise's markers and the reference code
between the others, with a limit in time per check (a hang is reported as one) and in memory per
process of a check (--memory-limit). The verdict is the judge's, not the child's: a forged
report, a crash, a hang or a check over the memory limit earns nothing. Submissions with the
same code in an exercise's regions (comments and spacing aside) share one check. A check may
not write outside its copy nor read the teacher's checkout or other submissions (Landlock, on
Linux; the run's first lines say whether this machine has it); without that wall, a write into
the teacher's checkout is seen by a listing before and after each check and costs the check its
marks (status escaped); nothing a check starts outlives it.

Writes, only when every check has run:
- DIR/grades.csv: one row per student, a column per exercise (1 when every check passes, the
  checker's half of the guide's rubric; 0 otherwise), the total, the status (`graded`: every
  exercise ran and passed or failed its tests; `not gradable`; else each exercise that did not,
  e.g. `ex2: hang; ex3: memory limit`), why (the whole rule behind that status) and notes (edits
  reported);
- DIR/grade-details.csv: one row per student, exercise and test (or edit that costs a mark), with
  the rule it breaks in the test's own words;
- DIR/grades.json: both, for scripts.
An interrupted run (Ctrl-C, SIGTERM) records nothing, cleans up (a second Ctrl-C is ignored
meanwhile) and exits 130. A run killed outright leaves its scratch folder behind; the next run
removes it.
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from minisgl.course import ROOT
from minisgl.course.catalog import EXERCISES
from minisgl.course.judge import Judge
from minisgl.course.judge_process import kill_run_processes
from minisgl.course.judge_verdict import CheckVerdict
from minisgl.course.markers import marked_files, written_regions
from minisgl.course.region_policy import first_few
from minisgl.course.student_edition import write_student_edition
from minisgl.course.submission import NotGradable, Submission, is_submission, read_tree, student_name, tree_from_entry
from minisgl.frontend.options import OneLineParser, count

MAX_JOBS = 64  # checks at once, one process each
MEMORY_LIMIT_GIB = 8  # a reference check peaks at 0.4-0.7 GiB; torch adds about 17 MiB a thread (TEACHER.md)
RUN_PREFIX = "minisgl-grade-run-"  # this run's scratch folder in the system's temporary folder
INTERRUPTED = 130


# --------------------------------------------------------------------------- checks shared

CheckKey = tuple[int, str]  # (exercise, fingerprint of its region code)


def fingerprint(number: int, bodies: dict[str, str]) -> CheckKey:
    """Which submissions can share one check of exercise `number`: the same code in its regions,
    comments, blank lines and spacing aside (each region's syntax tree)."""
    parts = []
    for name in sorted(bodies):
        try:
            parts.append(ast.dump(ast.parse("def region():\n" + textwrap.indent(bodies[name] or "pass\n", "    "))))
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # too deep for ast.dump too: the text
            parts.append(bodies[name])
    return number, hashlib.sha256(repr((sorted(bodies), parts)).encode()).hexdigest()


# --------------------------------------------------------------------------- the run's scratch

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_runs(temp: Path) -> list[Path]:
    """Scratch folders of grading runs whose grader is gone (killed outright): their processes
    killed, the folders removed. Returns the folders removed."""
    removed = []
    for folder in temp.glob(f"{RUN_PREFIX}*"):
        try:
            owner = int((folder / "owner.pid").read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None and _alive(owner):
            continue
        if owner is None and time.time() - folder.stat().st_mtime < 60:
            continue  # a run that is writing its owner file right now
        kill_run_processes(f"{folder.name}:", folder)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def new_run_folder() -> Path:
    temp = Path(tempfile.gettempdir())
    remove_stale_runs(temp)
    folder = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=temp))
    (folder / "owner.pid").write_text(str(os.getpid()))
    return folder


# --------------------------------------------------------------------------- submissions

def skipped_folders(submissions: Path) -> list[str]:
    """The folders of SUBMISSIONS that are not read as submissions (hidden, or named like a tool's
    or an OS's folder): said on the console, so that no student's folder is passed over unseen."""
    return sorted(p.name for p in submissions.iterdir() if p.is_dir() and not is_submission(p))


def read_class(submissions: Path, edition: Path, scratch: Path) -> list[Submission]:
    """One Submission per student name, malformed ones included (not gradable)."""
    entries = sorted(p for p in submissions.iterdir() if is_submission(p))
    if not entries:
        raise ValueError(f"no submission (a folder, a .zip, or a .patch or .diff file) in {submissions}")
    by_name: dict[str, list[Path]] = {}
    for entry in entries:
        by_name.setdefault(student_name(entry), []).append(entry)
    marked = {f"minisgl/{rel.as_posix()}": numbers for rel, numbers in marked_files(edition / "minisgl").items()}
    subs = []
    for i, (student, named) in enumerate(sorted(by_name.items())):
        sub = Submission(student, [e.name for e in named])
        subs.append(sub)
        if len(named) > 1:
            sub.not_gradable = f"more than one submission named {student}: {', '.join(sub.entries)}"
            continue
        work = scratch / f"submission-{i}"
        work.mkdir()
        try:
            tree, skipped = tree_from_entry(named[0], edition, work)
            read_tree(sub, edition, tree, marked, skipped)
            if skipped:
                sub.notes.append(f"ignored (not regular files): {', '.join(skipped[:3])}")
        except NotGradable as exc:
            sub.not_gradable = str(exc)
        except (OSError, UnicodeError) as exc:
            sub.not_gradable = f"cannot be read ({type(exc).__name__})"
        except (RecursionError, MemoryError):  # Python's own parser gives up: no check could read it either
            sub.not_gradable = "its code nests too deeply for Python's parser"
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return subs


# --------------------------------------------------------------------------- the sheet

@dataclass(frozen=True)
class ExerciseGrade:
    exercise: int
    mark: float  # 1.0: every check passed and no edit around the region
    status: str  # passed, failed, hang, crash, memory limit, interrupted, forged, refused, escaped, edited,
    #              not gradable
    rules: tuple[str, ...]  # why not 1.0, one short line each
    tests: tuple[tuple[str, bool, str], ...] = ()  # (test, passed, rule)


@dataclass(frozen=True)
class StudentGrade:
    student: str
    exercises: tuple[ExerciseGrade, ...]
    notes: tuple[str, ...]

    @property
    def total(self) -> float:
        return sum(e.mark for e in self.exercises)

    @property
    def status(self) -> str:
        """In a word or two, for grades.csv: 'graded' (every exercise ran and passed or failed its
        tests), 'not gradable', or each exercise that did not: 'ex2: hang; ex3: memory limit'."""
        if self.exercises and self.exercises[0].status == "not gradable":  # then every exercise is
            return "not gradable"
        return "; ".join(f"ex{e.exercise}: {e.status}" for e in self._not_graded()) or "graded"

    @property
    def why(self) -> str:
        """The whole first rule behind the status, per exercise: 'ex2: hang: the checks ran past the
        limit of 180 s | ex3: memory limit: used more than 8 GiB' (the rest is in grade-details.csv)."""
        if self.exercises and self.exercises[0].status == "not gradable":
            return self.exercises[0].rules[0]
        return " | ".join(f"ex{e.exercise}: {e.rules[0] if e.rules else e.status}" for e in self._not_graded())

    def _not_graded(self) -> list[ExerciseGrade]:
        return [e for e in self.exercises if e.status not in ("passed", "failed")]


def grade_of(sub: Submission, number: int, verdict: CheckVerdict | None) -> ExerciseGrade:
    if sub.not_gradable:
        return ExerciseGrade(number, 0.0, "not gradable", (sub.not_gradable,))
    if number in sub.costs:
        return ExerciseGrade(number, 0.0, "edited", tuple(f"edited outside the markers: {c}" for c in sub.costs[number]))
    assert verdict is not None
    tests = tuple((t.test, t.passed, t.rule) for t in verdict.tests)
    rules = tuple(dict.fromkeys([verdict.summary] if verdict.summary else [t.rule for t in verdict.tests if t.rule]))
    return ExerciseGrade(number, verdict.mark, verdict.status, rules, tests)


def _cell(text: str) -> str:
    """A spreadsheet cell that is never a formula (a student's name may start with =)."""
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


def write_sheet(grades: list[StudentGrade], numbers: list[int], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    header = ["student", *(f"ex{n}" for n in numbers), "total", "of", "status", "why", "notes"]
    rows = [[_cell(g.student), *(f"{e.mark:g}" for e in g.exercises), f"{g.total:g}", str(len(numbers)),
             g.status, _cell(g.why), _cell(first_few(g.notes, " | "))] for g in grades]
    files["grades.csv"] = [header, *rows]
    detail = [["student", "exercise", "mark", "status", "test", "passed", "rule"]]
    for g in grades:
        for e in g.exercises:
            if e.tests:
                detail += [[_cell(g.student), str(e.exercise), f"{e.mark:g}", e.status, t, str(ok), _cell(rule)]
                           for t, ok, rule in e.tests]
            else:
                detail += [[_cell(g.student), str(e.exercise), f"{e.mark:g}", e.status, "", "False", _cell(rule)]
                           for rule in e.rules]
    files["grade-details.csv"] = detail
    for name, table in files.items():
        tmp = out / f".{name}.tmp"
        # A name that is not UTF-8 (a file from an old system, read back with surrogates) is written
        # escaped, not left to stop the run after every check.
        with open(tmp, "w", newline="", encoding="utf-8", errors="backslashreplace") as f:
            csv.writer(f).writerows(table)
        os.replace(tmp, out / name)
    tmp = out / ".grades.json.tmp"
    tmp.write_text(json.dumps([dict(asdict(g), total=g.total, status=g.status, why=g.why) for g in grades], indent=1,
                              ensure_ascii=False) + "\n", encoding="utf-8", errors="backslashreplace")
    os.replace(tmp, out / "grades.json")


# --------------------------------------------------------------------------- the class

def grade_class(submissions: Path, out: Path, numbers: list[int], jobs: int, limit_s: float,
                scratch: Path, confine: bool = True, memory_gib: float = MEMORY_LIMIT_GIB) -> list[StudentGrade]:
    start = time.monotonic()
    print(exercises_line(numbers), flush=True)
    skipped = skipped_folders(submissions)
    if skipped:
        print(f"skipped (not read as submissions: hidden, or a tool's or an OS's folder): {', '.join(skipped)}",
              flush=True)
    edition = write_student_edition(scratch / "edition", exclude=(submissions, out))
    subs = read_class(submissions, edition, scratch)
    stubs = written_regions(edition)
    for sub in subs:  # work on an exercise this run does not grade (the wrong one done, say) is named
        written = [n for n in sorted(sub.code) if n not in numbers and fingerprint(n, sub.code[n]) !=
                   fingerprint(n, stubs.get(n, {}))]
        if written:
            sub.notes.append(f"exercise{'s' * (len(written) > 1)} {', '.join(map(str, written))} written but not "
                             f"graded in this run (--exercises)")
    reference = written_regions(ROOT)
    judge = Judge(edition, scratch, reference, limit_s, scratch.name, guard=ROOT, guard_skip=[submissions, out],
                  confine=confine, memory_gib=memory_gib)
    checks: dict[CheckKey, dict[str, str]] = {}
    sharing: Counter[CheckKey] = Counter()
    for sub in subs:
        for number in numbers:
            if not sub.not_gradable and number not in sub.costs:
                key = fingerprint(number, sub.code.get(number, {}))
                checks.setdefault(key, sub.code.get(number, {}))
                sharing[key] += 1
    print(f"{len(subs)} submissions read in {time.monotonic() - start:.0f} s: {sharing.total()} exercises to grade, "
          f"{len(checks)} distinct checks (identical region code is checked once), {jobs} at a time, "
          f"{limit_s:g} s and {f'{memory_gib:g} GiB' if memory_gib else 'any memory'} at most each", flush=True)
    print("checking the reference solutions first (one check per exercise, 10-20 s of CPU each)…", flush=True)
    verdicts: dict[CheckKey, CheckVerdict] = {}
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for future in as_completed([pool.submit(judge.learn_expected, n) for n in numbers]):
            future.result()  # the reference must pass here, or no mark would be right
        print(confinement_line(judge.starter.confinement if confine else {}), flush=True)
        begun, done = time.monotonic(), 0
        futures = {pool.submit(judge.check, key[0], bodies): key for key, bodies in checks.items()}
        for future in as_completed(futures):
            key = futures[future]
            verdicts[key] = verdict = future.result()
            done += 1
            elapsed = time.monotonic() - begun
            print(f"[{done}/{len(checks)}] exercise {key[0]} ({sharing[key]} submission{'s' * (sharing[key] > 1)}): "
                  f"{verdict.status}, {sum(t.passed for t in verdict.tests)}/{len(verdict.tests)} tests; {elapsed:.0f} s, "
                  f"about {elapsed / done * (len(checks) - done):.0f} s to go", flush=True)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        judge.close()  # every check still running ends, no new one starts, and none is left in the scratch folder
    pool.shutdown()
    grades = []
    for sub in subs:
        exercises = tuple(grade_of(sub, n, verdicts.get(fingerprint(n, sub.code.get(n, {})))) for n in numbers)
        grades.append(StudentGrade(sub.student, exercises, tuple(sub.notes)))
    write_sheet(grades, numbers, out)
    return grades


def exercises_line(numbers: list[int]) -> str:
    """Which exercises this run grades, and how to choose them, for the console's first line."""
    every = numbers == sorted(EXERCISES)
    return (f"grading exercises {', '.join(map(str, numbers))}"
            + (" (the default: every exercise; to grade only those the class was given, name them: "
               "--exercises 1 2 3 ...)" if every else " (as --exercises asks)"))


def confinement_line(word: dict | None) -> str:
    """What the OS does to keep a check in its copy, for the teacher's console."""
    abi = (word or {}).get("landlock", 0)
    walls = (f"reads and writes confined to their copies and the interpreter's and system's folders by Landlock "
             f"(ABI {abi}{', no TCP' if abi >= 4 else ''}"
             f"{', no signal outside' if abi >= 6 else ''})" if abi else
             "not confined by the OS (no Landlock here): a write outside a copy is only detected")
    reaper = "; what a check leaves running is re-parented and killed" if (word or {}).get("subreaper") else ""
    return f"checks run in their own copies, {walls}{reaper}; the teacher's checkout is listed around each check"


def gibibytes(text: str) -> float:
    """--memory-limit's value: GiB, 0 (no limit) or at least 1 (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value == 0 or 1 <= value <= 4096):
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 (no limit) or a number of GiB from 1 to 4096")
    return value


STOP_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]


def _interrupt(signum, frame):
    for s in STOP_SIGNALS:  # a second Ctrl-C cannot cut the clean-up short (checks left running)
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("submissions", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=count(MAX_JOBS), default=min(os.cpu_count() or 2, MAX_JOBS),
                    help="checks run at once, one process each (default: one per core)")
    ap.add_argument("--exercises", type=int, nargs="+", default=sorted(EXERCISES), choices=sorted(EXERCISES))
    ap.add_argument("--check-limit", type=count(3600), default=180, metavar="SECONDS",
                    help="a check that runs longer is a hang (default 180)")
    ap.add_argument("--memory-limit", type=gibibytes, default=MEMORY_LIMIT_GIB, metavar="GIB",
                    help=f"the memory each process of a check may take, in GiB: a check that needs more earns nothing "
                         f"(default {MEMORY_LIMIT_GIB}; 0: no limit; Linux enforces it, macOS may not)")
    ap.add_argument("--unconfined", action="store_true",
                    help="no Landlock wall around the checks (only if the reference fails behind it, e.g. a GPU "
                         "driver that writes elsewhere): writes into this checkout are then only detected")
    args = ap.parse_args(argv)
    if not args.submissions.is_dir():
        ap.error(f"{args.submissions} is not a folder of submissions")
    for signum in STOP_SIGNALS:
        signal.signal(signum, _interrupt)
    start = time.monotonic()
    scratch = new_run_folder()
    try:
        grades = grade_class(args.submissions.resolve(), args.out.resolve(), sorted(set(args.exercises)), args.jobs,
                             args.check_limit, scratch, confine=not args.unconfined, memory_gib=args.memory_limit)
    except ValueError as exc:
        ap.error(str(exc))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no marks were recorded", file=sys.stderr)
        return INTERRUPTED
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"graded {len(grades)} students x {len(args.exercises)} exercises in {time.monotonic() - start:.0f} s: "
          f"{args.out / 'grades.csv'} (per test: {args.out / 'grade-details.csv'})")
    for g in grades:
        marks = " ".join(f"{e.mark:g}" for e in g.exercises)
        said = f"not gradable: {g.why}" if g.status == "not gradable" else g.why  # why names each exercise
        print(f"{g.student:24} {marks}  total {g.total:g}" + (f"  ({said})" if said else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
