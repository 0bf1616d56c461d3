"""A class graded end to end, hostile work included: every mark right, nothing written outside the
checks' copies, no teacher's text in any message, a hang reported as one, a malformed entry one row.

Exercises 2 and 3 only (a check is a fresh process: seconds each). The class:
- reference (folder), crlf (the reference with Windows line ends, a .DS_Store, Thumbs.db and
  __pycache__), powershell.patch (UTF-16 with a BOM and CRLF), added-import (an `import copy` at the top of
  batch.py and a scratch script): full marks;
- known-wrong: exercise 3 a known-wrong solution, exercise 2 the reference: 1 and 0;
- forger (patches pytest's report through sys.modules), contaminator (writes into the teacher's
  checkout and the grading output), reader (puts TEACHER.md into its failure message), forker, and
  the attacks of issue 36's trial: gc-escaper (reaches gc and Path through a module of the package,
  `from . import config`, to find the builtins and write into the teacher's checkout), torch-writer
  (torch.save and torch.os.system), torch-leaker (torch.from_file of TEACHER.md into its message),
  report-patcher (pytest's reports through torch.sys), exit0 (torch.os._exit(0) before the report),
  monkeypatcher (torch.equal and a class of the package patched): 0 on exercise 3, 1 on exercise 2;
- spinner: `while True: pass` in exercise 2's publish, which runs on the engine stream's worker
  thread: a hang on exercise 2, 1 on exercise 3;
- the forms the teacher trial's checker passed and its grader refused (computed-getattr, type-call,
  make-dataclass, numpy): 0 on exercise 3, 1 on exercise 2; the student's checker
  (`course exercise 3`, run in the submission) refuses each of them, and the forger, with the line
  the grader records; written-getattr (`getattr(self, "reqs")`, allowed by both): full marks;
- hog: 5 GiB in exercise 3's snapshot, past the teacher's memory limit (--memory-limit 4, a
  process): status memory limit on exercise 3, 1 on exercise 2; interrupter: `raise
  KeyboardInterrupt` there: status interrupted (not "forged"), 1 on exercise 2;
- a folder named `venv`: skipped, and named on the console;
- twice (a folder and a patch of one name), a FIFO, a symlink loop, a broken patch: one
  "not gradable" row each.
"""

from __future__ import annotations

import codecs
import csv
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from minisgl.course import ROOT, grade, judge
from minisgl.course import student_edition as edition
from minisgl.course.catalog import EXERCISES
from minisgl.course.judge_copy import put_regions
from minisgl.course.make_exercise import WRONG

pytestmark = pytest.mark.full
GRADED = ["2", "3"]
LIMIT_S = 120
REFERENCE = grade.written_regions(ROOT)
ESCAPED = ROOT / "ESCAPED_BY_A_SUBMISSION.txt"
TEACHER = ROOT / "lessons" / "TEACHER.md"
SNAPSHOT = REFERENCE[3]["snapshot"]
HOSTILE_EX3 = {
    "forger": """
import sys
reports = sys.modules["_pytest.reports"]
real = reports.TestReport.__init__
def forged(self, *args, **kwargs):
    real(self, *args, **kwargs)
    self.outcome, self.longrepr = "passed", None
reports.TestReport.__init__ = forged
return self
""",
    "contaminator": f"""
open({str(ESCAPED)!r}, "w").write("x")
open("../../../../grades.csv", "w").write("x")
""" + SNAPSHOT,
    "reader": f"""
raise AssertionError(open({str(ROOT / "lessons" / "TEACHER.md")!r}).read())
""",
    "forker": """
import os
if os.fork() == 0:
    os.setsid()
    while True:
        pass
""" + SNAPSHOT,
    "gc-escaper": f"""
from . import config as cfg
cfg.Path({str(ESCAPED)!r}).touch()
found = [o for o in cfg.gc.get_objects() if isinstance(o, dict) and "open" in o and "len" in o]
found[0]["open"]({str(ESCAPED)!r}, "w").write("x")
""" + SNAPSHOT,
    "torch-writer": f"""
import torch
torch.save([1], {str(ESCAPED)!r})
torch.os.system("touch " + {str(ESCAPED)!r})
""" + SNAPSHOT,
    "torch-leaker": f"""
import torch
t = torch.from_file({str(TEACHER)!r}, size=400, dtype=torch.uint8)
assert False, "LEAK:" + bytes(t.tolist()).decode("utf-8", "replace")
""",
    "report-patcher": """
import torch
r = torch.sys.modules.get("_pytest.reports")
if r is not None:
    r.BaseReport.passed = property(lambda s: True)
    r.BaseReport.failed = property(lambda s: False)
return self
""",
    "exit0": """
import torch
torch.os._exit(0)
""",
    "monkeypatcher": """
import torch
torch.equal = lambda *a: True
t = BatchView
t.snapshot = lambda self: self
return self
""",
}
TRIAL_EX3 = {  # the teacher trial's checker passed these, its grader refused them
    "computed-getattr": "name = 're' + 'qs'\nreqs = getattr(self, name)\n" + SNAPSHOT,
    "type-call": "view = type(self)\n" + SNAPSHOT,
    "make-dataclass": "from dataclasses import make_dataclass\n" + SNAPSHOT,
    "numpy": "import numpy\n" + SNAPSHOT,
}
CHECKED_AT_HOME = [*TRIAL_EX3, "forger"]  # the student's checker runs in these too
MEMORY_GIB = 4  # the teacher's --memory-limit
WRITTEN_GETATTR = "reqs = getattr(self, 'reqs')\n" + SNAPSHOT  # a form a student may well write: allowed
OTHER_EX3 = {  # run, and stopped by the judge
    "hog": f"import torch\nhog = torch.ones({MEMORY_GIB + 1} << 30, dtype=torch.uint8)\n" + SNAPSHOT,
    "interrupter": "raise KeyboardInterrupt\n",
}


