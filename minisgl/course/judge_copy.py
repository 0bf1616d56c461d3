"""A check's throw-away copy of the student edition, which the judge (judge.py) runs the check in
and removes after: each exercise's code between its markers, the exercise tests, a canary test
that must fail with a secret text, and a home and a temporary folder of its own."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

from minisgl.course.make_exercise import CONFTEST, PYTEST_INI, Wrong, replace_regions
from minisgl.course.markers import marked_files


def write_check_copy(copy: Path, edition: Path, exercise_tests: Path,
                     code: dict[int, dict[str, str]]) -> tuple[str, str]:
    """Copy `edition` to `copy` with `code[n]` (region name -> code) between exercise n's markers
    and `exercise_tests` in its tests: the canary test's node id, and the text it must fail with."""
    shutil.copytree(edition, copy, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    for rel, numbers in marked_files(copy / "minisgl").items():
        path = copy / "minisgl" / rel
        source = path.read_text()
        for n in numbers:
            source, _ = replace_regions(source, n, Wrong(n, "graded", "", "", code.get(n, {})), keep_markers=True)
        path.write_text(source)
    tests = copy / "tests"
    for path in sorted(exercise_tests.glob("*.py")):
        shutil.copy(path, tests / path.name)
    (copy / "pytest.ini").write_text(PYTEST_INI)
    (copy / "conftest.py").write_text(CONFTEST)
    canary, secret = f"test_{secrets.token_hex(8)}", secrets.token_hex(16)
    (tests / f"{canary}.py").write_text(f"def {canary}():\n    assert False, {secret!r}\n")
    for folder in ("home", "tmp"):
        (copy / folder).mkdir()
    return f"tests/{canary}.py::{canary}", secret
