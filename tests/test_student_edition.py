"""The student edition (minisgl/course/student_edition.py): no answer in it, in code or text;
no teacher's file and no history; every region holds its catalog stub, and the reference regions
put back give the reference package (which passes every exercise: test_exercises.py). The stubs
keep the course running from day one (the demo and every lesson), each is refused by its own
exercise's check with the rule it breaks, and a correct region passes its check with every other
region still a stub."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
MIN_REVEALING_CHARS = 21  # shorter lines (`continue`, `if last is not None:`) say nothing about the answer


from minisgl.course import grade
from minisgl.course import make_exercise as tool
from minisgl.course import student_edition as edition
from minisgl.course.catalog import EXERCISES
from minisgl.course.judge_copy import put_regions
from minisgl.course.region_policy import refusal, region_problems
from minisgl.course.runner import run_checks


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


def test_the_sections_for_teachers_are_left_out_of_the_texts(student):
    """lessons/exercises/README.md's sections on making the edition and on the known-wrong
    solutions are for teachers: the edition's copy lacks them and keeps what follows them."""
    source = (ROOT / "lessons/exercises/README.md").read_text()
    text = (student / "lessons/exercises/README.md").read_text()
    left_out = [h for h in re.findall(r"^#+ .*\(for teachers\)$", source, flags=re.MULTILINE)]
    assert len(left_out) >= 2, "the guide's sections for teachers were not found"
    assert not [h for h in left_out if h in text]
    assert "wrong_solutions" not in text and "student_edition.py" not in text
    assert "## How the skeletons are made" in text  # the section after them stays


def test_a_section_for_teachers_ends_at_the_next_heading_of_its_level():
    text = textwrap.dedent("""\
        # Guide
        ## For all
        a
        ## Making it (for teachers)
        b
        ```
        # a shell comment in a code block, not a heading
        ```
        ### Detail
        c
        ## After
        d""")
    assert edition.without_teacher_sections(text).split("\n") == ["# Guide", "## For all", "a", "## After", "d"]


