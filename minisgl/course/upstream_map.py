"""Keep the map to SGLang and mini-SGLang true: every name it gives from them is defined there.

The readings name SGLang and mini-SGLang code at one pinned version of each. The names defined at
those versions are stored in `lessons/readings/upstream_names.json` (the manifest), so the check
needs no network. This module builds the manifest from local copies of the sources, with `ast`,
and checks the map files against it:

- in a table column headed `SGLang...` (or `mini-SGLang...`), each backticked name must be
  defined in SGLang (or mini-SGLang);
- everywhere else in the map files, each backticked name must be defined in minisgl, SGLang or
  mini-SGLang, or be one of `NAMED_ELSEWHERE` (older releases' code, the articles' pseudo-code);
- a backticked commit id must have all 40 characters;
- a name written right after a file (managers/schedule_batch.py: then ScheduleBatch.copy in
  backticks) must be defined in that file, where its first part is a class or a module-level function.

What counts as defined: a class, a module-level function or variable, a class member (method,
class attribute, dataclass field, `self.x` attribute), a function parameter, an environment
variable the source reads, or a source file or folder. `Class.member` must be a member of that
class or of one of its bases. A dotted name that does not start with a class
(`req.kv.kv_committed_len`) must consist of defined names. Call arguments and subscripts are left
out (`FutureMap.publish(x)` checks `FutureMap.publish`). A command line `--flag` checks the
argument's name (`disable_overlap_schedule`); `VAR=1` and `argument="value"` check the name.
Backticked text with spaces or operators (an expression, a code reference) is not a name and is
not checked.

To rebuild the manifest (the versions are in `SOURCES`):

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl     # check the wheel's sha256 against SOURCES
    unzip -q /tmp/sgl/sglang-0.5.23-*.whl 'sglang/*' -d /tmp/sgl/src
    git clone https://github.com/sgl-project/mini-sglang /tmp/mini
    git -C /tmp/mini checkout 20fcd7f3c6a1898a61139fae1c97cc7a40bd8d66
    python -m minisgl.course.upstream_map build --sglang /tmp/sgl/src --mini-sglang /tmp/mini/python

    python -m minisgl.course.upstream_map check    # list names that resolve to nothing (exit 1 if any)
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "lessons" / "readings" / "upstream_names.json"
MAP_FILES = (ROOT / "lessons" / "readings" / "README.md", ROOT / "lessons" / "readings" / "sglang_overlap_loop.md")

# Each source: what it is, its package, and the folders and files of the package that the manifest
# reads. SGLang is read from the release wheel (its repository is too large to copy here); the
# wheel's `sglang/` is the repository's `python/sglang/`, and the manifest names files as in the
# repository.
SOURCES = {
    "sglang": {
        "release": "v0.5.23",
        "wheel": "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "wheel_sha256": "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
        "commit": None,  # the wheel records none (`sglang/_version.py`: `__commit_id__ = None`)
        "package": "sglang",
        "read": ["srt/managers", "srt/speculative", "srt/mem_cache", "srt/arg_groups", "srt/constrained",
                 "srt/model_executor", "srt/sampling", "srt/layers/logprob_processor.py",
                 "srt/layers/sampler.py", "srt/environ.py", "srt/server_args.py", "bench_serving.py"],
    },
    "mini-sglang": {
        "repository": "https://github.com/sgl-project/mini-sglang",
        "commit": "20fcd7f3c6a1898a61139fae1c97cc7a40bd8d66",
        "package": "minisgl",
        "read": ["."],
    },
}
# mini-SGLang reads each field of `EnvClassSingleton` from the environment as MINISGL_<field>.
MINISGL_ENV = ("EnvClassSingleton", "MINISGL_")

# Names the readings give that are not code at the pinned versions, and where each comes from.
NAMED_ELSEWHERE = {
    "must_sync": "the pseudo-code of article 000",
    "alloc_future_indices": "the ring-buffer FutureMap of SGLang v0.5.5 and older",
    "launch_done": "SGLang's older forward thread",
    "cache_finished_req": "SGLang v0.5.5's release of a request's KV (v0.5.23: `release_kv_cache`)",
}

CODE = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"[A-Za-z_]\w*")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]*)*")
FIELDS = ("functions", "module_names", "parameters", "local_names", "environment", "files")
FILE_CLAIM = re.compile(r"([\w./-]+\.py): `([^`\n]+)`")  # a file, then the name it defines
BUILTINS = set(dir(builtins))
HEX = re.compile(r"[0-9a-f]{7,40}")


@dataclass
class Names:
    """What one code base defines, as read with `ast`."""

    classes: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # name -> {"bases", "members"}
    functions: set[str] = field(default_factory=set)
    module_names: set[str] = field(default_factory=set)
    parameters: set[str] = field(default_factory=set)
    local_names: set[str] = field(default_factory=set)  # assigned or defined inside a function
    environment: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)
    defined_in: dict[str, set[str]] = field(default_factory=dict)  # a class or module-level function -> its files

    @classmethod
    def from_json(cls, data: dict) -> Names:
        classes = {c: {"bases": set(v["bases"]), "members": set(v["members"])} for c, v in data["classes"].items()}
        defined_in = {name: set(files) for name, files in data["defined_in"].items()}
        return cls(classes, *(set(data[k]) for k in FIELDS), defined_in)

    def to_json(self) -> dict:
        classes = {c: {k: sorted(v) for k, v in entry.items()} for c, entry in sorted(self.classes.items())}
        return {"classes": classes, **{k: sorted(getattr(self, k)) for k in FIELDS},
                "defined_in": {name: sorted(files) for name, files in sorted(self.defined_in.items())}}

    @cached_property
    def every_name(self) -> set[str]:
        members = {m for entry in self.classes.values() for m in entry["members"]}
        modules = {Path(f).stem for f in self.files}
        return (set(self.classes) | self.functions | self.module_names | self.parameters | self.local_names
                | self.environment | members | modules | BUILTINS)

    def has_member(self, cls: str, member: str, seen: frozenset = frozenset()) -> bool:
        """Defined on `cls` or inherited from one of its bases (by name, within this code base)."""
        entry = self.classes.get(cls)
        if entry is None or cls in seen:
            return False
        return member in entry["members"] or any(self.has_member(b, member, seen | {cls}) for b in entry["bases"])

    def resolves(self, name: str) -> bool:
        parts = name.split(".")
        if parts[0] in self.classes and len(parts) > 1:
            return self.has_member(parts[0], parts[1]) and all(p in self.every_name for p in parts[2:])
        return all(p in self.every_name for p in parts)

    def has_path(self, path: str) -> bool:
        path = path.strip("/")
        return any(f == path or f.endswith("/" + path) or f"/{path}/" in f"/{f}" for f in self.files)

    def files_defining(self, name: str) -> set[str]:
        """The files that define `name`'s first part as a class or module-level function."""
        return self.defined_in.get(name.split(".")[0], set())


