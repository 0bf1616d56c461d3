"""Exercises: the minisgl package with one part removed, for a learner to write back.

The reference code carries comment-only markers around each part (so it runs unchanged):

    # >>> exercise N: <name of the part>
    ...the code the learner writes...
    # <<< exercise N

`generate N` copies the whole package to `lessons/exercises/work/exN/minisgl/` and replaces
every marked region of exercise N by `raise NotImplementedError("exercise N: <name> ...")`,
at the region's indentation. Nothing is committed: a skeleton is always made from today's
code, so it cannot drift from the reference. A learner's existing copy is never overwritten
without --force.

`check N` makes the copy if it is missing, refreshes its tests (the repository's tests/ plus
lessons/exercises/tests/), prints which minisgl Python imports there, and runs exercise N's
test selection against the learner's copy: the same tests the reference passes. A test that
runs longer than HANG_S seconds is stopped, and every thread's stack is printed.

`runner.run_checks` runs the same selection inside the calling process and returns each test's
outcome and failure message: for checking many copies at once (tests/test_exercises.py).

`hint N --level K` prints hint level K (1: a question and the reading, 2: the idea, 3: near
code). `wrong` lists the known-wrong solutions kept in wrong_solutions.py; `check N --wrong
NAME` runs exercise N's tests against the reference with that wrong solution put in: what
the tests say to a learner who wrote it.

    python -m minisgl.course.make_exercise list
    python -m minisgl.course.make_exercise hint 1 [--level 2]
    python -m minisgl.course.make_exercise generate 1 [--force] [--dest DIR]
    python -m minisgl.course.make_exercise check 1 [--dest DIR] [-- extra pytest args]
    python -m minisgl.course.make_exercise check 1 --reference   # the same tests, reference code
    python -m minisgl.course.make_exercise wrong [1]             # the known-wrong solutions
    python -m minisgl.course.make_exercise check 1 --wrong commit-before-launch
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from minisgl.course import EXERCISE_TESTS, PACKAGE, ROOT, WORK
from minisgl.course.catalog import EXERCISES, Wrong
from minisgl.course.markers import Region, marked_files, regions, written_regions
from minisgl.course.region_policy import refusal
from minisgl.frontend.options import OneLineParser

# The known-wrong solutions are course content (lessons/exercises/), loaded by path; the student
# edition ships none, and its learner writes every region in minisgl/ itself.
WRONG_SOLUTIONS = EXERCISE_TESTS.parent / "wrong_solutions.py"
STUDENT_EDITION = not WRONG_SOLUTIONS.exists()


def _known_wrong() -> list[Wrong]:
    if STUDENT_EDITION:
        return []
    spec = importlib.util.spec_from_file_location("minisgl_course_wrong_solutions", WRONG_SOLUTIONS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.WRONG


WRONG = _known_wrong()

HANG_S = 40  # a half-written loop can wait forever: stop it well inside a minute, with the stacks
HANG_ADVICE = (
    "The test above never finished. Find the thread whose stack runs through the test file and read it "
    "from the bottom up: it shows where that thread was when it was stopped. A stack inside "
    "LLM.generate/step means the scheduler kept stepping without progress: some request is waiting for "
    "something (a row, KV slots) that is never given back. A stack in synchronize() means a wait for an "
    "event that never comes.")

PYTEST_INI = """\
[pytest]
markers =
    cuda: needs an NVIDIA GPU (skipped when torch.cuda.is_available() is false)
    full: only in the full tier (make test-all)
