"""What the package's own files bind and reach, read from their source (PackageNames): the names
a region may find bare, the package modules it may import from, and the functions and classes it
may not import because their code reaches outside the engine. region_policy.py holds a region's
names and imports to these."""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

from minisgl.course.catalog import EXERCISES
from minisgl.course.markers import regions
from minisgl.course.region_policy_lists import (ALLOWED_IMPORTS, COMPUTING_SOURCES, DENIED_ATTRIBUTES, HARMLESS_SOURCES,
                                                REACHING_BUILTINS)

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the package whose regions are checked


class PackageNames:
    """What the package's files bind at their top level, read from their source: the names a region
    may find there bare (its file's globals) and the package modules it may import from."""

    def __init__(self, package: Path):
        self.package = package
        self.defined: dict[str, set[str]] = {}  # module path (a/b.py) -> names it defines (class, def, =)
        self.imported: dict[str, set[str]] = {}  # module path -> names it binds by import
        self.classes: set[str] = set()  # names of the package's classes (and classes it imports)
        self.foreign: set[str] = set()  # names bound to modules, or imported from modules not harmless
        self.modules: set[str] = set()  # names bound to modules (`import x`, `from . import module`)
        self.literals: dict[str, set[str]] = {}  # module path -> its constants whose values are literals
        self.variables: dict[str, set[str]] = {}  # module path -> the names its top level assigns
        self.origins: dict[str, dict[str, tuple[str, str]]] = {}  # module path -> name -> (package file, name)
        trees = dict(_parsed_modules(package))  # module path (a/b.py) -> its tree, parsed once for both passes
        # every name the package's own code spells (its globals, its functions' parameters and locals):
        # a region whose file is not known may name nothing else that it does not bind itself
        self.spelled: set[str] = {name for tree in trees.values() for name in bound_or_named(tree)}
        # every attribute name the package's own code uses: its objects' fields and methods
        self.attributes: set[str] = {n.attr for tree in trees.values() for n in ast.walk(tree)
                                     if isinstance(n, ast.Attribute)}
        self.attributes |= {name for tree in trees.values() for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                            for node in cls.body for name in _class_member_names(node)}  # fields, methods
        # the methods (and properties) of the package's classes that its code never assigns as a field
        # anywhere: a region may call them, never replace them (a name that is a field elsewhere, `rows`, stays)
        self.methods: set[str] = {node.name for tree in trees.values() for cls in ast.walk(tree)
                                  if isinstance(cls, ast.ClassDef) for node in cls.body
                                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))} - {
            n.attr for tree in trees.values() for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and not isinstance(n.ctx, ast.Load)}
        # region name -> (its file, the names its enclosing functions bind): the scope it runs in
        self.scopes: dict[str, tuple[str, set[str]]] = dict(_region_scopes(trees))
        for rel, tree in trees.items():
            path = self.package / rel
            defined, imported = self.defined.setdefault(rel, set()), self.imported.setdefault(rel, set())
            literals, variables = self.literals.setdefault(rel, set()), self.variables.setdefault(rel, set())
            origins = self.origins.setdefault(rel, {})
            for node in _top_level(tree.body):
                if isinstance(node, ast.ClassDef):
                    defined.add(node.name)
                    self.classes.add(node.name)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    bound = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                    defined.update(bound)
                    variables.update(bound)
                    if node.value is not None and _is_literal(node.value):
                        literals.update(bound)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        bound = alias.asname or alias.name.split(".")[0]
                        imported.add(bound)
                        self.foreign.add(bound)
                        self.modules.add(bound)
                elif isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        bound = alias.asname or alias.name
                        imported.add(bound)
                        if node.level == 0 and (node.module or "").split(".")[0] != package.name:
                            if (node.module or "").split(".")[0] not in HARMLESS_SOURCES:
                                self.foreign.add(bound)
                            elif alias.name[:1].isupper():
                                self.classes.add(bound)
                        elif self.is_module(path.parent, node.level, node.module, alias.name):
                            self.foreign.add(bound)
                            self.modules.add(bound)
                        elif alias.name[:1].isupper():
                            self.classes.add(bound)
        for rel, tree in trees.items():  # what each file took from the package, for its regions' bare names
            for node in _top_level(tree.body):
                if isinstance(node, ast.ImportFrom):
                    self.origins[rel].update(self._imports(node, self.package / rel)[0])
        self.foreign -= ALLOWED_IMPORTS  # `import torch` in a file: a region may use torch.name
        self.modules -= ALLOWED_IMPORTS
        self.unsafe = self._unsafe_definitions(trees)

    def _unsafe_definitions(self, trees: dict[str, ast.Module]) -> dict[str, set[str]]:
        """module path -> its top-level functions and classes whose code reaches outside the engine:
        a name its module took from outside the harmless modules (`Path`, `json`, argparse's parser,
        which opens `@file` arguments), an import inside it of such a module, a denied builtin (`open`)
        or attribute (`.write_text`), or a function or class of the package that does (imported at the
        top or inside it). A region may not import these (`write_chrome_trace(spans, path)` writes a file)."""
        uses: dict[tuple[str, str], tuple[bool, set[tuple[str, str]]]] = {}
        for rel, tree in trees.items():
            path = self.package / rel
            origin: dict[str, tuple[str, str]] = {}  # a name imported from the package -> (module, name)
            foreign: set[str] = set()  # names from any module that is neither harmless nor the package
            for node in _top_level(tree.body):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    imported, reaching = self._imports(node, path)
                    origin.update(imported)
                    foreign |= reaching
            top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            for node in tree.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                bad, calls = False, set()
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):  # an import inside the function
                        imported, reaching = self._imports(sub, path)
                        calls.update(imported.values())
                        bad = bad or bool(reaching)
                    elif isinstance(sub, ast.Name):
                        if sub.id in foreign or sub.id in REACHING_BUILTINS:
                            bad = True
                        elif sub.id in origin:
                            calls.add(origin[sub.id])
                        elif sub.id in top and sub.id != node.name:
                            calls.add((rel, sub.id))
                    elif isinstance(sub, ast.Attribute) and sub.attr in DENIED_ATTRIBUTES:
                        bad = True
                uses[(rel, node.name)] = (bad, calls)
        unsafe = {key for key, (bad, _) in uses.items() if bad}
        grew = True
        while grew:
            grew = False
            for key, (_, calls) in uses.items():
                if key not in unsafe and calls & unsafe:
                    unsafe.add(key)
                    grew = True
        found: dict[str, set[str]] = {}
        for rel, name in unsafe:
            found.setdefault(rel, set()).add(name)
        return found

    def _imports(self, node: ast.Import | ast.ImportFrom, path: Path) -> tuple[dict[str, tuple[str, str]], set[str]]:
        """What an import statement of the file at `path` binds: the names it takes from the package
        (name -> (module path, name)), and the names it takes from any other module not harmless."""
        if isinstance(node, ast.Import):
            return {}, {a.asname or a.name.split(".")[0] for a in node.names
                        if a.name.split(".")[0] not in COMPUTING_SOURCES | {self.package.name}}
        top = (node.module or "").split(".")[0]
        if node.level == 0 and top != self.package.name:
            return {}, (set() if top in COMPUTING_SOURCES else {a.asname or a.name for a in node.names})
        files = self.candidates(node.level, node.module, path.parent) if node.level else \
            self.candidates(1, ".".join((node.module or "").split(".")[1:]) or None)
        return ({a.asname or a.name: (files[0], a.name) for a in node.names} if files else {}), set()

    def is_module(self, folder: Path, level: int, module: str | None, name: str) -> bool:
        """Whether `from <level dots><module> import name` in a file of `folder` names a module."""
        base = folder
        for _ in range(max(level - 1, 0)):
            base = base.parent
        target = base.joinpath(*(module or "").split(".")) if module else base
        return (target / f"{name}.py").exists() or (target / name / "__init__.py").exists()

    def candidates(self, level: int, module: str | None, folder: Path | None = None) -> list[str]:
        """The files of the package that `from <level dots><module> import ...` may mean, from
        `folder` or else from any folder of the package (a region does not say which file it is in)."""
        found = []
        folders = {folder} if folder is not None else {self.package,
                                                       *(p.parent for p in self.package.rglob("__init__.py"))}
        for folder in sorted(folders):
            base = folder
            for _ in range(level - 1):
                base = base.parent
            if not base.is_relative_to(self.package):
                continue
            target = base.joinpath(*module.split(".")) if module else base
            for path in (target.with_name(target.name + ".py"), target / "__init__.py"):
                if path.is_file() and path.is_relative_to(self.package):
                    found.append(path.relative_to(self.package).as_posix())
        return sorted(set(found))


