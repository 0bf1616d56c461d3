"""A check's throw-away copy of the student edition, which the judge (judge.py) runs the check in
and removes after: each exercise's code between its markers, the exercise tests, a canary test
that must fail with a secret text, and a home and a temporary folder of its own."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

from minisgl.course.make_exercise import CONFTEST, PYTEST_INI, Wrong, replace_regions
from minisgl.course.markers import marked_files


def put_regions(tree: Path, code: dict[int, dict[str, str]], dest: Path) -> Path:
    """A copy of tree in dest (its git history and compiled files left out, a symlink copied as a
    link), with `code` (exercise -> region name -> code) between the markers of its minisgl (the
    markers kept; a region `code` does not name keeps what it holds): e.g. the reference's regions
    put into the student edition."""
    shutil.copytree(tree, dest, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"), symlinks=True)
    for rel in marked_files(dest / "minisgl"):
        path = dest / "minisgl" / rel
        source = path.read_text()
        for number, bodies in code.items():
            source, _ = replace_regions(source, number, Wrong(number, "", "", "", bodies), keep_markers=True)
        path.write_text(source)
    return dest


def write_check_copy(copy: Path, edition: Path, exercise_tests: Path,
                     code: dict[int, dict[str, str]]) -> tuple[str, str]:
    """Copy `edition` to `copy` with `code[n]` (region name -> code) between exercise n's markers
    and `exercise_tests` in its tests: the canary test's node id, and the text it must fail with."""
    put_regions(edition, code, copy)
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
