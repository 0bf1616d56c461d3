"""The student edition (minisgl/course/student_edition.py): no answer in it, in code or text;
no teacher's file and no history; the reference regions put back give the reference package
(which passes every exercise: test_exercises.py); and a lesson that reaches a part not written
yet says which exercise unlocks it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
MIN_REVEALING_CHARS = 21  # shorter lines (`continue`, `if last is not None:`) say nothing about the answer


from minisgl.course import grade
from minisgl.course import make_exercise as tool
from minisgl.course import student_edition as edition


def squeeze(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    return edition.write_student_edition(tmp_path_factory.mktemp("edition") / "course")


def revealing_lines() -> dict[str, str]:
    """Each reference line of a region that the package has nowhere outside the regions (a line
    that normal_loop also has gives nothing away) -> 'file: exercise N: part'."""
    found, outside = {}, []
    for rel in sorted(tool.PACKAGE.rglob("*.py")):
        if rel.relative_to(tool.ROOT).as_posix() in edition.TEACHER_ONLY:  # near copies of the answers
            continue
        lines = rel.read_text().splitlines()
        inside = set()
        for region in tool.regions(lines):
            inside.update(range(region.first, region.last + 1))
            for line in lines[region.first + 1:region.last]:
                code = squeeze(line.split("  # ")[0])
                if len(code) >= MIN_REVEALING_CHARS and not code.startswith("#"):
                    found[code] = f"{rel.name}: exercise {region.number}: {region.name}"
        outside += [line for i, line in enumerate(lines) if i not in inside]
    outside_text = squeeze("\n".join(outside))
    return {code: where for code, where in found.items() if code not in outside_text}


def test_no_reference_line_of_any_region_appears_in_the_student_edition(student):
    lines = revealing_lines()
    assert len(lines) >= 20, "the regions' reference lines were not found: is the package marked?"
    quoted = []
    for path in sorted(p for p in student.rglob("*") if p.is_file() and ".git" not in p.relative_to(student).parts):
        try:
            text = squeeze(path.read_text())
        except UnicodeDecodeError:
            continue  # the checkpoint's weights
        quoted += [f"{path.relative_to(student)} quotes {code!r} ({where})" for code, where in lines.items()
                   if code in text]
    assert not quoted, "\n".join(quoted)


def test_the_teachers_files_and_the_history_are_left_out(student):
    assert not [name for name in edition.TEACHER_ONLY if (student / name).exists()]
    commits = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=student, capture_output=True, text=True,
                             check=True).stdout
    assert commits.strip() == "1"
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=student, capture_output=True, text=True).stdout
    assert dirty == "", dirty


def test_every_region_raises_naming_its_exercise_and_the_reference_fits_back(student, tmp_path):
    for rel in tool.marked_files():
        text = (student / "minisgl" / rel).read_text()
        for region in tool.regions(text.splitlines()):
            body = [line.strip() for line in text.splitlines()[region.first + 1:region.last]]
            message = f"exercise {region.number}: {region.name} (hints: python -m minisgl course hint {region.number})"
            assert body[-1:] == [f"raise NotImplementedError({message!r})"] and all(
                line.startswith("# define ") for line in body[:-1]), body
            if (region.number, region.name) == (5, "checkpoint"):  # exercise 4's region below reads it
                assert body[0] == "# define written here: the code after this region uses it", body
    # the reference's region bodies, put into the student edition, give back the reference package
    restored = grade.put_regions(student, grade.written_regions(ROOT), tmp_path / "restored")
    for path in sorted(tool.PACKAGE.rglob("*.py")):
        rel = path.relative_to(tool.PACKAGE)
        if path.relative_to(tool.ROOT).as_posix() in edition.TEACHER_ONLY:
            continue
        assert (restored / "minisgl" / rel).read_text() == path.read_text(), rel


def test_the_exercise_checker_tests_minisgl_in_place_in_the_student_edition(student):
    done = subprocess.run([sys.executable, "-m", "minisgl.course.make_exercise", "generate", "2"], cwd=student,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "minisgl/ itself" in done.stderr, done.stderr


@pytest.mark.full  # a learner-side subprocess run, 10-16 s: the fast tier keeps the in-process checks
def test_a_lesson_that_needs_a_missing_part_names_the_exercise_and_ends_cleanly(student):
    done = subprocess.run([sys.executable, "lessons/lesson_1_serial_loop.py"], cwd=student, capture_output=True,
                          text=True, timeout=300)
    said = re.search(r"this lesson needs exercise (\d+)", done.stdout, re.IGNORECASE)
    assert done.returncode == 0 and said and "Traceback" not in done.stderr, (done.stdout[-2000:], done.stderr[-2000:])
    package = "".join(path.read_text() for path in (student / "minisgl").rglob("*.py"))
    assert re.search(rf"NotImplementedError\(['\"]exercise {said[1]}: ", package), "it names an exercise that is not missing"


def test_no_text_of_the_edition_points_at_a_file_it_lacks(student):
    """Every relative link of the edition's texts resolves there, and every mention of a teacher's
    file (the guide, the grader, the known-wrong solutions) says it is not in this edition."""
    names = edition._teacher_only_names()
    for md in sorted(student.rglob("*.md")):
        if ".git" in md.relative_to(student).parts:
            continue
        text = md.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in target:
                assert (md.parent / target).exists(), f"{md.relative_to(student)} links {target}"
        for line in text.splitlines():
            assert not names.search(line) or edition.TEACHERS_NOTE in line, \
                f"{md.relative_to(student)} names a teacher's file without saying so: {line}"


@pytest.mark.full  # an engine start in a fresh interpreter
def test_the_demo_in_the_edition_names_the_missing_exercise_in_one_line(student):
    done = subprocess.run([sys.executable, "-m", "minisgl", "demo"], cwd=student, capture_output=True, text=True,
                          timeout=300)
    said = re.search(r"needs exercise (\d+)", done.stderr)
    assert done.returncode == 2 and said and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
