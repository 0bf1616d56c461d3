"""Exercises (lessons/exercises/): skeletons are generated from the marked reference code, so they
are up to date by construction. Here: every marker is well formed and comment-only, each
skeleton has every region replaced, still imports and fails its tests cleanly on
NotImplementedError naming the part only; hints exist in three levels; the reference passes
every selection; and every known-wrong solution is caught, with a first failure that names the
rule it breaks (or, for a solution that waits forever, a report with every thread's stack).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import tiered

ROOT = Path(__file__).resolve().parents[1]
WRONG_LIMIT_S = 60  # a wrong solution must be reported within a minute, a hang included


from minisgl.course import make_exercise as tool
from minisgl.course import markers as marker
from minisgl.course import runner


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minisgl.course.make_exercise", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def first_failure(output: str) -> str:
    """The `E ...` lines of the first failure in pytest's output, or the hang report."""
    if "\nHANG: " in output:
        return output[output.index("\nHANG: "):]
    block = output[output.index("= FAILURES ="):] if "= FAILURES =" in output else output
    lines = block.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("E ")), None)
    if start is None:
        return ""
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("E ")), len(lines))
    return " ".join(line[1:].strip() for line in lines[start:end])


def test_markers_are_well_formed_and_cover_every_exercise():
    files = tool.marked_files()
    numbers = {n for ns in files.values() for n in ns}
    assert numbers == set(tool.EXERCISES), (numbers, sorted(tool.EXERCISES))
    # the files the lessons may mark: the core the lessons read
    assert set(map(str, files)) <= {"scheduler.py", "kv_ledger.py", "rows.py", "batch.py", "future_map.py",
                                    "staging.py", "engine.py", "features/grammar.py", "features/mixed_chunk.py",
                                    "features/speculative/__init__.py", "features/speculative/relay.py",
                                    "features/speculative/verify.py"}


def test_each_title_names_the_files_that_hold_its_regions():
    """`make exercises` tells a learner where to look: "(rows.py, 2 places)" must be where the regions are."""
    holders = {n: set() for n in tool.EXERCISES}
    for rel, numbers in tool.marked_files().items():
        for n in numbers:
            holders[n].add(rel.name)
    for n, exercise in tool.EXERCISES.items():
        named = set(re.findall(r"\b(\w+\.py)\b", exercise.title.rpartition("(")[2]))
        assert named == holders[n], (n, exercise.title, sorted(holders[n]))


def test_markers_are_comments_only():
    """Dropping every marker line leaves the same program: the reference is unchanged by them."""
    for rel in tool.marked_files():
        source = (tool.PACKAGE / rel).read_text()
        lines = source.splitlines(keepends=True)
        markers = [line for line in lines if marker.START.match(line) or marker.END.match(line)]
        assert all(line.lstrip().startswith("#") for line in markers)
        bare = "".join(line for line in lines if line not in markers)
        assert ast.dump(ast.parse(source)) == ast.dump(ast.parse(bare))


def test_region_parser_rejects_broken_markers():
    with pytest.raises(ValueError, match="not closed"):
        tool.regions(["# >>> exercise 1: x", "pass"])
    with pytest.raises(ValueError, match="without a start"):
        tool.regions(["pass", "# <<< exercise 1"])
    with pytest.raises(ValueError, match="nest"):
        tool.regions(["# >>> exercise 1: x", "# >>> exercise 2: y", "# <<< exercise 2", "# <<< exercise 1"])


def test_every_exercise_has_three_hint_levels_that_grow_towards_the_code(capsys):
    for number, exercise in tool.EXERCISES.items():
        assert len(exercise.hints) == 3 and all(h.strip() for h in exercise.hints), number
        assert "§" in exercise.hints[0], f"exercise {number}: level 1 points at the reading guide"
        assert exercise.tests[0].startswith(f"tests/test_ex{number}_"), "the teaching tests run first"
        for level in (1, 2, 3):
            assert tool.main(["hint", str(number), "--level", str(level)]) == 0  # make hint-N LEVEL=K
            assert f"hint {level} of 3" in capsys.readouterr().out


def test_generate_never_overwrites_a_learners_copy(tmp_path):
    assert cli("generate", "2", "--dest", str(tmp_path)).returncode == 0
    mine = tmp_path / "minisgl" / "future_map.py"
    mine.write_text(mine.read_text() + "# my work\n")
    kept = cli("generate", "2", "--dest", str(tmp_path))
    assert kept.returncode == 0 and "kept your existing copy" in kept.stdout
    assert mine.read_text().endswith("# my work\n")
    assert cli("generate", "2", "--dest", str(tmp_path), "--force").returncode == 0
    assert "# my work" not in mine.read_text()


@pytest.mark.parametrize("number", tiered([(n,) for n in sorted(tool.EXERCISES)], [(2,)]))
def test_skeleton_fails_cleanly_with_not_implemented(tmp_path, number):
    tool.generate(number, tmp_path)
    names = tool.region_names(number)
    for rel in tool.marked_files():
        skeleton = (tmp_path / "minisgl" / rel).read_text()
        ast.parse(skeleton)
        left = [r for r in tool.regions(skeleton.splitlines()) if r.number == number]
        assert not left, f"{rel}: exercise {number} regions left in the skeleton"
        expected = sum(r.number == number for r in tool.regions((tool.PACKAGE / rel).read_text().splitlines()))
        raises = re.findall(rf"NotImplementedError\((['\"])exercise {number}: (.+?) \(hints: python -m minisgl course hint {number}\)\1\)",
                            skeleton)  # repr() quotes a name holding an apostrophe with double quotes
        assert len(raises) == expected and {name for _, name in raises} <= names  # one raise per region, naming the part only
    report = runner.run_checks(tmp_path, number, stop_at_first_failure=True)
    assert report.minisgl == (tmp_path / "minisgl").resolve()  # the copy, not the reference, was imported
    assert report.exit_code == 1, report  # 1: tests failed; 2+: collection or usage error
    # the raise may surface as the cause of a DeviceError, or in a thread the test started (a warning)
    said = report.first_failure.details + "\n".join(report.warnings)
    assert "NotImplementedError" in said and f"exercise {number}:" in said, said[-3000:]


