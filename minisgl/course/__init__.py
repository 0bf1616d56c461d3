"""The course's tooling: exercises, the student edition, the grader and the checkers of the texts.

The lesson texts and scripts live in the repository's `lessons/`; this package works on them and
on the exercise regions of `minisgl/`, so it needs the repository checkout (an editable install).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository checkout
PACKAGE = ROOT / "minisgl"
LESSONS = ROOT / "lessons"
EXERCISE_TESTS = LESSONS / "exercises" / "tests"  # the tests of each exercise, beside the repository's tests/
WORK = LESSONS / "exercises" / "work"  # the learners' copies that `make_exercise.py generate` writes
