"""Check the figures the teacher's guide quotes: run the lessons, compare, print PASS or FAIL.

    python -m minisgl.course.check_figures [--lessons 1 3] [--busy 2]

The figures and their tolerances are the table *Figures to check* in lessons/TEACHER.md (one
row per `» name = value` line a lesson prints: an exact count `7`, a range `0.76–0.95` or a
bound `≥ 1`), plus each lesson's run time against the range its text's "Run:" line gives. Each
lesson runs as the guide measured it: `LESSON_WIDTH=80 python lessons/lesson_N_*.py` (full size,
not --quick). `--busy N` starts N busy-loop processes for the whole check (the guide's
"loaded" condition is 2 on a 2-core laptop). Exit code 1 when a figure fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from minisgl.course import LESSONS

GUIDE = LESSONS / "TEACHER.md"
TABLE_TITLE = "### Figures to check"
FIGURE = re.compile(r"^» (?P<name>.+?) = (?P<value>-?[\d.]+)", re.MULTILINE)
RUN_TIME = "run time s"  # the row for the lesson's wall time; its range comes from the lesson's "Run:" line
# "Run: ... (5–30 s on a quiet 2-core laptop, about 1½ minutes on a busy one)": quiet low end, busy high end
RUN_RANGE = re.compile(r"(?P<low>\d+)–(?P<high>\d+) s on a quiet")
BUSY_MINUTES = re.compile(r"(?:about|up to) (?P<minutes>[\d½]+|a) minutes?")


@dataclass(frozen=True)
class Quoted:
    lesson: int
    name: str
    low: float
    high: float  # low == high: an exact count
    text: str  # as the guide writes it

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high


def parse_expected(text: str) -> tuple[float, float]:
    text = text.strip().replace("−", "-")
    if text.startswith("≥"):
        return float(text[1:]), float("inf")
    if "–" in text:
        low, high = text.split("–")
        return float(low), float(high)
    return float(text), float(text)


def quoted_figures(guide: str = "") -> list[Quoted]:
    """The rows of the guide's *Figures to check* table: | lesson | figure | expected | ... |."""
    guide = guide or GUIDE.read_text()
    section = guide[guide.index(TABLE_TITLE):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        name = cells[1].strip("`")
        rows.append(Quoted(int(cells[0]), name, *parse_expected(cells[2]), cells[2]))
    return rows


def run_time_range(lesson: int) -> tuple[float, float, str]:
    """The lesson text's "Run:" range: the quiet low end to the busy high end, in seconds."""
    text = next(LESSONS.glob(f"lesson_{lesson}_*.md")).read_text()
    run = text[text.index("Run:"):].split("\n\n")[0].replace("\n", " ")
    quiet, busy = RUN_RANGE.search(run), BUSY_MINUTES.search(run)
    minutes = busy["minutes"].replace("½", ".5") if busy else None
    high = 60 * (1 if minutes == "a" else float(minutes)) if minutes else float(quiet["high"])
    return float(quiet["low"]), high, f"{quiet['low']}–{high:.0f}"


def run_lesson(lesson: int) -> tuple[float, dict[str, float], str]:
    script = next(LESSONS.glob(f"lesson_{lesson}_*.py"))
    env = {**os.environ, "LESSON_WIDTH": "80",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(LESSONS.parent), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=LESSONS.parent, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    figures = {m["name"]: float(m["value"]) for m in FIGURE.finditer(done.stdout)}
    return wall, figures, "" if done.returncode == 0 else (done.stdout + done.stderr)[-2000:]


def load() -> str:
    return f"load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "load average unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    quoted = quoted_figures()
    ap.add_argument("--lessons", type=int, nargs="+", default=sorted({q.lesson for q in quoted}))
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes to run meanwhile")
    args = ap.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    failed = 0
    try:
        print(f"{args.busy} busy processes; {load()}")
        print(f"{'lesson':6}  {'figure':58} {'quoted':>10} {'measured':>10}")
        for lesson in args.lessons:
            wall, figures, error = run_lesson(lesson)
            low, high, text = run_time_range(lesson)
            rows = [Quoted(lesson, RUN_TIME, low, high, text), *(q for q in quoted if q.lesson == lesson)]
            if error:
                print(f"{lesson:6}  FAIL: the lesson exited with an error:\n{error}")
                failed += 1
            for q in rows:
                value = wall if q.name == RUN_TIME else figures.get(q.name)
                ok = value is not None and q.holds(value)
                failed += not ok
                shown = "missing" if value is None else f"{value:g}" if q.name != RUN_TIME else f"{value:.0f}"
                print(f"{lesson:6}  {q.name:58} {q.text:>10} {shown:>10}  {'PASS' if ok else 'FAIL'}", flush=True)
            print(f"{'':6}  ({load()})", flush=True)
    finally:
        for proc in busy:
            proc.kill()
    print(f"{failed} failed" if failed else "every quoted figure held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
