"""The course's tooling: exercises, the student edition, the grader and the checkers of the texts.

The lesson texts and scripts live in the repository's `lessons/`; this package works on them and
on the exercise regions of `minisgl/`, so it needs the repository checkout (an editable install).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository checkout
PACKAGE = ROOT / "minisgl"
LESSONS = ROOT / "lessons"
EXERCISE_TESTS = LESSONS / "exercises" / "tests"  # the tests of each exercise, beside the repository's tests/
WORK = LESSONS / "exercises" / "work"  # the learners' copies that `make_exercise.py generate` writes

# what a skeleton's region raises: NotImplementedError("exercise N: <part> (hints: ...)") (make_exercise.skeleton_raise)
MISSING_PART = re.compile(r"exercise (?P<number>\d+): (?P<part>[^(]+?) \(hints: ")


def missing_exercise(error: BaseException | None) -> re.Match | None:
    """The skeleton's NotImplementedError("exercise N: ...") behind `error`, if any. It may come
    wrapped: work that failed on the engine's stream is re-raised on the host as a DeviceError."""
    while error is not None:
        found = MISSING_PART.search(str(error))
        if found:
            return found
        error = error.__cause__ or error.__context__
    return None
