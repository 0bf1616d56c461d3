"""Exercises: the minisgl package with one part removed, for a learner to write back.

The reference code carries comment-only markers around each part (so it runs unchanged):

    # >>> exercise N: what to write, in one or more lines
    # >>> (continuation of the hint)
    ...the code the learner writes...
    # <<< exercise N

`generate N` copies the whole package to `lessons/exercises/work/exN/minisgl/` and replaces
every marked region of exercise N by `raise NotImplementedError("exercise N: <hint>")`, at the
region's indentation. Nothing is committed: a skeleton is always made from today's code, so it
cannot drift from the reference. A learner's existing copy is never overwritten without --force.

`check N` makes the copy if it is missing, refreshes its tests (the repository's tests/ plus
lessons/exercises/tests/), prints which minisgl Python imports there, and runs exercise N's
test selection against the learner's copy: the same tests the reference passes.

    python lessons/exercises/make_exercise.py list
    python lessons/exercises/make_exercise.py generate 1 [--force] [--dest DIR]
    python lessons/exercises/make_exercise.py check 1 [--dest DIR] [-- extra pytest args]
    python lessons/exercises/make_exercise.py check 1 --reference   # the same tests, reference code
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PACKAGE = ROOT / "minisgl"
WORK = HERE / "work"
START = re.compile(r"^(?P<indent>[ \t]*)# >>> exercise (?P<n>\d+): (?P<hint>.*)$")
MORE = re.compile(r"^[ \t]*# >>> (?!exercise \d+:)(?P<hint>.*)$")
END = re.compile(r"^[ \t]*# <<< exercise (?P<n>\d+)\s*$")


@dataclass(frozen=True)
class Exercise:
    number: int
    title: str
    lesson: int
    tests: tuple[str, ...]  # pytest node ids inside the work dir (its tests/ is refreshed at every check)


EXERCISES = {e.number: e for e in (
    Exercise(1, "write overlap_loop from normal_loop (scheduler.py)", 3, (
        "tests/test_overlap.py::test_overlap_pipelines_launches_ahead_of_commits",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-0]",
        "tests/test_mechanisms.py::test_future_map_off_brings_the_bubble_back",
        "tests/test_mechanisms.py::test_prefill_sync_commits_consecutive_prefills",
    )),
    Exercise(2, "FutureMap publish and resolve (future_map.py)", 4, (
        "tests/test_ex2_future_map.py",
        "tests/test_overlap.py::test_overlap_equals_normal[0.0-0]",
    )),
    Exercise(3, "snapshot the running batch for the result queue (batch.py)", 5, (
        "tests/test_ex3_snapshot.py",
        "tests/test_mechanisms.py::test_batch_snapshot_off_results_land_on_wrong_requests",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-1]",
    )),
    Exercise(4, "overshoot: skip late results, look ahead by length, release by allocated length "
                "(scheduler.py)", 6, (
        "tests/test_mechanisms.py::test_length_lookahead_off_wastes_overshoot_steps",
        "tests/test_mechanisms.py::test_skip_finished_off_leaks_token_after_stop_and_double_frees",
        "tests/test_mechanisms.py::test_release_allocated_off_leaks_kv_slots",
        "tests/test_abort.py::test_abort_while_final_token_in_flight",
    )),
    Exercise(5, "the radix-cache checkpoint at the safe point: the commit (scheduler.py)", 7, (
        "tests/test_ex5_checkpoint.py",
        "tests/test_engine.py::test_radix_cache_hits_give_same_tokens[overlap]",
        "tests/test_engine.py::test_prompt_sharing_prefix_reads_cached_kv",
        "tests/test_abort.py::test_abort_while_decoding[overlap]",
    )),
    Exercise(6, "reuse a request row only after its last in-flight batch (scheduler.py)", 7, (
        "tests/test_ex6_rows.py",
        "tests/test_abort.py::test_abort_while_final_token_in_flight",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-1]",
    )),
)}

PYTEST_INI = """\
[pytest]
markers =
    cuda: needs an NVIDIA GPU (skipped when torch.cuda.is_available() is false)
    slow: takes more than a few seconds