def with_regions(base: Path, dest: Path, code: dict[int, dict[str, str]]) -> Path:
    return put_regions(base, code, dest)


def as_patch(base: Path, tree: Path) -> str:
    shutil.copytree(base / ".git", tree / ".git")
    return subprocess.run(["git", "diff"], cwd=tree, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    base = edition.write_student_edition(root / "edition")
    subs = ROOT / f"class-submissions-{os.getpid()}"  # inside the teacher's checkout, not ignored by git
    shutil.rmtree(subs, ignore_errors=True)
    subs.mkdir(parents=True)
    out = root / "out"
    try:
        with_regions(base, subs / "reference", REFERENCE)
        crlf = with_regions(base, subs / "crlf", REFERENCE)
        for path in crlf.rglob("*.py"):
            path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
        (crlf / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
        (crlf / "minisgl" / "Thumbs.db").write_bytes(b"\xd0\xcf")
        (crlf / "minisgl" / "__pycache__").mkdir(exist_ok=True)
        (crlf / "minisgl" / "__pycache__" / "batch.cpython-311.pyc").write_bytes(b"\0" * 16)
        diff = as_patch(base, with_regions(base, root / "ps", REFERENCE))
        (subs / "powershell.patch").write_bytes(codecs.BOM_UTF16_LE + diff.replace("\n", "\r\n").encode("utf-16-le"))
        added = with_regions(base, subs / "added-import", REFERENCE)
        (added / "minisgl" / "batch.py").write_text("import copy\n" + (added / "minisgl" / "batch.py").read_text())
        (added / "scratch.py").write_text("print('trying')\n")
        wrong3 = next(w for w in WRONG if w.exercise == 3)
        with_regions(base, subs / "known-wrong", {**REFERENCE, 3: wrong3.regions})
        for name, code in {**HOSTILE_EX3, **TRIAL_EX3, **OTHER_EX3, "written-getattr": WRITTEN_GETATTR}.items():
            with_regions(base, subs / name, {**REFERENCE, 3: {"snapshot": textwrap.dedent(code)}})
        at_home = checker_lines(subs, CHECKED_AT_HOME)
        with_regions(base, subs / "venv", REFERENCE)
        with_regions(base, subs / "spinner", {**REFERENCE, 2: {**REFERENCE[2], "publish": "while True:\n    pass\n"}})
        with_regions(base, subs / "twice", REFERENCE)
        (subs / "twice.patch").write_text(diff)
        os.mkfifo(subs / "fifo.patch")
        (subs / "loop.patch").symlink_to(subs / "loop.patch")
        (subs / "broken.patch").write_text(diff.replace("@@", "@@ garbage", 1)[: len(diff) // 2])
        teacher_files = snapshot(ROOT)
        home_before = snapshot(Path.home(), depth=1)
        started = time.monotonic()
        temp = root / "tmp"  # this grader's scratch, apart from any other grading run on the machine
        temp.mkdir()
        done = subprocess.run([sys.executable, "-m", "minisgl", "course", "grade", str(subs), "--out", str(out),
                               "--exercises", *GRADED, "--jobs", "2", "--check-limit", str(LIMIT_S),
                               "--memory-limit", str(MEMORY_GIB)],
                              capture_output=True, text=True, timeout=1800, env=dict(os.environ, TMPDIR=str(temp)))
        wall = time.monotonic() - started
        changed_in_checkout = sorted(set(snapshot(ROOT).items()) - set(teacher_files.items()))
        changed_in_home = sorted(set(snapshot(Path.home(), depth=1)) - set(home_before))
    finally:
        shutil.rmtree(subs, ignore_errors=True)
    return Graded(done, out, wall, changed_in_checkout, changed_in_home, temp, at_home)


class Graded(NamedTuple):
    done: subprocess.CompletedProcess  # the grader's run
    out: Path
    wall: float
    changed_in_checkout: list
    changed_in_home: list
    temp: Path  # the grader's temporary folder
    at_home: dict[str, tuple[int, str]]  # student -> what `course exercise 3` in their tree said: exit code, line


def checker_lines(subs: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """Run the student's checker of exercise 3 in each of these submissions, side by side: its exit
    code and the line it printed for exercise 3."""
    runs = {name: subprocess.Popen([sys.executable, "-m", "minisgl", "course", "exercise", "3"], cwd=subs / name,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names}
    said = {}
    for name, run in runs.items():
        out, _ = run.communicate(timeout=600)
        said[name] = (run.returncode, next((line for line in out.splitlines() if line.startswith("exercise 3: ")), ""))
    return said


def snapshot(folder: Path, depth: int = 64) -> dict[str, int]:
    """path -> mtime of every file under folder (the venv and caches aside)."""
    found = {}
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if len(rel.parts) > depth or {".venv", ".git", "__pycache__", ".pytest_cache", "work"} & set(rel.parts):
            continue
        try:
            found[rel.as_posix()] = path.lstat().st_mtime_ns
        except OSError:
            continue
    return found


def sheet(out: Path) -> dict[str, dict[str, str]]:
    with open(out / "grades.csv", newline="") as f:
        return {row["student"]: row for row in csv.DictReader(f)}


def test_every_mark_of_the_class_is_right(graded):
    done, out, wall = graded.done, graded.out, graded.wall
    print(f"graded the class in {wall:.0f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sheet(out)
    marks = {name: (row["ex2"], row["ex3"]) for name, row in rows.items()}
    assert marks == {
        "reference": ("1", "1"), "crlf": ("1", "1"), "powershell": ("1", "1"), "added-import": ("1", "1"),
        "known-wrong": ("1", "0"), **{name: ("1", "0") for name in {**HOSTILE_EX3, **TRIAL_EX3, **OTHER_EX3}},
        "written-getattr": ("1", "1"), "spinner": ("0", "1"),
        "twice": ("0", "0"), "fifo": ("0", "0"), "loop": ("0", "0"), "broken": ("0", "0"),
    }, marks
    assert rows["added-import"]["notes"] and "batch.py" in rows["added-import"]["notes"]
    ungraded = ", ".join(str(n) for n in sorted(EXERCISES) if str(n) not in GRADED)
    assert f"exercises {ungraded} written but not graded in this run" in rows["reference"]["notes"], rows["reference"]
    assert all(rows[n]["total"] == str(sum(map(int, marks[n]))) for n in rows)
    details = list(csv.DictReader(open(out / "grade-details.csv", newline="")))
    spin = [d for d in details if d["student"] == "spinner" and d["exercise"] == "2"]
    assert spin and all(d["status"] == "hang" for d in spin)
    for name in ("twice", "fifo", "loop", "broken"):
        assert {d["status"] for d in details if d["student"] == name} == {"not gradable"}, name
    for name in {**HOSTILE_EX3, **TRIAL_EX3}:  # stopped before they ran, with the rule they broke
        rows = [d for d in details if d["student"] == name and d["exercise"] == "3"]
        assert rows and {d["status"] for d in rows} == {"refused"} and all("a region may" in d["rule"] for d in rows)
    for name, status in (("hog", "memory limit"), ("interrupter", "interrupted")):
        assert {d["status"] for d in details if d["student"] == name and d["exercise"] == "3"} == {status}, name
    said = {name: (row["status"], row["why"]) for name, row in sheet(out).items()}
    assert said["reference"] == ("graded", "") and said["known-wrong"] == ("graded", ""), said
    assert said["spinner"] == ("ex2: hang", f"ex2: hang: the checks ran past the limit of {LIMIT_S} s"), said
    assert said["hog"] == ("ex3: memory limit", f"ex3: memory limit: used more than {MEMORY_GIB} GiB"), said
    assert said["interrupter"] == ("ex3: interrupted", "ex3: the check was interrupted (KeyboardInterrupt raised by "
                                                       "the submission)"), said
    assert said["numpy"] == ("ex3: refused", "ex3: not run: a region may not import `numpy` (only bisect, "
                             "collections, copy, functools, heapq, itertools, math, time and torch, replace "
                             "from dataclasses, and the package's own classes and functions)"), said
    assert said["loop"][0] == "not gradable" and "loop.patch" in said["loop"][1], said


def test_the_students_checker_refuses_what_the_grader_refused_with_its_line(graded):
    """The teacher trial's checker passed code its grader refused: now `course exercise 3`, run in
    the submission, refuses it first, with the line the grader recorded, and exits 1."""
    details = list(csv.DictReader(open(graded.out / "grade-details.csv", newline="")))
    for name in CHECKED_AT_HOME:
        recorded = {d["rule"] for d in details if d["student"] == name and d["exercise"] == "3"}
        assert len(recorded) == 1 and graded.at_home[name] == (1, f"exercise 3: {recorded.pop()}"), name


def test_the_console_says_what_it_grades_and_skips(graded):
    said = graded.done.stdout.splitlines()
    assert said[0] == "grading exercises 2, 3 (as --exercises asks)", said[:3]
    assert any(line.startswith("skipped") and line.endswith(": venv") for line in said[:3]), said[:3]
    assert any(line.startswith("checking the reference solutions first") for line in said), said[:8]


def test_nothing_was_written_outside_the_copies_and_no_teacher_text_reached_a_message(graded):
    done, out = graded.done, graded.out
    assert not ESCAPED.exists() and graded.changed_in_checkout == [] and graded.changed_in_home == []
    assert sorted(p.name for p in out.iterdir()) == ["grade-details.csv", "grades.csv", "grades.json"]
    guide = TEACHER.read_text()
    lines = {line.strip() for line in guide.splitlines() if len(line.strip()) > 40}
    messages = (out / "grades.csv").read_text() + (out / "grade-details.csv").read_text()
    assert not [line for line in lines if line in messages] and guide[:200].strip() not in messages
    assert "LEAK" not in messages and "LEAK" not in done.stdout + done.stderr
    for code in REFERENCE.values():
        for body in code.values():
            assert not [line for line in body.splitlines() if len(line.strip()) > 30 and line.strip() in messages]


def test_no_process_of_the_class_outlived_its_check(graded):
    temp = graded.temp
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _grading_process(p, f"{temp}/")]
    assert alive == [] and list(temp.iterdir()) == []  # and its scratch is gone


def _grading_process(proc: Path, folder: str) -> bool:
    """A process of a grading run: working in its scratch (a check or what it forked)."""
    try:
        return os.readlink(proc / "cwd").startswith(folder)
    except OSError:
        return False


def test_a_report_forged_past_the_region_check_is_caught_by_the_judge(tmp_path):
    """With the region check off, the hostile code runs: the forger rewrites pytest's reports, and
    the judge's canary (a test that must fail) comes back passed: no marks. The escapers' writes
    into the teacher's checkout are refused by the OS (Landlock) or, where it has none, seen by the
    judge's listing of the checkout: no marks either way. The leaker's text never reaches its
    message; exit(0) before the report is a crash. The forker's child, moved to a session of its
    own, and a stray that also left the copy for / do not outlive their checks."""
    base = edition.write_student_edition(tmp_path / "edition")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    j = judge.Judge(base, scratch, REFERENCE, LIMIT_S, "forged-test", vet=lambda code, region=None: [], guard=ROOT)
    try:
        j.learn_expected(3)
        verdict = j.check(3, {"snapshot": textwrap.dedent(HOSTILE_EX3["forger"])})
        assert verdict.status == "forged" and verdict.mark == 0.0, verdict
        guide = TEACHER.read_text()
        for name in ("gc-escaper", "torch-writer", "torch-leaker", "exit0"):
            verdict = j.check(3, {"snapshot": textwrap.dedent(HOSTILE_EX3[name])})
            confined = j.starter.confinement["landlock"] > 0
            assert verdict.mark == 0.0 and verdict.status in (("failed", "crash") if confined else (
                "failed", "crash", "escaped")), (name, verdict)
            assert not [t.rule for t in verdict.tests if "LEAK" in t.rule or guide[:80] in t.rule], name
            assert not confined or not ESCAPED.exists(), name
            ESCAPED.unlink(missing_ok=True)
        (tmp_path / "scratch2").mkdir()
        unconfined = judge.Judge(base, tmp_path / "scratch2", REFERENCE, LIMIT_S, "unconfined-test",
                                 vet=lambda code, region=None: [], guard=ROOT, confine=False)
        try:  # without the wall (a kernel with no Landlock): the write lands, the watch sees it, no marks
            unconfined.expected[3] = j.expected[3]
            verdict = unconfined.check(3, {"snapshot": textwrap.dedent(HOSTILE_EX3["gc-escaper"])})
            assert ESCAPED.exists() and verdict.status == "escaped" and verdict.mark == 0.0, verdict
            assert all(str(ROOT) not in t.rule for t in verdict.tests) and str(ROOT) not in verdict.summary
        finally:
            unconfined.close()
            ESCAPED.unlink(missing_ok=True)
        looker = f"""
import os, sys
root, venv = {str(ROOT)!r}, os.path.realpath(sys.prefix)
seen = [*os.environ.values(), *sys.argv, os.getcwd(), *open("/proc/self/cmdline").read().split(chr(0))[1:],
        *(p for p in sys.path if not os.path.realpath(p or ".").startswith(venv))]
assert not [s for s in seen if root in s], "the teacher's checkout is named in the check's process"
""" + SNAPSHOT
        clean = j.check(3, {"snapshot": looker})
        assert clean.status == "passed", clean  # no path of the checkout in its env, argv, cwd or import path
        peeker = f"""
read = []
for path in ({str(TEACHER)!r}, {str(tmp_path / "edition" / "README.md")!r}):
    try:
        open(path).close()
        read.append(path)
    except PermissionError:
        pass
assert not read, "a check read " + str(read)
""" + SNAPSHOT
        if j.starter.confinement["landlock"] > 0:  # the teacher's checkout and other folders: not readable
            assert j.check(3, {"snapshot": peeker}).status == "passed"
        marker = f"stray{os.getpid() % 10**6}"
        forker = ("import os\nif 'FORKED' not in os.environ:\n    os.environ['FORKED'] = '1'\n"
                  "    if os.fork() == 0:\n        os.setsid()\n        while True:\n            pass\n"
                  "    if os.fork() == 0:\n        os.setsid()\n        os.chdir('/')\n        import ctypes\n"
                  f"        ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\n        while True:\n"
                  "            pass\n" + SNAPSHOT)
        forked = j.check(3, {"snapshot": forker})
        assert forked.status == "passed", forked  # its own code is right (it forks twice); what it forked is gone
        assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _grading_process(p, str(scratch) + "/")]
        time.sleep(1.5)  # the zygote sweeps its strays on each check's end, and every second when idle
        assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _named(p, marker)]
    finally:
        j.close()
        ESCAPED.unlink(missing_ok=True)


def _named(proc: Path, name: str) -> bool:
    try:
        return (proc / "comm").read_text().strip() == name
    except OSError:
        return False


@pytest.mark.parametrize("stop", ["Ctrl-C twice", "SIGTERM to its pid"])
def test_an_interrupted_grading_records_no_mark_exits_non_zero_and_leaves_nothing(stop, tmp_path):
    """Through the teacher's command, `python -m minisgl course grade`, which runs the grader in a
    process of its own: a SIGTERM to the command is passed on (the grader went on, orphaned, and
    recorded marks), and Ctrl-C, pressed twice, neither kills the grader mid-clean-up nor cuts its
    clean-up short (its scratch folder was left behind)."""
    base = edition.write_student_edition(tmp_path / "edition")
    subs, temp = tmp_path / "subs", tmp_path / "tmp"
    subs.mkdir(), temp.mkdir()
    with_regions(base, subs / "reference", REFERENCE)
    run = subprocess.Popen([sys.executable, "-m", "minisgl", "course", "grade", str(subs), "--out", str(tmp_path / "out"),
                            "--exercises", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, env=dict(os.environ, TMPDIR=str(temp)))
    for line in run.stdout:  # into the checks: the class is read, the reference's check starts next
        if "submissions read" in line:
            break
    if stop == "SIGTERM to its pid":
        os.kill(run.pid, signal.SIGTERM)  # as kill or a time-out does: the command alone
    else:
        for _ in range(2):  # as a terminal's Ctrl-C does: the whole group
            os.killpg(run.pid, signal.SIGINT)
            time.sleep(0.1)
    _, err = run.communicate(timeout=120)
    assert run.returncode == grade.INTERRUPTED and "no marks were recorded" in err, err[-2000:]
    time.sleep(2)  # time for an orphaned grader to go on
    assert not (tmp_path / "out").exists() and list(temp.iterdir()) == []
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _grading_process(p, f"{temp}/")]
