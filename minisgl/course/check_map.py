"""Keep the map to SGLang true to minisgl's code: every minisgl name in the map exists.

The map is the tables of readings §13 and of the side-by-side reading of SGLang's overlap loop.
In every table whose header has a column named `minisgl` (or `minisgl switch`), each
backticked name in that column must resolve against the package:

- a mechanism switch (`future_map`) must be a key of `minisgl.MECHANISMS`;
- `Class.member` must be a method, class attribute or `self.member` attribute of that class or of a
  base class defined in minisgl/ (a method inherited from a base class counts);
- a bare `name` must be a class or a module-level function somewhere in minisgl/.

The map's SGLang and mini-SGLang names are checked too, by upstream_map.py beside it (`scan` runs both).

Call arguments are ignored (`Scheduler.overlap_loop(last)` checks `Scheduler.overlap_loop`);
backticked text that is not a dotted name (a command line, an expression) is not checked.

    python -m minisgl.course.check_map    # list names that resolve to nothing (exit 1 if any)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
MAP_FILES = (ROOT / "lessons" / "readings" / "README.md", ROOT / "lessons" / "readings" / "sglang_overlap_loop.md")
MINISGL_COLUMNS = {"minisgl", "minisgl switch"}
CODE = re.compile(r"`([^`]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class PackageNames:
    """Every class, module-level function and class member defined in minisgl/, found with ast."""

    def __init__(self, package: Path) -> None:
        self.top_level: set[str] = set()
        self.members: dict[str, set[str]] = {}
        self.bases: dict[str, set[str]] = {}  # class -> the names of its base classes
        for path in sorted(package.rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.top_level.add(node.name)
                if isinstance(node, ast.ClassDef):
                    self.members.setdefault(node.name, set()).update(class_members(node))
                    self.bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))
        self.mechanisms = mechanism_names(package / "mechanisms.py")

    def resolves(self, name: str) -> bool:
        parts = name.split(".")
        if len(parts) == 1:
            return name in self.mechanisms or name in self.top_level
        if len(parts) == 2:
            return self.has_member(parts[0], parts[1])
        return False

    def has_member(self, cls: str, member: str) -> bool:
        """Defined on `cls` or inherited from one of its bases in minisgl/."""
        return (member in self.members.get(cls, set())
                or any(self.has_member(base, member) for base in self.bases.get(cls, ())))


def class_members(cls: ast.ClassDef) -> set[str]:
    found: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)  # dataclass fields
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):  # attributes set in methods: self.x = ... / self.x: T = ...
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                found.add(t.attr)
    return found


def mechanism_names(path: Path) -> set[str]:
    """The keys of the MECHANISMS dict literal (read, not imported: no torch needed)."""
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == "MECHANISMS" and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise RuntimeError(f"no MECHANISMS dict literal in {path}")


def minisgl_cells(text: str) -> list[tuple[int, str]]:
    """(line number, cell text) of every cell in a `minisgl` column of a markdown table."""
    cells, column = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            column = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:  # a header row starts a table
            names = [c.lower() for c in row]
            column = next((i for i, c in enumerate(names) if c in MINISGL_COLUMNS), -1)
        elif column >= 0 and not set(line) <= set("|-: ") and column < len(row):
            cells.append((number, row[column]))
    return cells


def check_text(text: str, names: PackageNames) -> list[str]:
    """Problems (`line N: name`) for every name in a minisgl column that resolves to nothing."""
    problems = []
    for number, cell in minisgl_cells(text):
        for code in CODE.findall(cell):
            name = code.split("(", 1)[0].strip()
            if DOTTED.fullmatch(name) and not names.resolves(name):
                problems.append(f"line {number}: `{name}` is not defined in minisgl/")
    return problems


def scan(upstream: Callable[[], list[str]] | None = None) -> list[str]:
    """Every problem of the map: its minisgl names here, its SGLang and mini-SGLang names by
    `upstream` (default: upstream_problems)."""
    names = PackageNames(ROOT / "minisgl")
    problems = []
    for path in MAP_FILES:
        problems += [f"{path.relative_to(ROOT)} {p}" for p in check_text(path.read_text(), names)]
    return problems + (upstream or upstream_problems)()


def upstream_problems() -> list[str]:
    """The map's SGLang and mini-SGLang names, checked against their manifest (upstream_map.py)."""
    from . import upstream_map

    return upstream_map.scan()


def main() -> int:
    problems = scan()
    print("\n".join(problems) if problems else "map: every minisgl, SGLang and mini-SGLang name resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