addopts = -p no:cacheprovider
"""

# conftest.py at the work dir's root: says which minisgl is under test, and refuses another one.
CONFTEST = '''\
"""Written by lessons/exercises/make_exercise.py: the tests here must test THIS copy of minisgl."""
import faulthandler
from pathlib import Path

import pytest

import minisgl

HERE = Path(__file__).resolve().parent
UNDER_TEST = Path(minisgl.__file__).resolve()
HANG_S = 120  # a half-written scheduler can wait forever: stop the run, with every thread's stack


def pytest_runtest_setup(item):
    faulthandler.dump_traceback_later(HANG_S, exit=True)


def pytest_runtest_teardown(item):
    faulthandler.cancel_dump_traceback_later()


def pytest_report_header(config):
    return f"minisgl under test: {UNDER_TEST}"


def pytest_configure(config):
    if HERE not in UNDER_TEST.parents:
        raise pytest.UsageError(f"minisgl resolves to {UNDER_TEST}, not to the copy in {HERE}")
'''


# --------------------------------------------------------------------------- skeletons

def regions(lines: list[str]) -> list[tuple[int, int, int, str, list[str]]]:
    """Every marked region as (exercise, first line, last line, indent, hint lines); 0-based, inclusive."""
    found, i = [], 0
    while i < len(lines):
        m = START.match(lines[i])
        if not m:
            if END.match(lines[i]):
                raise ValueError(f"line {i + 1}: '# <<< exercise' without a start marker")
            i += 1
            continue
        n, hint, j = int(m["n"]), [m["hint"].strip()], i + 1
        while j < len(lines) and MORE.match(lines[j]):
            hint.append(MORE.match(lines[j])["hint"].strip())
            j += 1
        while j < len(lines) and not END.match(lines[j]):
            if START.match(lines[j]):
                raise ValueError(f"line {j + 1}: exercise regions cannot nest")
            j += 1
        if j == len(lines) or int(END.match(lines[j])["n"]) != n:
            raise ValueError(f"line {i + 1}: exercise {n} region is not closed by '# <<< exercise {n}'")
        found.append((n, i, j, m["indent"], hint))
        i = j + 1
    return found


def strip_exercise(source: str, number: int) -> tuple[str, int]:
    """Replace each region of exercise `number` by a raise; returns (new source, regions replaced)."""
    lines = source.splitlines(keepends=True)
    out, pos, count = [], 0, 0
    for n, first, last, indent, hint in regions(lines):
        if n != number:
            continue
        out += lines[pos:first]
        out += raise_statement(indent, [f"exercise {n}: {hint[0]}", *hint[1:]])
        pos, count = last + 1, count + 1
    out += lines[pos:]
    return "".join(out), count


def raise_statement(indent: str, hint: list[str]) -> list[str]:
    """`raise NotImplementedError("exercise N: ...")`, the hint's lines as adjacent string literals."""
    parts = [json.dumps(line + (" " if i < len(hint) - 1 else ""), ensure_ascii=False) for i, line in enumerate(hint)]
    if len(parts) == 1:
        return [f"{indent}raise NotImplementedError({parts[0]})\n"]
    body = [f"{indent}    {p}\n" for p in parts]
    body[-1] = body[-1].rstrip("\n") + ")\n"
    return [f"{indent}raise NotImplementedError(\n", *body]