@pytest.mark.full  # a learner-side subprocess run, 10-16 s: the fast tier keeps the in-process checks
def test_check_runs_the_learners_copy_in_its_own_pytest(tmp_path):
    """make exercise-N: makes the skeleton, says which minisgl the tests import, fails on the raise."""
    done = cli("check", "2", "--dest", str(tmp_path), "--", "-x")
    out = done.stdout + done.stderr
    assert f"minisgl under test: {tmp_path.resolve()}" in out  # the copy, not the reference, was imported
    assert done.returncode == 1, out[-3000:]  # 1: tests failed; 2+: collection or usage error
    assert "NotImplementedError" in out and "exercise 2:" in out


@pytest.mark.full
def test_reference_passes_every_selection():
    done = cli("check", "all", "--reference")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_every_exercise_keeps_at_least_four_wrong_solutions():
    counts = {n: sum(w.exercise == n for w in tool.WRONG) for n in tool.EXERCISES}
    assert all(c >= 4 for c in counts.values()), counts
    assert len({(w.exercise, w.name) for w in tool.WRONG}) == len(tool.WRONG)
    assert {(w.exercise, w.name) for w in tool.WRONG} >= set(FAST_WRONG.items())  # the fast tier's sample exists
    assert set(FAST_WRONG) == set(tool.EXERCISES)


# The fast tier puts in one known-wrong solution per exercise (the quickest to be caught, measured);
# the full tier all of them.
FAST_WRONG = {1: "live-view-like-normal-loop", 2: "key-by-position", 3: "copied-requests", 4: "no-lookahead",
              5: "not-reported", 6: "one-batch-too-early", 7: "inverted-query", 8: "reversed-stream-wait",
              9: "no-skip", 10: "grammar-rows-only", 11: "counts-every-agreement", 12: "serial-formula"}


@pytest.mark.parametrize("wrong", tiered([(w,) for w in tool.WRONG],
                                         [(w,) for w in tool.WRONG if FAST_WRONG[w.exercise] == w.name],
                                         id=lambda case: f"ex{case[0].exercise}-{case[0].name}"))
def test_known_wrong_solution_is_caught_with_a_message_that_names_the_rule(tmp_path, wrong):
    """Put the wrong solution into a copy of the reference and run the exercise's teaching tests
    (the first file of its selection) until the first failure, in this process (runner.py)."""
    teaching = tool.EXERCISES[wrong.exercise].tests[0]
    tool.generate(wrong.exercise, tmp_path, force=True, wrong=wrong)
    started = time.monotonic()
    report = runner.run_checks(tmp_path, wrong.exercise, tests=[teaching], stop_at_first_failure=True)
    assert time.monotonic() - started < WRONG_LIMIT_S
    assert report.minisgl == (tmp_path / "minisgl").resolve()  # the copy, not the reference, was tested
    assert report.exit_code == 1 and report.first_failure is not None, report
    said = report.first_failure.message
    assert wrong.expect in said, f"expected the first failure to say {wrong.expect!r}; it said: {said[:1500]}"
    if "HANG" in said:
        assert "most recent call first" in said  # every thread's stack, in the message


def test_runner_puts_the_callers_minisgl_back_and_reports_each_test(tmp_path):
    import minisgl
    import minisgl.future_map

    before = (sys.modules["minisgl"], sys.modules["minisgl.future_map"])
    tool.generate(None, tmp_path, force=True)  # the reference: every test passes
    report = runner.run_checks(tmp_path, 2, tests=[tool.EXERCISES[2].tests[0]])
    assert report.passed and report.first_failure is None, report
    teaching = {o.nodeid for o in report.outcomes}
    assert len(teaching) >= 3 and all(n.startswith(tool.EXERCISES[2].tests[0] + "::") for n in teaching)
    assert (sys.modules["minisgl"], sys.modules["minisgl.future_map"]) == before
    assert minisgl.__file__ == str(tool.PACKAGE / "__init__.py")


@pytest.mark.full  # a fresh pytest process; the fast tier runs the learner's `check` once (above)
def test_cli_shows_a_wrong_solution_the_same_first_failure(tmp_path):
    """make exercise-wrong-N NAME=... runs pytest in a subprocess: the learner's view of a mistake."""
    wrong = tool.WRONG[0]
    teaching = tool.EXERCISES[wrong.exercise].tests[0]
    done = cli("check", str(wrong.exercise), "--wrong", wrong.name, "--dest", str(tmp_path), "--", "-x",
               "-k", Path(teaching).stem, timeout=WRONG_LIMIT_S + 60)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert wrong.expect in first_failure(out), first_failure(out)[:1500]


def test_teachers_guide_lists_every_wrong_solution_and_what_it_is_told():
    guide = (ROOT / "lessons" / "TEACHER.md").read_text()
    missing = [w.name for w in tool.WRONG if f"| {w.exercise} | `{w.name}` |" not in guide or w.expect not in guide]
    assert not missing, f"lessons/TEACHER.md does not list these known-wrong solutions: {missing}"
