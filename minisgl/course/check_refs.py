"""Keep the lesson texts' code references exact: `minisgl/scheduler.py:185 Scheduler.overlap_loop`.

Every such reference in lessons/**/*.md (texts, the reading guide) must name a function or class defined on that line of
today's code. Other people edit minisgl/, so lines move: `--fix` rewrites the numbers.

    python -m minisgl.course.check_refs          # list stale references (exit 1 if any)
    python -m minisgl.course.check_refs --fix    # rewrite them in place
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "lessons" / "exercises" / "work"
SPLIT = re.compile(r"`minisgl/[\w/]+\.py:\d+\s*\n")
REF = re.compile(r"`(?P<path>minisgl/[\w/]+\.py):(?P<line>\d+) (?P<name>[A-Za-z_][\w.]*)`")


def definitions(path: Path) -> dict[str, int]:
    """Dotted name (Class.method, function, Class) -> line of its def/class statement."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                found.setdefault(name, child.lineno)
                visit(child, name + ".")

    visit(ast.parse(path.read_text()), "")
    return found


def scan(fix: bool = False) -> list[str]:
    problems, cache = [], {}
    for md in sorted((ROOT / "lessons").rglob("*.md")):
        if WORK in md.parents:
            continue  # learners' exercise copies are not lesson texts
        text = md.read_text()

        def check(m: re.Match) -> str:
            path = ROOT / m["path"]
            if path not in cache:
                cache[path] = definitions(path) if path.exists() else {}
            line = cache[path].get(m["name"])
            if line is None:
                problems.append(f"{md.relative_to(ROOT / 'lessons')}: {m[0]} names nothing defined in {m['path']}")
            elif line != int(m["line"]):
                problems.append(f"{md.relative_to(ROOT / 'lessons')}: {m[0]} is now at line {line}")
                return f"`{m['path']}:{line} {m['name']}`" if fix else m[0]
            return m[0]

        problems += [f"{md.relative_to(ROOT / 'lessons')}: {m[0].strip()} is split across lines (keep a reference on one)"
                     for m in SPLIT.finditer(text)]
        new = REF.sub(check, text)
        if fix and new != text:
            md.write_text(new)
    return problems


def check() -> list[str]:
    return scan(fix=False)


if __name__ == "__main__":
    fix = "--fix" in sys.argv[1:]
    problems = scan(fix)
    for p in problems:
        print(("fixed: " if fix and "is now" in p else "") + p)
    sys.exit(1 if problems and not fix else 0)