def marked_files(package: Path = PACKAGE) -> dict[Path, list[int]]:
    """Package file -> exercise numbers it has regions of."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        numbers = sorted({r[0] for r in regions(path.read_text().splitlines())})
        if numbers:
            found[path.relative_to(package)] = numbers
    return found


def generate(number: int | None, dest: Path, force: bool = False) -> bool:
    """Write the package to dest/minisgl, with exercise `number` removed (None: the reference).
    Returns False (and changes nothing) if dest/minisgl exists and not force."""
    target = dest / "minisgl"
    if target.exists() and not force:
        return False
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if number is not None:
        replaced = 0
        for rel, numbers in marked_files(target).items():
            if number in numbers:
                path = target / rel
                source, count = strip_exercise(path.read_text(), number)
                ast.parse(source, str(path))  # the skeleton must stay valid Python
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
    for path in sorted((HERE / "tests").glob("test_*.py")):
        shutil.copy(path, tests / path.name)
    (dest / "pytest.ini").write_text(PYTEST_INI)
    (dest / "conftest.py").write_text(CONFTEST)


# --------------------------------------------------------------------------- running the tests

def env_for(dest: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(dest) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def which_minisgl(dest: Path) -> str:
    """Import minisgl the way the tests will, in a fresh interpreter, and say where it came from."""
    code = "import minisgl, minisgl.scheduler, minisgl.future_map; print(minisgl.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=dest, env=env_for(dest), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"minisgl in {dest} does not import:\n{done.stderr}")
    return done.stdout.strip()


def run_tests(tests: list[str], dest: Path, extra: list[str]) -> int:
    refresh_tests(dest)
    where = which_minisgl(dest)
    print(f"minisgl under test: {where}", flush=True)
    if not Path(where).resolve().is_relative_to(dest.resolve()):
        raise SystemExit(f"expected the copy in {dest}, got {where}")
    cmd = [sys.executable, "-m", "pytest", "-q", *extra, *tests]
    print("$ cd", dest, "&& PYTHONPATH=" + str(dest), "python", " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, cwd=dest, env=env_for(dest)).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one line per exercise")
    g = sub.add_parser("generate", help="write the learner's copy (never overwrites one without --force)")
    g.add_argument("number", type=int)
    g.add_argument("--force", action="store_true", help="replace an existing copy: your work there is lost")
    g.add_argument("--dest", type=Path, default=None, help="default lessons/exercises/work/exN")
    c = sub.add_parser("check", help="run the exercise's tests against the learner's copy (made if missing)")
    c.add_argument("number", help="an exercise number, or 'all' with --reference (every selection, one run)")
    c.add_argument("--dest", type=Path, default=None)
    c.add_argument("--reference", action="store_true", help="run the same tests against the reference code")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # after --: extra pytest arguments (-x, -k ...)
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.pytest_args = extra

    if args.command == "list":
        for e in EXERCISES.values():
            print(f"exercise-{e.number}  {e.title}  [lesson {e.lesson}]")
        return 0
    if args.command == "check" and args.number == "all":
        if not args.reference:
            raise SystemExit("'check all' runs the reference only: add --reference")
        tests = list(dict.fromkeys(t for e in EXERCISES.values() for t in e.tests))
    else:
        args.number = int(args.number) if str(args.number).isdigit() else -1
        if args.number not in EXERCISES:
            raise SystemExit(f"no exercise {args.number}; there are {sorted(EXERCISES)}")
        tests = list(EXERCISES[args.number].tests)
    if args.command == "generate":
        dest = args.dest or WORK / f"ex{args.number}"
        made = generate(args.number, dest, args.force)
        print(f"{'wrote' if made else 'kept your existing copy'}: {dest / 'minisgl'}"
              + ("" if made else "  (use --force to start over)"))
        return 0
    if args.reference:
        with tempfile.TemporaryDirectory(prefix="minisgl-reference-") as tmp:
            generate(None, Path(tmp))
            return run_tests(tests, Path(tmp), args.pytest_args)
    dest = args.dest or WORK / f"ex{args.number}"
    if generate(args.number, dest):
        print(f"wrote the skeleton: {dest / 'minisgl'} (edit the regions that raise NotImplementedError)")
    return run_tests(tests, dest, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
