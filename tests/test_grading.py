"""The grader (lessons/exercises/grade.py) on three submissions made from the student edition: the
reference's regions put back (full marks), the student edition untouched (zero), and the reference
with one line added outside a region, in the function that holds exercise 5's and 4's regions
(those two flagged with no marks, the others graded as usual)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import load_exercise_tool

ROOT = Path(__file__).resolve().parents[1]
GRADED = [3, 5]  # one exercise the outside edit leaves alone, one it costs (each run takes a while)


grade = load_exercise_tool("grade")
edition = sys.modules["student_edition"]
RELEASE_FLAG = "        req.released = True\n"  # a line of KVLedger.release (kv_ledger.py), outside its regions


@pytest.fixture(scope="module")
def submissions(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grading")
    base = edition.write_student_edition(root / "edition")
    subs = root / "submissions"
    subs.mkdir()
    grade.put_regions(base, grade.written_regions(ROOT), subs / "reference")
    shutil.copytree(base, subs / "empty", ignore=shutil.ignore_patterns(".git"))
    outside = grade.put_regions(base, grade.written_regions(ROOT), root / "outside")
    release = outside / "minisgl" / "kv_ledger.py"
    assert release.read_text().count(RELEASE_FLAG) == 1
    release.write_text(release.read_text().replace(RELEASE_FLAG, RELEASE_FLAG + "        req.cached_len = 0\n"))
    # this one is handed in as a patch against the student edition
    shutil.copytree(base / ".git", outside / ".git")
    diff = subprocess.run(["git", "diff"], cwd=outside, capture_output=True, text=True, check=True).stdout
    (subs / "outside.patch").write_text(diff)
    return subs


@pytest.mark.full
def test_reference_full_marks_empty_zero_outside_edit_flagged(submissions, tmp_path):
    grade.main([str(submissions), "--out", str(tmp_path), "--jobs", "2", "--exercises", *map(str, GRADED)])
    rows = {(g["student"], g["exercise"]): g for g in json.loads((tmp_path / "grades.json").read_text())}
    assert set(rows) == {(s, n) for s in ("reference", "empty", "outside") for n in GRADED}
    for n in GRADED:
        ref, empty = rows["reference", n], rows["empty", n]
        assert ref["score"] == 1.0 and ref["passed"] == ref["total"] > 0 and not ref["failed_rules"], ref
        assert empty["score"] == 0.0 and not empty["flagged"], empty
        assert all(f"exercise {n}:" in rule and "NotImplementedError" in rule for rule in empty["failed_rules"])
    flagged, untouched = rows["outside", 5], rows["outside", 3]
    assert flagged["flagged"] and flagged["score"] == 0.0, flagged
    assert flagged["failed_rules"] == ["edited outside the exercise regions: minisgl/kv_ledger.py line "
                                       f"{edited_line(submissions)} changed"], flagged
    assert not untouched["flagged"] and untouched["score"] == 1.0, untouched
    with open(tmp_path / "grades.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [(r["student"], int(r["exercise"]), float(r["score"])) for r in table] == [
        (g["student"], g["exercise"], g["score"]) for g in json.loads((tmp_path / "grades.json").read_text())]


def edited_line(submissions: Path) -> int:
    """The line of the student edition's kv_ledger.py after which the outside edit was added."""
    lines = (submissions / "empty" / "minisgl" / "kv_ledger.py").read_text().splitlines(keepends=True)
    return lines.index(RELEASE_FLAG) + 2


def test_every_exercise_is_flagged_for_an_edit_of_the_tests(submissions, tmp_path):
    tree = shutil.copytree(submissions / "reference", tmp_path / "tree")
    test = tree / "lessons" / "exercises" / "tests" / "test_ex2_future_map.py"
    test.write_text(test.read_text().replace("assert", "assert True or", 1))
    flagged = grade.edits_outside_regions(submissions / "empty", tree)
    assert sorted(flagged) == sorted(grade.EXERCISES), flagged
    assert grade.edits_outside_regions(submissions / "empty", submissions / "reference") == {}


def test_a_note_in_a_text_file_is_neither_graded_nor_a_crash(submissions, tmp_path):
    """Prose is not code: a learner's note in the exercises' README, even one that quotes a marker
    line, flags nothing (it once made the whole submission ungradable)."""
    tree = shutil.copytree(submissions / "reference", tmp_path / "tree")
    readme = tree / "lessons" / "exercises" / "README.md"
    readme.write_text(readme.read_text() + "\nmy note: # >>> exercise 2: resolve ... # <<< exercise 2 'unfinished\n")
    assert grade.edits_outside_regions(submissions / "empty", tree) == {}


def test_a_patch_that_is_not_a_regular_file_is_not_gradable_instead_of_a_hang(tmp_path):
    """A FIFO named like a patch blocked `git apply` for ever, and one linked to /dev/zero fed it
    until memory ran out: the submission is "not gradable", and an empty folder is one error line."""
    base = tmp_path / "edition"
    base.mkdir()
    os.mkfifo(tmp_path / "bob.patch")
    (tmp_path / "carol.patch").symlink_to("/dev/zero")
    for name in ("bob.patch", "carol.patch"):
        sub = grade.read_submission(tmp_path / name, base)
        assert "not a regular file" in sub.not_gradable
    (tmp_path / "nothing").mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "lessons" / "exercises" / "grade.py"), str(tmp_path / "nothing"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: no submission")


def test_identical_region_code_shares_one_check_and_a_code_change_does_not():
    """The grader runs each exercise's checks once per distinct region code: comments, blank lines
    and spacing do not make code distinct, a changed statement does."""
    reference = grade.written_regions(ROOT)
    for number, bodies in reference.items():
        restyled = {name: "# my note\n\n" + body.replace(" = ", "  =  ", 1) for name, body in bodies.items()}
        changed = {name: "_unused = 0\n" + body for name, body in bodies.items()}
        assert grade.fingerprint(number, restyled) == grade.fingerprint(number, bodies), number
        assert grade.fingerprint(number, changed) != grade.fingerprint(number, bodies), number
    assert grade.fingerprint(1, reference[1]) != grade.fingerprint(2, reference[1])


@pytest.mark.full
def test_a_check_that_kills_its_worker_fails_alone():
    """A submission whose code kills the grader's worker process (here: exits in the middle of a test)
    gets that one check failed; the checks that were queued with it are graded as usual."""
    reference = grade.written_regions(ROOT)
    killer = {"snapshot": "import os\nos._exit(3)\n"}
    checks = {grade.fingerprint(3, killer): killer, grade.fingerprint(2, reference[2]): reference[2],
              grade.fingerprint(3, reference[3]): reference[3]}
    seen = []
    results = grade.run_checks_in_workers(checks, 1, lambda key, result: seen.append(key))
    assert sorted(seen) == sorted(checks)
    crashed, *graded = (results[key] for key in checks)
    assert crashed.failed_rules == [grade.CRASHED] and crashed.score == 0.0
    assert all(r.score == 1.0 and r.passed == r.total > 0 for r in graded), graded
