"""One student's hand-in, read safely: a work tree or a patch, normalized, its regions and its edits.

A submission is an entry of the submissions folder: a folder (the student's work tree), a
`NAME.zip` of it (Windows' "Send to > Compressed folder" included: backslashes in its names, the
tree in one folder of it) or a `NAME.patch` / `NAME.diff` file (`git diff` in the student's tree;
PowerShell writes it UTF-16).
It is never run and never read in place: its regular files are copied into scratch, text
normalized (a BOM dropped, CRLF and CR ends made LF), and what laptops add (`.DS_Store`,
`Thumbs.db`, `__pycache__`, editor folders) left out. A symlink, FIFO or device is never
followed or opened; a zip is unpacked name by name, none outside its folder. A malformed
submission (the entry a symlink or a FIFO, a patch that does not apply or is too big, a zip that
is not one or names a path outside it, a tree without any marked file) raises NotGradable: one row of the
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
import re
import shutil
import stat
import subprocess
import textwrap
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from minisgl.course.markers import regions

PATCH_SUFFIXES = (".patch", ".diff")
ARCHIVE_SUFFIX = ".zip"
MAX_PATCH_BYTES = 16 << 20  # a patch of the exercise regions is kilobytes
MAX_FILE_BYTES = 16 << 20
MAX_TREE_BYTES = 256 << 20
MAX_FILES = 20_000
MAX_ADDED_LINES = 5_000  # outside the regions of a marked file, beyond twice the edition's lines
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
    return entry.name[:-len(entry.suffix)] if entry.suffix in (*PATCH_SUFFIXES, ARCHIVE_SUFFIX) else entry.name


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


def unzip_safely(archive_path: Path, dest: Path) -> list[str]:
    """A zip's regular files into dest, text normalized and litter left out as copy_tree_safely
    does: a name written with backslashes (Windows) read as a path; an absolute name, a drive, or
    `..` refused, so nothing lands outside dest; a link skipped; the sizes bounded by what is read,
    not by what the archive claims. Returns what was skipped."""
    skipped: list[str] = []
    total = 0
    try:
        with zipfile.ZipFile(archive_path) as archive:
            members = archive.infolist()
            if len(members) > MAX_FILES:
                raise NotGradable(f"{archive_path.name} holds more than {MAX_FILES} entries")
            for member in members:
                name = member.filename.replace("\\", "/")
                parts = [part for part in name.split("/") if part not in ("", ".")]
                if name.startswith("/") or ".." in parts or (parts and ":" in parts[0]):
                    raise NotGradable(f"{archive_path.name} names a path outside its folder: {member.filename[:80]!r}")
                if not parts or any(_ignored(part) for part in parts):
                    continue
                target = dest.joinpath(*parts)
                if member.is_dir() or name.endswith("/"):
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if stat.S_ISLNK(member.external_attr >> 16):
                    skipped.append("/".join(parts))
                    continue
                with archive.open(member) as f:
                    data = f.read(MAX_FILE_BYTES + 1)
                total += len(data)
                if len(data) > MAX_FILE_BYTES or total > MAX_TREE_BYTES:
                    raise NotGradable(f"{archive_path.name} unpacks to more than {MAX_TREE_BYTES >> 20} MiB, or a "
                                      f"file over {MAX_FILE_BYTES >> 20} MiB ({'/'.join(parts)})")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(normalize_text(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, EOFError, zlib.error) as exc:
        raise NotGradable(f"{archive_path.name} is not a zip this grader can read ({str(exc)[:120]})") from exc
    return skipped


def _tree_root(folder: Path) -> Path:
    """The folder itself, or the one folder it holds, whichever has the package in it (a zip of
    the work tree's folder unpacks to one folder)."""
    inside = [p for p in folder.iterdir() if not _ignored(p.name)]
    if not (folder / "minisgl").is_dir() and len(inside) == 1 and (inside[0] / "minisgl").is_dir():
        return inside[0]
    return folder


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
    if entry.suffix == ARCHIVE_SUFFIX:
        tree.mkdir(parents=True)
        skipped = unzip_safely(entry, tree)
        root = _tree_root(tree)
        below = root.relative_to(tree).as_posix() + "/"  # "./" where the package is at the zip's top
        return root, [name.removeprefix(below) for name in skipped]
    if entry.suffix not in PATCH_SUFFIXES:
        raise NotGradable(f"{entry.name} is neither a folder nor a {', '.join(PATCH_SUFFIXES)} or {ARCHIVE_SUFFIX} file")
    if entry.lstat().st_size > MAX_PATCH_BYTES:
        raise NotGradable(f"{entry.name} holds more than {MAX_PATCH_BYTES >> 20} MiB: not a patch of the exercises")
    with open(entry, "rb") as f:
        patch = normalize_text(f.read(MAX_PATCH_BYTES + 1))
    # A binary hunk is zlib-compressed: a few MiB of patch wrote gigabytes (a red-team trial). The
    # exercises are text; git apply then meets nothing that grows past the patch's own size.
    if re.search(rb"^GIT binary patch", patch, re.MULTILINE):
        raise NotGradable(f"{entry.name} holds a binary patch: the exercises are text")
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


def exercises_by_line(source: str) -> list[frozenset[int]]:
    """For each line (0-based), the exercises whose regions open inside the innermost function
    around it: the function that holds them, its closing marker included (a comment after the
    function's last statement, where a region ends its function). Empty where the source does
    not parse."""
    lines = source.splitlines()
    owners = [frozenset()] * len(lines)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return owners
    marked = regions(lines)
    functions = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first, last = node.lineno - 1, node.end_lineno - 1
            held = [r for r in marked if first <= r.first <= last]
            functions.append((first, max([last] + [r.last for r in held]), frozenset(r.number for r in held)))
    for first, last, numbers in sorted(functions, key=lambda f: f[0] - f[1]):  # outermost first, inner overwrite
        owners[first:last + 1] = [numbers] * (last + 1 - first)
    return owners


def _tab_error(rel: str, source: str, marked: list) -> tuple[set[int], str] | None:
    """The exercises that a TabError in `source` costs (the region holding it, else every one of
    the file) and why: the student's own checker cannot import such a file, so neither may the grade
    take its regions re-indented."""
    try:
        compile(source, rel, "exec", dont_inherit=True)
    except TabError as exc:
        line = (exc.lineno or 1) - 1
        numbers = {r.number for r in marked if r.first < line < r.last} or {r.number for r in marked}
        return numbers, f"{rel} line {line + 1}: tabs and spaces mixed in its indentation (Python's TabError)"
    except (SyntaxError, ValueError):
        return None  # a region's own syntax error is its exercise's (region_policy says where)
    return None


def _files(tree: Path) -> set[str]:
    return {rel.as_posix() for rel in (p.relative_to(tree) for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
            if not any(_ignored(part) for part in rel.parts)}


def read_tree(sub: Submission, edition: Path, tree: Path, marked: dict[str, list[int]],
              skipped: list[str] | tuple[str, ...] = ()) -> None:
    """Fill sub's regions, costs and notes from its normalized tree against the edition (`skipped`:
    what copy_tree_safely did not copy, symlinks and the like)."""
    def cost(numbers: set[int] | list[int], what: str) -> None:
        for number in sorted(numbers):
            sub.costs.setdefault(number, []).append(what)

    if not any(os.path.lexists(tree / rel) or rel in skipped for rel in marked):
        raise NotGradable(f"none of the files with exercises ({', '.join(list(marked)[:2])}, ...) is in it: "
                          f"not a work tree of the student edition")
    for rel, numbers in marked.items():
        path = tree / rel
        if rel in skipped:
            cost(numbers, f"{rel} is a symlink or not a regular file: not read")
            continue
        if not os.path.lexists(path):  # handed in from an older edition, say: only its exercises are lost
            cost(numbers, f"{rel} is missing")
            continue
        if not path.is_file() or path.is_symlink():
            raise NotGradable(f"{rel} is not a regular file")
        try:
            after = path.read_text(encoding="utf-8")
            after_regions = regions(after.splitlines())
        except UnicodeDecodeError:
            cost(numbers, f"{rel}: not text")
            continue
        except ValueError:
            cost(numbers, f"{rel}: its exercise markers are broken")
            continue
        before = (edition / rel).read_text(encoding="utf-8")
        before_regions = regions(before.splitlines())
        if [(r.number, r.name) for r in after_regions] != [(r.number, r.name) for r in before_regions]:
            changed = {r.number for r in set(before_regions) ^ set(after_regions)} or set(numbers)
            cost({n for n in changed if n in numbers} or set(numbers), f"{rel}: the exercise markers changed")
            continue
        lines = after.splitlines(keepends=True)
        for region in after_regions:
            sub.code.setdefault(region.number, {})[region.name] = textwrap.dedent(
                "".join(lines[region.first + 1:region.last]))
        tabs = _tab_error(rel, after, after_regions)
        if tabs:
            cost(*tabs)
        outside_before, origin = _outside(before.splitlines(keepends=True))
        outside_after, origin_after = _outside(lines)
        if len(outside_after) > MAX_ADDED_LINES + 2 * len(outside_before):  # the diff below is quadratic
            cost(numbers, f"{rel}: {len(outside_after)} lines outside its regions against the edition's "
                          f"{len(outside_before)}: too much added to compare")
            continue
        owners_before, owners_after = exercises_by_line(before), exercises_by_line(after)
        matcher = difflib.SequenceMatcher(a=outside_before, b=outside_after, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                continue
            line = origin[min(i1, len(origin) - 1)]
            # the function a changed line was in, or an added line is in now (after a region that
            # ends its function, say); a deleted line's function is the edition's
            owners = set().union(*(owners_before[origin[i]] for i in range(i1, i2)),
                                 *(owners_after[origin_after[j]] for j in range(j1, j2)))
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
