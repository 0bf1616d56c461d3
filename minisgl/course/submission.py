"""One student's hand-in, read safely: a work tree or a patch, normalized, its regions and its edits.

A submission is an entry of the submissions folder: a folder (the student's work tree) or a
`NAME.patch` / `NAME.diff` file (`git diff` in the student's tree; PowerShell writes it UTF-16).
It is never run and never read in place: its regular files are copied into scratch, text
normalized (a BOM dropped, CRLF and CR ends made LF), and what laptops add (`.DS_Store`,
`Thumbs.db`, `__pycache__`, editor folders) left out. A symlink, FIFO or device is never
followed or opened. A malformed submission (the entry a symlink or a FIFO, a patch that does not
apply or is too big, a marked file that is not a regular file) raises NotGradable: one row of the
grade sheet, never the end of the class. A marked file that is missing (a tree from an older
edition) costs only the exercises whose regions it holds.

What is graded is the code between the markers (`regions`). Edits elsewhere are weighed by
`outside_edits`: one inside a function that holds exercise N's region costs exercise N (the code
around the region is part of its answer); any other one (an added import, another function or
file, a scratch script, the tests) is reported and costs nothing, since the checks run the
handed-out files.
"""

from __future__ import annotations

import ast
import codecs
import difflib
import os
import shutil
import stat
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from minisgl.course.markers import regions

PATCH_SUFFIXES = (".patch", ".diff")
MAX_PATCH_BYTES = 16 << 20  # a patch of the exercise regions is kilobytes
MAX_FILE_BYTES = 16 << 20
MAX_TREE_BYTES = 256 << 20
MAX_FILES = 20_000
IGNORED_NAMES = frozenset({".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
                           ".idea", ".vscode", "__MACOSX", ".DS_Store", "Thumbs.db", "desktop.ini", "work",
                           "build"})
IGNORED_SUFFIXES = (".pyc", ".pyo", ".egg-info", ".swp", "~")
PROSE_SUFFIXES = (".md", ".txt")  # a student's notes: neither graded nor reported


class NotGradable(ValueError):
    """The submission cannot be read as a work tree: one short reason."""


@dataclass
class Submission:
    student: str
    entries: list[str]  # the entry names it was read from (one, unless two share the student's name)
    code: dict[int, dict[str, str]] = field(default_factory=dict)  # exercise -> region -> its code
    costs: dict[int, list[str]] = field(default_factory=dict)  # exercise -> edits that cost it its mark
    notes: list[str] = field(default_factory=list)  # edits reported, costing nothing
    not_gradable: str = ""


def student_name(entry: Path) -> str:
    return entry.name[:-len(entry.suffix)] if entry.suffix in PATCH_SUFFIXES else entry.name


def is_submission(entry: Path) -> bool:
    """An entry the grader reads: anything but hidden files and OS litter (a broken one is a row)."""
    return not entry.name.startswith(".") and entry.name not in IGNORED_NAMES


def _ignored(name: str) -> bool:
    return name in IGNORED_NAMES or name.startswith("._") or name.endswith(IGNORED_SUFFIXES)


def normalize_text(data: bytes) -> bytes:
    """UTF-16 (with its BOM) or UTF-8 text as UTF-8 without BOM and with LF ends; other bytes as they are."""
    for bom, codec in ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be")):
        if data.startswith(bom):
            try:
                data = data[len(bom):].decode(codec).encode("utf-8")
            except UnicodeDecodeError:
                return data
            break
    else:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return data
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def copy_tree_safely(source: Path, dest: Path) -> list[str]:
    """Copy source's regular files into dest, text normalized, litter left out, nothing followed.
    Returns what was skipped (symlinks, FIFOs, devices), relative to source."""
    skipped: list[str] = []
    total, count = 0, 0
    stack = [Path()]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(source / rel) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise NotGradable(f"{rel.as_posix() or '.'} cannot be read ({exc.strerror})") from exc
        for child in children:
            if _ignored(child.name):
                continue
            child_rel = rel / child.name
            mode = child.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                if len(child_rel.parts) > 32:
                    raise NotGradable(f"{child_rel.as_posix()} is nested too deep")
                (dest / child_rel).mkdir(parents=True, exist_ok=True)  # kept, empty too: a folder where a file
                stack.append(child_rel)  # is expected is not the same as a missing file
            elif stat.S_ISREG(mode):
                size = child.stat(follow_symlinks=False).st_size
                count, total = count + 1, total + size
                if size > MAX_FILE_BYTES or total > MAX_TREE_BYTES or count > MAX_FILES:
                    raise NotGradable(f"more than {MAX_TREE_BYTES >> 20} MiB or {MAX_FILES} files, or a file over "
                                      f"{MAX_FILE_BYTES >> 20} MiB ({child_rel.as_posix()})")
                target = dest / child_rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(source / child_rel, "rb") as f:  # a regular file: reading cannot block
                    target.write_bytes(normalize_text(f.read(MAX_FILE_BYTES + 1)))
            else:
                skipped.append(child_rel.as_posix())
    return skipped