def collect(parent: Path, package: str, read: list[str], prefix: str = "") -> Names:
    """The names defined in the .py files under `parent/package/<each of read>`; files as `prefix + path`."""
    names = Names()
    for part in read:
        top = parent / package / part
        for path in [top] if top.is_file() else sorted(top.rglob("*.py")):
            file = prefix + path.relative_to(parent).as_posix()
            names.files.add(file)
            collect_module(ast.parse(path.read_text(encoding="utf-8")), names, file)
    return names


def collect_module(tree: ast.Module, names: Names, file: str) -> None:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.defined_in.setdefault(node.name, set()).add(file)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.functions.add(node.name)
        elif isinstance(node, ast.ClassDef):
            entry = names.classes.setdefault(node.name, {"bases": set(), "members": set()})
            entry["bases"].update(b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                                  if isinstance(b, (ast.Name, ast.Attribute)))
            entry["members"].update(class_members(node))
        else:
            names.module_names.update(assigned_names(node))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            names.parameters.update(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                names.local_names.update(assigned_names(inner))
                if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.local_names.add(inner.name)
        if isinstance(node, ast.ClassDef) and node.name == MINISGL_ENV[0]:
            names.environment.update(MINISGL_ENV[1] + m for m in class_level_names(node))
        elif isinstance(node, ast.ClassDef):
            names.environment.update(m for m in class_level_names(node) if m.startswith("SGLANG_"))


def class_level_names(cls: ast.ClassDef) -> set[str]:
    return {n for node in cls.body for n in assigned_names(node)}


def class_members(cls: ast.ClassDef) -> set[str]:
    found = class_level_names(cls)
    found.update(n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    for node in ast.walk(cls):  # attributes set in methods: self.x = ..., self.x: T = ..., self.x += ...
        for target in targets_of(node):
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    found.add(t.attr)
    return found


def targets_of(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def assigned_names(node: ast.AST) -> set[str]:
    return {t.id for target in targets_of(node) for t in ast.walk(target) if isinstance(t, ast.Name)}


# ---- checking the map ----

def load_manifest(path: Path = MANIFEST) -> dict[str, Names]:
    data = json.loads(path.read_text())
    return {source: Names.from_json(names) for source, names in data["names"].items()}


def minisgl_names(root: Path = ROOT) -> Names:
    """minisgl's own names, read from the working tree (the package, its mechanisms, its files)."""
    names = collect(root, "minisgl", ["."])
    names.files = set(repository_files(root))
    names.module_names.add("minisgl")
    spec = importlib.util.spec_from_file_location("mechanisms", root / "minisgl" / "mechanisms.py")
    mechanisms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mechanisms)  # plain Python, no torch
    names.module_names.update(mechanisms.MECHANISMS)
    return names


def repository_files(root: Path) -> Iterator[str]:
    """The repository's files and folders, without hidden ones (.git, .venv) and caches."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"]
        here = Path(folder).relative_to(root)
        yield from ((here / name).as_posix() for name in subfolders + files)


def column_source(header: str) -> str | None:
    header = header.strip().lower()
    if header.startswith("mini-sglang"):
        return "mini-sglang"
    return "sglang" if header.startswith("sglang") else None


def spans(text: str) -> list[tuple[int, str | None, str]]:
    """(line number, source of its table column or None, backticked text) for every code span."""
    found, columns = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            columns = None
            found += [(number, None, code) for code in CODE.findall(line)]
            continue
        cells = line.strip().strip("|").split("|")
        if columns is None:  # a header row starts a table
            columns = [column_source(c) for c in cells]
            continue
        for i, cell in enumerate(cells):
            source = columns[i] if i < len(columns) else None
            found += [(number, source, code) for code in CODE.findall(cell)]
    return found


def candidate(code: str) -> tuple[str, str] | None:
    """(kind, text) to check for one code span: ("name", dotted name), ("path", p), ("commit", id)."""
    code = code.strip()
    if HEX.fullmatch(code) and re.search(r"\d", code) and re.search(r"[a-f]", code):
        return ("commit", code)
    if code.startswith("--") and NAME.fullmatch(code[2:].replace("-", "_")):
        return ("name", code[2:].replace("-", "_"))
    if "=" in code and NAME.fullmatch(code.split("=", 1)[0]):  # VAR=1, argument="value"
        return ("name", code.split("=", 1)[0])
    if PATH.fullmatch(code) and ("/" in code or code.endswith((".py", ".md"))):
        return ("path", code)
    head = re.sub(r"\[[^\]]*\]", "", code.split("(", 1)[0]).rstrip(".")
    if code.count("(") == code.count(")") and DOTTED.fullmatch(head) and (code == head or code[len(head)] in "(["):
        return ("name", head)
    return None


def problem(source: str | None, code: str, upstream: dict[str, Names], own: Names) -> str | None:
    """What is wrong with one code span of the map (None: nothing, or not a name): `source` is the
    code base of its table column, None outside those columns."""
    found = candidate(code)
    if found is None:
        return None
    kind, value = found
    if kind == "commit":
        return None if len(value) == 40 else f"`{value}` is a short commit id: give all 40 characters"
    pool = [upstream[source]] if source else [own, *upstream.values()]
    if kind == "path":
        ok = any(n.has_path(value) for n in pool)
    else:
        ok = value in NAMED_ELSEWHERE and source != "mini-sglang" or any(n.resolves(value) for n in pool)
    where = {"sglang": "SGLang", "mini-sglang": "mini-SGLang", None: "minisgl, SGLang or mini-SGLang"}[source]
    return None if ok else f"`{value}` is not defined in {where} at the pinned version"


def file_problems(text: str, upstream: dict[str, Names]) -> list[tuple[int, str]]:
    """(line number, problem) for every name written right after a file that defines it elsewhere:
    in a `SGLang...` or `mini-SGLang...` column against that code base, elsewhere against either."""
    found, columns = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            columns, cells, sources = None, [line], [None]
        else:
            cells = line.strip().strip("|").split("|")
            if columns is None:
                columns = [column_source(c) for c in cells]
                continue
            sources = [columns[i] if i < len(columns) else None for i in range(len(cells))]
        for cell, source in zip(cells, sources):
            for path, code in FILE_CLAIM.findall(cell):
                kind_name = candidate(code)
                if kind_name is None or kind_name[0] != "name":
                    continue
                files = {f for s in ([source] if source else upstream) for f in upstream[s].files_defining(kind_name[1])}
                if files and not any(f == path or f.endswith("/" + path.strip("/")) for f in files):
                    found.append((number, f"`{kind_name[1]}` is not defined in {path} but in {', '.join(sorted(files)[:3])}"))
    return found


def check_text(text: str, upstream: dict[str, Names], own: Names) -> list[str]:
    """Problems (`line N: ...`) for every span that names nothing at the pinned versions, or names
    it in the wrong file."""
    found = [(number, problem(source, code, upstream, own)) for number, source, code in spans(text)]
    found = sorted([(number, p) for number, p in found if p] + file_problems(text, upstream), key=lambda f: f[0])
    return [f"line {number}: {p}" for number, p in found]


def scan() -> list[str]:
    upstream, own = load_manifest(), minisgl_names()
    problems = []
    for path in MAP_FILES:
        problems += [f"{path.relative_to(ROOT)} {p}" for p in check_text(path.read_text(), upstream, own)]
    return problems


def build(parents: dict[str, Path]) -> dict:
    """The manifest: for each source, the names defined in the part of it that `SOURCES` reads."""
    names = {s: collect(parents[s], SOURCES[s]["package"], SOURCES[s]["read"], prefix="python/").to_json()
             for s in SOURCES}
    return {"about": "Names defined at the pinned versions of SGLang and mini-SGLang, read with ast by "
                     "`python -m minisgl.course.upstream_map build` (its docstring says how).",
            "sources": SOURCES, "names": names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the manifest from local copies of the sources")
    b.add_argument("--sglang", type=Path, required=True, help="the folder holding the package sglang/: "
                   "an unpacked wheel, or a checkout's python/")
    b.add_argument("--mini-sglang", type=Path, required=True, help="the folder holding minisgl/: a checkout's python/")
    sub.add_parser("check", help="check the map files against the manifest")
    args = parser.parse_args(argv)
    if args.command == "build":
        parents = {"sglang": args.sglang, "mini-sglang": args.mini_sglang}
        for source, parent in parents.items():
            if not (parent / SOURCES[source]["package"]).is_dir():
                parser.error(f"--{source}: no {SOURCES[source]['package']}/ package in {parent}")
        manifest = build(parents)
        MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        print(f"wrote {MANIFEST.relative_to(ROOT)}")
        return 0
    problems = scan()
    print("\n".join(problems) if problems else "map: every SGLang and mini-SGLang name resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