def _is_literal(node: ast.expr) -> bool:
    """A constant, or a tuple, list, set or dict of them (a region may import such a constant)."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_literal(k) for k in node.keys) and all(_is_literal(v) for v in node.values)
    return isinstance(node, ast.UnaryOp) and _is_literal(node.operand)


def _class_member_names(node: ast.stmt) -> set[str]:
    """The names one statement of a class body gives the class: a method, a nested class, a field."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _region_scopes(trees: dict[str, ast.Module]):
    """(region name, (its file, the names the functions around it bind or read)) for every region:
    their parameters and locals, and the names they read that an earlier region binds (`written`,
    which exercise 5's region assigns and the code after exercise 4's reads), are what the region
    may find bare besides its file's globals."""
    for rel, tree in trees.items():
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for lineno, name in getattr(tree, "region_lines", ()):
            around = [f for f in functions if f.lineno < lineno <= f.end_lineno]
            yield name, (rel, {n for f in around for n in bound_or_named(f)})


def bound_or_named(tree: ast.AST, loaded: bool = True):
    """Every name `tree` binds (assigned, a parameter, a function, an import, an exception or match
    name) and, if `loaded`, every name it reads bare."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if loaded or not isinstance(node.ctx, ast.Load):
                yield node.id
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.alias):
            yield node.asname or node.name.split(".")[0]
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            yield node.name
        elif isinstance(node, ast.MatchMapping) and node.rest:
            yield node.rest


def _parsed_modules(package: Path):
    """(module path a/b.py, its tree) for each file of the package that parses, each exercise
    region's body left out."""
    for path in sorted(package.rglob("*.py")):
        try:
            source = _without_regions(path.read_text(encoding="utf-8"))
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        tree.region_lines = [(r.first + 2, r.name) for r in regions(source.splitlines())]  # its `pass`, 1-based
        yield path.relative_to(package).as_posix(), tree


def _without_regions(source: str) -> str:
    """The source with the catalog's stub as each exercise region's body (`pass` where it has none):
    what the package names and reaches is then the same in the teacher's checkout and in any
    student's edition, and a name a stub binds for the code after it (exercise 5's `written`) is
    in its function's scope."""
    lines = source.splitlines(keepends=True)
    for region in reversed(regions(lines)):
        stub = EXERCISES[region.number].stubs.get(region.name) if region.number in EXERCISES else None
        body = textwrap.indent(textwrap.dedent(stub).strip("\n") + "\n", region.indent) if stub else \
            f"{region.indent}pass\n"
        lines[region.first + 1:region.last] = [body]
    return "".join(lines)


def _top_level(body: list[ast.stmt]):
    """A module's top-level statements, those under `if`/`try` included (TYPE_CHECKING imports)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers
                                                                             for s in h.body])


@functools.lru_cache(maxsize=4)
def package_names(package: Path = PACKAGE_DIR) -> PackageNames:
    return PackageNames(package)