def tree_from_entry(entry: Path, edition: Path, scratch: Path) -> tuple[Path, list[str]]:
    """The submission's work tree, normalized, in scratch/tree; and the entries skipped."""
    mode = entry.lstat().st_mode
    tree = scratch / "tree"
    if stat.S_ISLNK(mode):
        raise NotGradable(f"{entry.name} is a symlink, not a folder or a patch")
    if stat.S_ISDIR(mode):
        tree.mkdir(parents=True)
        return tree, copy_tree_safely(entry, tree)
    if not stat.S_ISREG(mode):
        raise NotGradable(f"{entry.name} is not a regular file or a folder")
    if entry.suffix not in PATCH_SUFFIXES:
        raise NotGradable(f"{entry.name} is neither a folder nor a {' or '.join(PATCH_SUFFIXES)} file")
    if entry.lstat().st_size > MAX_PATCH_BYTES:
        raise NotGradable(f"{entry.name} holds more than {MAX_PATCH_BYTES >> 20} MiB: not a patch of the exercises")
    with open(entry, "rb") as f:
        patch = normalize_text(f.read(MAX_PATCH_BYTES + 1))
    (scratch / "patch").write_bytes(patch)
    applied = scratch / "applied"
    shutil.copytree(edition, applied, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(scratch), HOME=str(scratch))
    try:
        done = subprocess.run(["git", "apply", "--whitespace=nowarn", str(scratch / "patch")], cwd=applied, env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise NotGradable("the patch took too long to apply") from exc
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["git apply failed"])[0]
        raise NotGradable(f"the patch does not apply to the student edition ({first[:160]})")
    tree.mkdir(parents=True)
    return tree, copy_tree_safely(applied, tree)


def _outside(lines: list[str]) -> tuple[list[str], list[int]]:
    """The file with each region's body folded into one line naming the region, and for each of
    its lines the index of the line it came from."""
    out, origin, pos = [], [], 0
    for region in regions(lines):
        out += lines[pos:region.first + 1] + [f"<body of exercise {region.number}: {region.name}>\n"]
        origin += list(range(pos, region.first + 2))
        pos = region.last
    return out + lines[pos:], origin + list(range(pos, len(lines)))


def _exercises_of_function(source: str, line: int) -> set[int]:
    """The exercises with regions inside the innermost function around `line` (0-based), if any."""
    spans = [(node.lineno - 1, node.end_lineno - 1) for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = [span for span in spans if span[0] <= line <= span[1]]
    if not inside:
        return set()
    first, last = min(inside, key=lambda span: span[1] - span[0])
    return {r.number for r in regions(source.splitlines()) if first <= r.first and r.last <= last}


def _files(tree: Path) -> set[str]:
    return {rel.as_posix() for rel in (p.relative_to(tree) for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
            if not any(_ignored(part) for part in rel.parts)}


def read_tree(sub: Submission, edition: Path, tree: Path, marked: dict[str, list[int]]) -> None:
    """Fill sub's regions, costs and notes from its normalized tree against the edition."""
    def cost(numbers: set[int] | list[int], what: str) -> None:
        for number in sorted(numbers):
            sub.costs.setdefault(number, []).append(what)

    for rel, numbers in marked.items():
        path = tree / rel
        if not os.path.lexists(path):  # handed in from an older edition, say: only its exercises are lost
            cost(numbers, f"{rel} is missing")
            continue
        if not path.is_file() or path.is_symlink():
            raise NotGradable(f"{rel} is not a regular file")
        try:
            after = path.read_text()
            after_regions = regions(after.splitlines())
        except UnicodeDecodeError:
            cost(numbers, f"{rel}: not text")
            continue
        except ValueError:
            cost(numbers, f"{rel}: its exercise markers are broken")
            continue
        before = (edition / rel).read_text()
        before_regions = regions(before.splitlines())
        if [(r.number, r.name) for r in after_regions] != [(r.number, r.name) for r in before_regions]:
            changed = {r.number for r in set(before_regions) ^ set(after_regions)} or set(numbers)
            cost({n for n in changed if n in numbers} or set(numbers), f"{rel}: the exercise markers changed")
            continue
        lines = after.splitlines(keepends=True)
        for region in after_regions:
            sub.code.setdefault(region.number, {})[region.name] = textwrap.dedent(
                "".join(lines[region.first + 1:region.last]))
        outside_before, origin = _outside(before.splitlines(keepends=True))
        outside_after, _ = _outside(lines)
        matcher = difflib.SequenceMatcher(a=outside_before, b=outside_after, autojunk=False)
        for tag, i1, _, _, _ in matcher.get_opcodes():
            if tag == "equal":
                continue
            line = origin[min(i1, len(origin) - 1)]
            owners = _exercises_of_function(before, line)
            if owners:
                cost(owners, f"{rel} line {line + 1} changed, outside the markers but in the function that "
                             f"holds the region")
            else:
                sub.notes.append(f"{rel} line {line + 1} changed outside the regions (not graded)")
    base_files, tree_files = _files(edition), _files(tree)
    others = sorted(name for name in (base_files ^ tree_files) | {
        name for name in base_files & tree_files - set(marked)
        if (edition / name).read_bytes() != (tree / name).read_bytes()} if not name.endswith(PROSE_SUFFIXES))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        sub.notes.append(f"files added, removed or changed outside the regions (not graded): {shown}")