def test_no_file_of_the_edition_imports_a_teachers_module(student):
    """A file that imports the grader fails in the edition (tests/test_grading_class.py did: a
    collection error in its `make test-all`). Absolute imports: the package's own files use them."""
    teachers = {name.removesuffix(".py").replace("/", ".") for name in edition.TEACHER_ONLY if name.startswith("minisgl/")}
    found = []
    for path in sorted(student.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            found += [f"{path.relative_to(student)}: {name}" for name in names if name in teachers]
    assert found == []

def test_every_region_holds_its_catalog_stub_and_the_reference_fits_back(student, tmp_path):
    for rel in tool.marked_files():
        text = (student / "minisgl" / rel).read_text()
        for region in tool.regions(text.splitlines()):
            body = "".join(text.splitlines(keepends=True)[region.first + 1:region.last])
            assert body == "".join(tool.indented(EXERCISES[region.number].stubs[region.name], region.indent)), (
                region.number, region.name)
            assert body.lstrip().startswith(f"# STUB (exercise {region.number} not written)"), body
    # the reference's region bodies, put into the student edition, give back the reference package
    restored = put_regions(student, grade.written_regions(ROOT), tmp_path / "restored")
    for path in sorted(tool.PACKAGE.rglob("*.py")):
        rel = path.relative_to(tool.PACKAGE)
        if path.relative_to(tool.ROOT).as_posix() in edition.TEACHER_ONLY:
            continue
        assert (restored / "minisgl" / rel).read_text() == path.read_text(), rel


def test_every_region_has_a_stub_the_grader_would_run():
    """The grader vets a submission's region code before it runs it (region_policy.py); a student who
    has not written an exercise hands in its stub, which must then be run (and fail), not refused."""
    named = {(r.number, r.name) for path in tool.PACKAGE.rglob("*.py") for r in tool.regions(path.read_text().splitlines())}
    stubbed = {(n, name) for n, e in EXERCISES.items() for name in e.stubs}
    assert named == stubbed, (sorted(named - stubbed), sorted(stubbed - named))
    for number, name in sorted(stubbed):
        assert not region_problems(textwrap.dedent(EXERCISES[number].stubs[name])), (number, name)


def test_the_exercise_checker_tests_minisgl_in_place_in_the_student_edition(student):
    done = subprocess.run([sys.executable, "-m", "minisgl.course.make_exercise", "generate", "2"], cwd=student,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "minisgl/ itself" in done.stderr, done.stderr


def test_the_checker_refuses_what_the_grader_would_not_run_with_the_graders_message(student, tmp_path):
    """`course exercise N` holds the code between the markers to the grader's rules before any test
    runs (region_policy.py ships in the edition): a refusal is the line the grader records."""
    reference = grade.written_regions(ROOT)
    hostile = dict(reference[2], publish="import numpy\nx = getattr(self, name)\n" + reference[2]["publish"])
    work = put_regions(student, {2: hostile}, tmp_path / "work")
    done = run_in(work, "-m", "minisgl", "course", "exercise", "2")
    line = refusal(hostile)
    assert line.startswith("not run: a region may not import `numpy` (only ") and "getattr" in line, line
    assert done.returncode == 1 and f"exercise 2: {line}\n" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "pytest" not in done.stdout + done.stderr  # no test ran


def test_the_rules_read_the_same_in_the_edition_as_in_the_checkout(student, tmp_path):
    """The package is read with the regions' bodies left out: the student's checker (on the
    edition's stubs, or on the student's own code, a debugging write to a file included) and the
    grader (on the reference) judge alike."""
    from .test_grading import REACHES_OUTSIDE

    debugging = "open('/tmp/debug.txt', 'a').write('release')\n" + textwrap.dedent(EXERCISES[5].stubs["checkpoint"])
    home = put_regions(student, {5: {"checkpoint": debugging}}, tmp_path / "home")  # KVLedger's region
    codes = [*REACHES_OUTSIDE.values(), *(code for bodies in grade.written_regions(ROOT).values()
                                          for code in bodies.values()),
             *(textwrap.dedent(stub) for e in EXERCISES.values() for stub in e.stubs.values()),
             "from .kv_ledger import KVLedger\nok = isinstance(x, KVLedger)"]
    for code in codes:
        graded = region_problems(code)
        assert region_problems(code, student / "minisgl") == graded == region_problems(code, home / "minisgl"), code


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


def run_in(student: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=student, capture_output=True, text=True, timeout=600)


@pytest.mark.full  # the demo and 14 lessons, each in a fresh interpreter: a few minutes
def test_the_demo_and_every_lesson_run_to_the_end_before_any_exercise_is_written(student):
    lessons = sorted(student.glob("lessons/lesson_*_*.py"), key=lambda p: int(p.name.split("_")[1]))
    assert len(lessons) == 14
    for args in (["-m", "minisgl", "demo"], *([str(p.relative_to(student))] for p in lessons)):
        done = run_in(student, *args)
        assert done.returncode == 0 and "Traceback" not in done.stderr + done.stdout, (
            args, done.stdout[-2000:], done.stderr[-2000:])
        assert "needs exercise" not in done.stdout + done.stderr, (args, done.stdout[-2000:])


# The figures by which the lessons show a mechanism's symptom (most of them with its switch off),
# as tests/test_lessons.py checks them in this checkout: lesson -> figure -> the exercise whose stub
# cannot show it (it ignores the switch, or does without the mechanism), or None where the edition
# as handed out shows the symptom itself. Neither may read 0 there: "switch it off and nothing
# happens" teaches the wrong thing. Where a stub cannot show it the lesson says which exercise the
# figure needs (lessons/common.py figure(needs=...)), in the figure's place and without a number.
SYMPTOMS = {
    0: {"slots the radix cache holds now": 5, "prompt tokens served from the cache": 5,
        "the same prompt again: tokens served from the cache": 5},
    4: {"early commits (future_map off)": None},
    5: {"misrouted batches (batch_snapshot off)": None, "wrong outputs (batch_snapshot off)": None},
    6: {"overshoot steps (length_lookahead off)": 4, "leaked KV slots (release_allocated off)": 4,
        "tokens after stop (skip_finished off)": None},
    7: {"wrong outputs (commit_point_cache off)": None, "wrong outputs (staging both off)": None,
        "unread overwrites (staging both off)": None, "stale row results (deferred_row_free off)": None,
        "wrong D (deferred_row_free off)": 5},
    8: {"early commits (prefill_sync on)": 1},  # the symptom of prefill_sync off is this count's absence
    10: {"outputs that differ from reserve (skip off)": 3},
    11: {"outputs breaking the grammar (naive mask)": 10, "misplaced logprobs (live lengths)": None},
    12: {"outputs differing (publish wait off)": 11, "verify rows past their slots (reserve off)": 11,
         "KV slots leaked (release_allocated off)": 4,
         "outputs differing (mixed, committed - 1 under the overlap)": 12},
}
FIGURE_LINE = re.compile(r"^» (?P<name>.+?)(?: = (?P<value>-?[\d.]+)(?: .*)?|: not shown until exercise (?P<needs>\d+) is "
                         r"written; its stub \((?P<part>[^)]+)\): (?P<why>.+))$", re.MULTILINE)


def test_a_lesson_says_which_exercise_a_figure_needs_only_while_its_stub_is_there(student, tmp_path):
    """stub_note: the stub's own words while the region holds it unchanged, None once anything
    else is written there, and None in this checkout (the reference)."""
    from minisgl.course.catalog import stub_note

    for number, exercise in EXERCISES.items():
        for name in exercise.stubs:
            note = stub_note(number, name, student)
            assert note and not note.startswith(("#", "STUB")), (number, name, note)
            assert stub_note(number, name) is None, (number, name)
    written = put_regions(student, {4: {"length lookahead": "pass\n"}}, tmp_path / "written")
    assert stub_note(4, "length lookahead", written) is None
    assert stub_note(4, "release by allocated length", written) is not None


@pytest.mark.parametrize("number", [pytest.param(n, marks=() if n == 6 else pytest.mark.full) for n in SYMPTOMS])
def test_no_lesson_shows_a_symptom_as_0_in_the_student_edition(student, number):
    """Each lesson's symptom figures in the edition as handed out: a count above 0, or, where the
    stub cannot show it, the line naming the exercise it needs, in the stub's words. (Before this,
    10 of them printed 0 there: lesson 6's length_lookahead and release_allocated off, lesson 10's
    retract_skip_inflight off, lesson 11's naive mask, lesson 12's four, lesson 7's wrong D and
    lesson 8's early commits; lesson 0's cache counts 0, 0 and -5.) Lesson 6 is the fast tier's."""
    from minisgl.course.catalog import stub_note

    script = next(student.glob(f"lessons/lesson_{number}_*.py"))
    done = subprocess.run([sys.executable, str(script.relative_to(student)), "--quick"], cwd=student,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "LESSON_WIDTH": "400"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = {m["name"]: m for m in FIGURE_LINE.finditer(done.stdout)}
    for name, needs in SYMPTOMS[number].items():
        line = lines.get(name)
        assert line is not None, (name, done.stdout[-4000:])
        if needs is None:
            assert line["value"] is not None and float(line["value"]) > 0, (number, line[0])
        else:
            assert line["value"] is None and int(line["needs"]) == needs, (number, line[0])
            assert line["why"] in (stub_note(needs, line["part"], student), "see above"), line[0]
    if number == 12:  # the stub mixes no decode row, and the count says so (it counted the rows offered)
        assert float(lines["decode rows mixed into prefill batches"]["value"]) == 0


# What each stub is told by its own exercise's check: the first failure names the rule it breaks.
STUB_RULES = {
    1: "must ask _must_commit_first(last, planned) after schedule()",
    2: "publish and resolve must be tensor operations that stay on the device",
    3: "a copy of the RunningBatch",
    4: "keep the switch: with length_lookahead off",
    5: "the checkpoint: hand the KV that committed batches wrote to the radix cache",
    6: "a row whose own last batch has passed is free at once",
    7: "wait only while the buffer's consumed event has not passed",
    8: "launch() blocked the host until the scheduler stream was done",
    9: "compare the request's (row, generation) with the batch's, not the row alone",
    10: "count each delayed sampling",
    11: "a verify step gets KV slots up to two steps of K+1",
    12: "each running request's decode row must ride in the prefill batch",
}


@pytest.mark.full  # one exercise check per exercise: several minutes
@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_each_stub_is_refused_by_its_own_check_with_the_rule_named(student, tmp_path, number):
    work = put_regions(student, {}, tmp_path / "work")  # the edition as handed out, copied (the check writes)
    report = run_checks(work, number, stop_at_first_failure=True)
    first = report.first_failure
    assert not report.passed and first is not None and STUB_RULES[number] in first.message, (
        first and first.message[:1000])


@pytest.mark.full  # one exercise check per exercise: several minutes
@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_a_correct_region_passes_its_check_with_every_other_region_a_stub(student, tmp_path, number):
    work = put_regions(student, {number: grade.written_regions(ROOT)[number]}, tmp_path / "work")
    report = run_checks(work, number)
    assert report.passed, [(o.nodeid, o.message[:500]) for o in report.outcomes if o.outcome == "failed"]
