"""The exercise markers: comment-only lines around each part that a learner writes back.

    # >>> exercise N: <name of the part>
    ...the code the learner writes...
    # <<< exercise N

The reference code carries them (so it runs unchanged); the student edition keeps them around
each stub; the grader and the checker read the code between them (make_exercise.py,
region_policy.py, grade.py).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from minisgl.course import PACKAGE

START = re.compile(r"^(?P<indent>[ \t]*)# >>> exercise (?P<n>\d+): (?P<name>.+?)\s*$")
END = re.compile(r"^[ \t]*# <<< exercise (?P<n>\d+)\s*$")


@dataclass(frozen=True)
class Region:
    number: int
    name: str
    first: int  # line of the start marker, 0-based
    last: int  # line of the end marker
    indent: str


def regions(lines: list[str]) -> list[Region]:
    """Every marked region, in file order."""
    found, i = [], 0
    while i < len(lines):
        m = START.match(lines[i])
        if not m:
            if END.match(lines[i]):
                raise ValueError(f"line {i + 1}: '# <<< exercise' without a start marker")
            i += 1
            continue
        n, j = int(m["n"]), i + 1
        while j < len(lines) and not END.match(lines[j]):
            if START.match(lines[j]):
                raise ValueError(f"line {j + 1}: exercise regions cannot nest")
            j += 1
        if j == len(lines) or int(END.match(lines[j])["n"]) != n:
            raise ValueError(f"line {i + 1}: exercise {n} region is not closed by '# <<< exercise {n}'")
        found.append(Region(n, m["name"], i, j, m["indent"]))
        i = j + 1
    return found


def marked_files(package: Path = PACKAGE) -> dict[Path, list[int]]:
    """Package file -> exercise numbers it has regions of."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        numbers = sorted({r.number for r in regions(path.read_text().splitlines())})
        if numbers:
            found[path.relative_to(package)] = numbers
    return found


def written_regions(tree: Path) -> dict[int, dict[str, str]]:
    """exercise -> region name -> the code between its markers in tree/minisgl (dedented)."""
    found: dict[int, dict[str, str]] = {}
    for rel in marked_files(PACKAGE):
        lines = (tree / "minisgl" / rel).read_text().splitlines(keepends=True)
        for region in regions(lines):
            found.setdefault(region.number, {})[region.name] = textwrap.dedent(
                "".join(lines[region.first + 1:region.last]))
    return found
