"""`python -m minisgl course ...`: the course's commands without `make` (Windows has none).

Each one runs a lesson script of `lessons/` or a module of `minisgl.course` with this interpreter, so the
course needs the repository checkout (the editable install that `install.py` makes), not just
the installed package:

    python -m minisgl course lessons                  # one line per lesson
    python -m minisgl course lesson 3 [--quick]       # run lesson 3 (extra arguments go to it)
    python -m minisgl course exercises                # one line per exercise
    python -m minisgl course exercise 1 [-- -x]       # check your exercise 1 (make exercise-1)
    python -m minisgl course hint 1 --level 2         # a hint (make hint-1 LEVEL=2)
    python -m minisgl course student-edition DIR      # write the student repository (teachers)
    python -m minisgl course grade DIR --out OUT      # grade a folder of submissions (teachers)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from minisgl.course import LESSONS, PACKAGE, ROOT

# command -> (module of minisgl.course, the arguments put before the caller's)
MODULES = {
    "exercises": ("make_exercise", ["list"]),
    "exercise": ("make_exercise", ["check"]),
    "hint": ("make_exercise", ["hint"]),
    "student-edition": ("student_edition", []),
    "grade": ("grade", []),
}


def lesson_scripts() -> dict[int, Path]:
    """Lesson number -> its script, from the file names lesson_N_*.py."""
    return {int(p.name.split("_")[1]): p for p in LESSONS.glob("lesson_*_*.py")}


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if not LESSONS.is_dir():
        print(f"error: the course needs the repository checkout ({LESSONS} is missing)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "lessons":
        for number, path in sorted(lesson_scripts().items()):
            print(path.read_text().splitlines()[0].removeprefix('"""'))
        return 0
    if command == "lesson":
        lessons = lesson_scripts()
        if not rest or not rest[0].isdigit() or int(rest[0]) not in lessons:
            print(f"error: course lesson takes a lesson number, one of {sorted(lessons)}", file=sys.stderr)
            return 2
        script, rest = lessons[int(rest[0])], rest[1:]
        command_line = [str(script), *rest]
    elif command in MODULES:
        module, first = MODULES[command]
        if not (PACKAGE / "course" / f"{module}.py").exists():  # teacher's tools: not in the student edition
            print(f"error: course {command} is a teacher's tool, not part of the student edition", file=sys.stderr)
            return 2
        command_line = ["-m", f"minisgl.course.{module}", *first, *rest]
    else:
        print(f"error: unknown course command {command!r}; python -m minisgl course --help lists them",
              file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return run_to_its_end([sys.executable, *command_line], env)


def run_to_its_end(command: list[str], env: dict[str, str]) -> int:
    """Run the command in the checkout and return its exit code, leaving its end to it: Ctrl-C
    reaches it from the terminal (this process waits, where subprocess.call would kill it 0.25 s
    later, mid-clean-up), and a SIGTERM or SIGHUP sent to this process is passed on (an orphaned
    grader went on, and recorded marks after its run was stopped)."""
    child = subprocess.Popen(command, cwd=ROOT, env=env)
    relayed = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    before = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    before.update({s: signal.signal(s, lambda signum, _: child.send_signal(signum)) for s in relayed})
    try:
        return child.wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
