"""A synthetic class for timing the grader: N submissions made from the student edition.

    python benchmarks/grading_class.py DIR [--students 40] [--distinct 4]
    time python -m minisgl course grade DIR --out RESULTS --exercises 1 2 3 4 5 6 7 8

The mix, in this order until N submissions are written:
- `reference` (a folder) and `reference-patch` (the same as a patch): full marks;
- `empty`: the student edition untouched: zero;
- `outside` (a folder) and `outside-patch`: the reference with one line added outside the regions,
  in the function that holds exercises 4's and 5's regions: those two flagged;
- `distinct-K` (--distinct of them): the reference with a harmless line of its own at the top of
  every region, so that no check is shared with another submission: what a class of students who
  all write their own correct code costs;
- `mixed-K`: for each exercise, one of its known-wrong solutions (wrong_solutions.py) or the
  reference, in turn, so that each submission has some exercises right and some wrong, and each
  known-wrong solution is handed in by a few students.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from minisgl.course import ROOT
from minisgl.course.judge_copy import put_regions
from minisgl.course.markers import written_regions
from minisgl.course.student_edition import write_student_edition
from minisgl.course.make_exercise import WRONG

OUTSIDE_LINE = "        req.released = True\n"  # a line of KVLedger.release (kv_ledger.py), outside its regions


def as_patch(base: Path, tree: Path, patch: Path) -> None:
    """Write tree's changes against the student edition `base` as `git diff` would in the student's tree."""
    shutil.copytree(base / ".git", tree / ".git")
    patch.write_text(subprocess.run(["git", "diff"], cwd=tree, capture_output=True, text=True, check=True).stdout)
    shutil.rmtree(tree)


def with_line(code: dict[int, dict[str, str]], line: str) -> dict[int, dict[str, str]]:
    """Every region's code with `line` put first (a line that changes nothing the tests see)."""
    return {n: {name: line + "\n" + textwrap.dedent(body) for name, body in bodies.items()}
            for n, bodies in code.items()}


def write_class(dest: Path, students: int, distinct: int) -> list[str]:
    dest.mkdir(parents=True)
    base = write_student_edition(dest.parent / f"{dest.name}-edition")
    reference = written_regions(ROOT)
    made: list[str] = []

    def add(name: str, code: dict[int, dict[str, str]], *, patch: bool = False, outside: bool = False) -> None:
        if len(made) >= students:
            return
        tree = put_regions(base, code, dest / name if not patch else dest.parent / f"{dest.name}-{name}")
        if outside:
            # the one file that holds the line, wherever a refactoring moved it (not found: fail here,
            # not with a class whose "outside" submissions quietly edit nothing)
            (holder,) = [f for f in (tree / "minisgl").rglob("*.py") if OUTSIDE_LINE in f.read_text()]
            holder.write_text(holder.read_text().replace(OUTSIDE_LINE, OUTSIDE_LINE + "        req.cached_len = 0\n", 1))
        if patch:
            as_patch(base, tree, dest / f"{name}.patch")
        made.append(name)

    add("reference", reference)
    add("reference-patch", reference, patch=True)
    made.append("empty")
    shutil.copytree(base, dest / "empty", ignore=shutil.ignore_patterns(".git"))
    add("outside", reference, outside=True)
    add("outside-patch", reference, outside=True, patch=True)
    for k in range(distinct):
        add(f"distinct-{k}", with_line(reference, f"_submission = {k}"))
    wrong_by_exercise = {n: [w for w in WRONG if w.exercise == n] for n in reference}
    k = 0
    while len(made) < students:
        code = {}
        for n, bodies in reference.items():
            choices = wrong_by_exercise[n]
            pick = (k + n) % (len(choices) + 1)  # len(choices): the reference
            code[n] = {**bodies, **choices[pick].regions} if pick < len(choices) else bodies
        add(f"mixed-{k}", code)
        k += 1
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("dest", type=Path, help="a new folder for the submissions")
    ap.add_argument("--students", type=int, default=40)
    ap.add_argument("--distinct", type=int, default=4)
    args = ap.parse_args(argv)
    made = write_class(args.dest.resolve(), args.students, args.distinct)
    print(f"wrote {len(made)} submissions to {args.dest}: {', '.join(made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
