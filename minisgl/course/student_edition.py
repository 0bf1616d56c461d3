"""Write the student edition: a repository to hand to a class, without the answers.

    python -m minisgl.course.student_edition DIR

DIR gets every file of this repository except the teacher's ones (TEACHER_ONLY: the guide with
the answers, the known-wrong solutions, the grader and the tests of these tools) and the sections
of its Markdown files whose heading ends with "(for teachers)", with every
exercise region of minisgl/ replaced by its stub from the catalog (make_exercise.replace_regions):
a correct but naive version of the part (a whole-stream wait for the precise event, a host round
trip for the device relay, rows reused later than they could be), so that the demo and every
lesson run from day one, before any exercise is written and after any subset of them. Each stub
fails its own exercise's check, which tests precision as well as correctness, with the rule it
breaks. Where no naive version can be correct (exercises 3 and 12), the stub keeps the course
running and its first line says what it gives up. The marker lines stay around each stub: the
learner writes each part there, in minisgl/ itself, and the grader (grade.py) finds it there.
DIR becomes a fresh git repository with one commit, so that no history of the answers comes
with it.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

from minisgl.course.catalog import EXERCISES
from minisgl.course.make_exercise import ROOT, replace_regions
from minisgl.course.markers import marked_files

# What only a teacher gets: the answers to the written questions, the known-wrong solutions (near
# copies of the reference), and the tools and tests that need the reference to work. The rules on
# region code (region_policy.py, with region_policy_lists.py and region_policy_package.py) are the
# student's too: the checker applies them before the tests.
TEACHER_ONLY = frozenset({
    "lessons/TEACHER.md",
    "lessons/exercises/wrong_solutions.py",
    "minisgl/course/student_edition.py",
    "minisgl/course/grade.py",
    "minisgl/course/judge.py",
    "minisgl/course/judge_copy.py",
    "minisgl/course/judge_messages.py",
    "minisgl/course/judge_verdict.py",
    "minisgl/course/judge_zygote.py",
    "minisgl/course/judge_process.py",
    "minisgl/course/submission.py",
    "tests/test_exercises.py",
    "tests/test_student_edition.py",
    "tests/test_grading.py",
    "tests/test_grading_class.py",
    "minisgl/course/check_figures.py",  # checks the guide's figures: reads TEACHER.md
    "benchmarks/grading_class.py",  # a synthetic class for timing the grader: made from the wrong solutions
})
COMMIT_MESSAGE = "minisgl course: student edition (every exercise region holds a naive stub)"


def repository_files(root: Path = ROOT) -> list[str]:
    """The files git knows or would add here (tracked, and untracked but not ignored), that exist."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    return sorted(name for name in set(listed) if name and (root / name).is_file())


TEACHERS_NOTE = " (teacher's edition only)"


def _teacher_only_names() -> re.Pattern[str]:
    """A teacher's file by its name, or a module of the package by its dotted name."""
    names = {Path(name).name for name in TEACHER_ONLY} | {
        name.removesuffix(".py").replace("/", ".") for name in TEACHER_ONLY if name.startswith("minisgl/")}
    return re.compile(r"\b(?:" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b")


def without_teacher_sections(text: str) -> str:
    """A Markdown text without its sections for teachers: a heading that ends with "(for
    teachers)", through the line before the next heading of the same level or higher."""
    out, skipping = [], 0  # skipping: the level of the section being left out, 0 when none
    fenced = False
    for line in text.split("\n"):
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"(#+) ", line)
        if heading and skipping and len(heading[1]) <= skipping:
            skipping = 0
        if heading and not skipping and line.rstrip().endswith("(for teachers)"):
            skipping = len(heading[1])
        if not skipping:
            out.append(line)
    return "\n".join(out)


def without_teacher_links(text: str) -> str:
    """A text of the edition in which every mention of a teacher's file (a link, a code span, a
    bare name, a line of a code block) says that the file is not in this edition; a link to
    one becomes its text."""
    names = _teacher_only_names()
    chunks = re.split(r"(^```.*?^```[^\n]*$)", text, flags=re.MULTILINE | re.DOTALL)
    out = []
    for i, chunk in enumerate(chunks):
        if i % 2:  # a fenced code block: a note at the end of each line that names one
            out.append("\n".join(line + "  #" + TEACHERS_NOTE if names.search(line) and TEACHERS_NOTE not in line
                                  else line for line in chunk.split("\n")))
        else:
            out.append(_noted_prose(chunk, names))
    return "".join(out)


def _noted_prose(text: str, names: re.Pattern[str]) -> str:
    link = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)]*)\)")
    out = []
    parts = re.split(r"(`[^`\n]*`)", text)
    for i, part in enumerate(parts):
        following = parts[i + 1] if i + 1 < len(parts) else ""
        if i % 2:  # a code span
            noted = names.search(part) and not following.startswith(TEACHERS_NOTE)
            out.append(part + TEACHERS_NOTE if noted else part)
            continue
        part = link.sub(lambda m: m["text"] + TEACHERS_NOTE if names.search(m["target"]) else m[0], part)
        part = names.sub(lambda m: m[0] if part.startswith(TEACHERS_NOTE, m.end()) else m[0] + TEACHERS_NOTE, part)
        out.append(part)
    return "".join(out)


def without_answers(source: str) -> str:
    """Every exercise region's body replaced by its catalog stub, the markers kept."""
    for number in sorted(EXERCISES):
        source, _ = replace_regions(source, number, keep_markers=True, stub=True)
    return source


def write_student_edition(dest: Path, exclude: tuple[Path, ...] = ()) -> Path:
    """Write the student edition to dest (which must not exist, or be empty) and commit it there.
    Files under `exclude` (e.g. a folder of submissions kept in this checkout) are left out."""
    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} exists and is not empty")
    marked = {f"minisgl/{rel.as_posix()}" for rel in marked_files()}
    excluded = [p.resolve() for p in exclude]
    for name in repository_files():
        if name in TEACHER_ONLY or any((ROOT / name).resolve().is_relative_to(p) for p in excluded):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name in marked:
            source = without_answers((ROOT / name).read_text())
            ast.parse(source, name)  # the skeleton must stay valid Python
            target.write_text(source)
        elif name.endswith(".md"):
            target.write_text(without_teacher_links(without_teacher_sections((ROOT / name).read_text())))
        else:
            shutil.copy2(ROOT / name, target)
    git = ["git", "-c", "user.name=minisgl course", "-c", "user.email=course@minisgl.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", COMMIT_MESSAGE]):
        subprocess.run([*git, *args], cwd=dest, check=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path, help="a new (or empty) folder")
    args = ap.parse_args(argv)
    print(f"wrote the student edition: {write_student_edition(args.dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