addopts = -p no:cacheprovider
"""

# conftest.py at the work dir's root: says which minisgl is under test, refuses another one,
# and arms the hang guard. The guard writes the stacks to a file the checker prints: pytest
# captures the test's own stderr, which would swallow them.
CONFTEST = '''\
"""Written by minisgl/course/make_exercise.py: the tests here must test THIS copy of minisgl."""
import faulthandler
import os
from pathlib import Path

import pytest

import minisgl

HERE = Path(__file__).resolve().parent
UNDER_TEST = Path(minisgl.__file__).resolve()
HANG_S = {hang_s}
HANG_FILE = open(os.environ["MINISGL_HANG_FILE"], "w") if os.environ.get("MINISGL_HANG_FILE") else None


def pytest_runtest_setup(item):
    if HANG_FILE is not None:
        HANG_FILE.write(f"{{item.nodeid}} ran longer than {{HANG_S}} s and was stopped. Every thread's stack:\\n")
        HANG_FILE.flush()
        faulthandler.dump_traceback_later(HANG_S, exit=True, file=HANG_FILE)


def pytest_runtest_teardown(item):
    if HANG_FILE is not None:
        faulthandler.cancel_dump_traceback_later()
        HANG_FILE.seek(0)
        HANG_FILE.truncate()


def pytest_report_header(config):
    return f"minisgl under test: {{UNDER_TEST}}"


def pytest_configure(config):
    if HERE not in UNDER_TEST.parents:
        raise pytest.UsageError(f"minisgl resolves to {{UNDER_TEST}}, not to the copy in {{HERE}}")
'''.format(hang_s=HANG_S)


# --------------------------------------------------------------------------- skeletons

def names_used_below(lines: list[str], region: Region) -> list[str]:
    """The names the region's reference assigns that the rest of its block reads: without them the
    code after the region cannot run, so the skeleton must say that the region defines them."""
    body = textwrap.dedent("".join(lines[region.first + 1:region.last]))
    targets = [node.target if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else t
               for node in ast.walk(ast.parse(body)) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [None])]
    assigned = sorted({name.id for t in targets for name in ast.walk(t)
                       if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store)})
    rest = []
    for line in lines[region.last + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) < len(region.indent):
            break  # the block ends
        rest.append(line.split("#")[0])
    return [name for name in assigned if re.search(rf"\b{name}\b", "".join(rest))]


def skeleton_raise(region: Region, defines: list[str] = ()) -> list[str]:
    """What replaces a region in a skeleton: the part's name and where the hints are, and the names
    the code below needs from it (exercise 5 defines `written` for the release after it), no more."""
    message = f"exercise {region.number}: {region.name} (hints: python -m minisgl course hint {region.number})"
    needs = [f"{region.indent}# define {', '.join(defines)} here: the code after this region uses it\n"] if defines else []
    return [*needs, f"{region.indent}raise NotImplementedError({message!r})\n"]


def indented(code: str, indent: str) -> list[str]:
    """Region code (any indent) as the lines of a region body at `indent`."""
    return textwrap.indent(textwrap.dedent(code).strip("\n") + "\n", indent).splitlines(keepends=True)


def replace_regions(source: str, number: int, wrong: Wrong | None = None,
                    keep_markers: bool = False, stub: bool = False) -> tuple[str, int]:
    """Replace the regions of exercise `number`: by a raise, by the catalog's stub (`stub`: the
    student edition), or by `wrong`'s code for the regions it names (the others keep the
    reference). With keep_markers the marker lines stay around the new body (the student edition:
    the learner writes there, the grader finds it there). Returns (new source, regions replaced)."""
    lines = source.splitlines(keepends=True)
    out, pos, count = [], 0, 0
    for region in regions(lines):
        if region.number != number or (wrong is not None and region.name not in wrong.regions):
            continue
        out += lines[pos:region.first]
        if wrong is not None:
            body = indented(wrong.regions[region.name], region.indent)
        elif stub:
            body = indented(EXERCISES[number].stubs[region.name], region.indent)
        else:
            body = skeleton_raise(region, names_used_below(lines, region))
        out += [lines[region.first], *body, lines[region.last]] if keep_markers else body
        pos, count = region.last + 1, count + 1
    out += lines[pos:]
    return "".join(out), count


def region_names(number: int) -> set[str]:
    return {r.name for path in PACKAGE.rglob("*.py") for r in regions(path.read_text().splitlines())
            if r.number == number}


def generate(number: int | None, dest: Path, force: bool = False, wrong: Wrong | None = None) -> bool:
    """Write the package to dest/minisgl with exercise `number` removed (None: the reference; with
    `wrong`: the reference with that wrong solution put in). Returns False, changing nothing, if
    dest/minisgl exists and not force."""
    target = dest / "minisgl"
    if target.exists() and not force:
        return False
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if number is not None:
        if wrong is not None and not set(wrong.regions) <= region_names(number):
            raise SystemExit(f"wrong solution {wrong.name!r} names regions {sorted(wrong.regions)}; exercise "
                             f"{number} has {sorted(region_names(number))}")
        replaced = 0
        for rel, numbers in marked_files(target).items():
            if number in numbers:
                path = target / rel
                source, count = replace_regions(path.read_text(), number, wrong)
                ast.parse(source, str(path))  # the result must stay valid Python
                path.write_text(source)
                replaced += count
        if replaced == 0:
            raise SystemExit(f"exercise {number} has no marked region in {PACKAGE}")
    refresh_tests(dest)
    return True


def refresh_tests(dest: Path) -> None:
    """tests/ = the repository's tests plus the exercise tests, copied fresh (learners edit minisgl/ only)."""
    tests = dest / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(ROOT / "tests", tests, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in sorted(EXERCISE_TESTS.glob("*.py")):
        shutil.copy(path, tests / path.name)
    (dest / "pytest.ini").write_text(PYTEST_INI)
    (dest / "conftest.py").write_text(CONFTEST)


# --------------------------------------------------------------------------- running the tests

def env_for(dest: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = str(dest) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def which_minisgl(dest: Path) -> str:
    """Import minisgl the way the tests will, in a fresh interpreter, and say where it came from."""
    code = "import minisgl, minisgl.scheduler, minisgl.future_map; print(minisgl.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=dest, env=env_for(dest), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"minisgl in {dest} does not import:\n{done.stderr}")
    return done.stdout.strip()


def run_tests(tests: list[str], dest: Path, extra: list[str], learner: bool = True) -> int:
    """Run `tests` in dest. For a learner's copy, first say which minisgl the tests will import
    (the conftest refuses any other copy in every case)."""
    refresh_tests(dest)
    if learner:
        where = which_minisgl(dest)
        print(f"minisgl under test: {where}", flush=True)
        if not Path(where).resolve().is_relative_to(dest.resolve()):
            raise SystemExit(f"expected the copy in {dest}, got {where}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", *extra, *tests]
    print("$ cd", dest, "&& PYTHONPATH=" + str(dest), "python", " ".join(cmd[1:]), flush=True)
    with tempfile.TemporaryDirectory(prefix="minisgl-hang-") as tmp:
        hang_file = Path(tmp) / "stacks.txt"
        code = subprocess.run(cmd, cwd=dest, env=env_for(dest, MINISGL_HANG_FILE=str(hang_file))).returncode
        stacks = hang_file.read_text() if hang_file.exists() else ""
    if stacks.strip():
        print(f"\nHANG: {stacks}", flush=True)
        print(HANG_ADVICE, flush=True)
        return 1
    return code


REFUSED_ADVICE = (
    "The grader refuses this code the same way: it is not run and earns no marks. Code between the markers "
    "works on the engine's own objects (lessons/exercises/README.md, What to hand in).")


def refused(numbers: list[int]) -> list[str]:
    """For each of these exercises whose code in minisgl/ the grader would not run, the line the
    grader records (region_policy.refusal)."""
    written = written_regions(ROOT)
    return [f"exercise {n}: {line}" for n in numbers if (line := refusal(written.get(n, {})))]


def print_hint(number: int, level: int) -> None:
    exercise = EXERCISES[number]
    print(f"exercise {number}: {exercise.title} — hint {level} of 3")
    print(textwrap.fill(exercise.hints[level - 1], width=100))
    if level < 3:
        print(f"(more: python -m minisgl course hint {number} --level {level + 1})")


def print_wrong(number: int | None) -> None:
    for w in WRONG:
        if number is None or w.exercise == number:
            print(f"exercise {w.exercise}  {w.name:32} {w.story}")
            print(f"{'':44}first failure says: {w.expect!r}")


def find_wrong(number: int, name: str) -> Wrong:
    for w in WRONG:
        if w.exercise == number and w.name == name:
            return w
    raise SystemExit(f"no wrong solution {name!r} for exercise {number}: "
                     f"{[w.name for w in WRONG if w.exercise == number]}")


def exercise_number(text: str) -> int:
    """An exercise's number (an argparse type: anything else is one `error:` line, exit 2)."""
    if not text.isdigit() or int(text) not in EXERCISES:
        raise argparse.ArgumentTypeError(f"no exercise {text!r}; there are {sorted(EXERCISES)}")
    return int(text)


def exercise_or_all(text: str) -> int | str:
    return text if text == "all" else exercise_number(text)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one line per exercise")
    h = sub.add_parser("hint", help="a hint: level 1 (question), 2 (idea), 3 (near code)")
    h.add_argument("number", type=exercise_number)
    h.add_argument("--level", type=int, default=1, choices=(1, 2, 3))
    g = sub.add_parser("generate", help="write the learner's copy (never overwrites one without --force)")
    g.add_argument("number", type=exercise_number)
    g.add_argument("--force", action="store_true", help="replace an existing copy: your work there is lost")
    g.add_argument("--dest", type=Path, default=None, help="default lessons/exercises/work/exN")
    w = sub.add_parser("wrong", help="list the known-wrong solutions and what the tests say to each")
    w.add_argument("number", type=exercise_number, nargs="?")
    c = sub.add_parser("check", help="run the exercise's tests against the learner's copy (made if missing)")
    c.add_argument("number", type=exercise_or_all,
                   help="an exercise number, or 'all' with --reference (every selection, one run)")
    c.add_argument("--dest", type=Path, default=None)
    c.add_argument("--reference", action="store_true", help="run the same tests against the reference code")
    c.add_argument("--wrong", metavar="NAME", help="run them against the reference with a known-wrong solution")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # after --: extra pytest arguments (-x, -k ...)
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    if args.command == "list":
        for e in EXERCISES.values():
            print(f"exercise-{e.number}  {e.title}  [lesson {e.lesson}]")
        return 0
    if STUDENT_EDITION and (args.command == "wrong" or getattr(args, "reference", False) or getattr(args, "wrong", None)):
        raise SystemExit("the reference and the known-wrong solutions are the teacher's: not part of the student "
                         "edition (check N tests your own minisgl/)")
    if args.command == "wrong":
        print_wrong(args.number)
        return 0
    if args.command == "check" and args.number == "all":
        if not (args.reference or STUDENT_EDITION):
            ap.error("'check all' runs the reference only: add --reference")
        tests = list(dict.fromkeys(t for e in EXERCISES.values() for t in e.tests))
    else:
        tests = list(EXERCISES[args.number].tests)
    if args.command == "hint":
        print_hint(args.number, args.level)
        return 0
    if STUDENT_EDITION and args.command == "generate":
        raise SystemExit("in the student edition you write each part in minisgl/ itself, between its markers: "
                         f"run 'check {args.number}' to test it")
    if args.command == "generate":
        dest = args.dest or WORK / f"ex{args.number}"
        made = generate(args.number, dest, args.force)
        print(f"{'wrote' if made else 'kept your existing copy'}: {dest / 'minisgl'}"
              + ("" if made else "  (use --force to start over)"))
        return 0
    if STUDENT_EDITION:  # the grader's rules on the code first: what it would not run is not run here either
        lines = refused(sorted(EXERCISES) if args.number == "all" else [args.number])
        if lines:
            print("\n".join(lines) + "\n" + REFUSED_ADVICE)
            return 1
    if args.reference or args.wrong or STUDENT_EDITION:  # the student edition: test minisgl/ as it is
        wrong = find_wrong(args.number, args.wrong) if args.wrong else None
        prefix = "minisgl-your-code-" if STUDENT_EDITION else "minisgl-reference-"
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            dest = args.dest or Path(tmp)
            generate(args.number if wrong else None, dest, force=True, wrong=wrong)
            return run_tests(tests, dest, extra, learner=False)
    dest = args.dest or WORK / f"ex{args.number}"
    if generate(args.number, dest):
        print(f"wrote the skeleton: {dest / 'minisgl'} (edit the regions that raise NotImplementedError)")
    return run_tests(tests, dest, extra)


if __name__ == "__main__":
    sys.exit(main())
