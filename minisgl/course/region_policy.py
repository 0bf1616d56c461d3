"""What the code between an exercise's markers may reach, checked before it runs.

The grader runs a submission's region code inside the process that runs the exercise's tests, so
code that reached the interpreter (its modules, frames, files, processes) could rewrite the test
report, change what the tests call, or read and write files it must not. No exercise needs any
of that: a region works on the engine's own objects (`self`, the batch, tensors), calls torch and
a few harmless modules, and makes or reads the package's classes. So a region is held to this:

- names: only those the region binds, its enclosing functions bind (parameters, locals), its file
  binds at the top level, or a builtin has: the scope it runs in, so a name the module gets from
  outside (planted in its globals, a package's submodule bound by the import system) is never
  reached; no dunder; of the builtins only the harmless ones (no setattr, vars, open, ...), and two
  only in their harmless form: `getattr(obj, "name"[, default])` with the name written out (read
  as `obj.name`, under the attribute rules) and `type(x)` in a comparison (`type(x) is T`; a call
  of it would make classes); no module or foreign object that a file of the package imported
  (`os`, `gc`, `Path`, ...);
- attributes: no dunder, no private one except on `self`, none on the deny lists below, and
  every name a region may not use bare is an attribute it may not use either (`cfg.gc`,
  `torch.os`, `x.getattr`);
- imports: `import M` of a few harmless modules, of which a region may use only the names
  MODULE_NAMES lists (of torch: tensors, dtypes, their functions, CUDA's events and streams);
  `from M import NAME` with NAME held to the attribute rules; of dataclasses only `replace`
  (its `make_dataclass` makes classes, `fields` hands out factories); from the package only a
  class or function it defines itself whose code stays in the engine, or a constant of plain
  values (`from .grammar import TokenMask`), never a module (`from . import config`), an object
  (a Path, a console), nor what a module of the package imported;
- attributes: only those the package's own code uses, a builtin type's methods, and the tensor
  and stream methods TENSOR_METHODS lists (then the deny list);
- attributes that reach files through objects a region can get from `self` (a Hugging Face
  config's from_dict and to_json_file, a Path's links, nn.Module's lookups by name) are denied,
  and so is any attribute named like a path (`*_path`, `*_dir`, `*_file`);
- modules stay put: a module is used only as `module.name` (never stored, passed or returned),
  what a module holds is never assigned or deleted (`torch.equal = ...`), a name that resolves to
  a module is never handed around (`m = torch.cuda`);
- classes stay put: a class of the package or of a module is only called, read from, compared,
  subscripted, raised, caught or given to isinstance/issubclass (`BatchView.snapshot = ...` and
  `c = BatchView` are refused); a type hint may name any class or module;
- no `global`, `nonlocal`, class definition, async code, nor a keyword DENIED_KEYWORDS names
  (`file=`, `cdata=`, `out=`, `stream_id=`; `**keywords`, whose names go unchecked);
- `self` is the method's own: never bound in a region (a parameter or variable of that name would
  open any object's private attributes); no method of the package's classes and no switch of the
  tests (`check_each_step`) is assigned or deleted on an object.

A region that breaks a rule is not run; its exercise gets no marks, with the rule it broke. The
student's checker (`course exercise N`) applies the same rules first, with the same message
(`refusal`); the package is read with every region's body left out, so that the verdict does not
depend on what the other regions hold (the reference at the grader, a student's code at home).

This is a check on the source, not a sandbox: the judge (judge.py) still runs every check in a
fresh process in a throw-away copy, confined to that copy where the OS allows, and trusts no
report the child could forge.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import sys
import textwrap
import types
from pathlib import Path
from typing import Callable

from minisgl.course.region_policy_lists import (ALLOWED_IMPORTS, BUILTIN_METHODS, DENIED_ATTRIBUTES, DENIED_KEYWORDS,
                                                DENIED_NAMES, DENIED_NODES, MODULE_NAMES, NAMES_FROM, NARROWED,
                                                SAFE_BUILTINS, TENSOR_METHODS, TEST_SWITCHES)
from minisgl.course.region_policy_package import PACKAGE_DIR, bound_or_named, package_names

_MISSING = object()


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _resolve(root: str, attrs: list[str]):
    """The object `root.attrs...` names in this process (the one the child will see), or _MISSING."""
    try:
        obj = sys.modules.get(root) or importlib.import_module(root)
        for attr in attrs:
            obj = getattr(obj, attr)
        return obj
    except Exception:  # noqa: BLE001 - a name the module does not hold: the region fails at run time
        return _MISSING


def module_name_problem(module: str, name: str) -> str:
    """Why a region may not use `module.name` ('' where it may): a name outside the module's allow list."""
    allowed = MODULE_NAMES.get(module)
    if allowed is None or name in allowed:
        return ""
    what = " (tensors, their dtypes and functions, CUDA's events and streams)" if module.startswith("torch") else ""
    return (f"a region may not use `{module}.{name}`: of {module} a region may use only the names listed in "
            f"region_policy_lists.MODULE_NAMES{what}")


def _import_rule(name: str) -> str:
    """The import refused first, then what a region may import."""
    modules = sorted(ALLOWED_IMPORTS)
    names = "".join(f", {' and '.join(sorted(held))} from {module}" for module, held in NAMES_FROM.items())
    return (f"a region may not import `{name}` (only {', '.join(modules[:-1])} and {modules[-1]}{names}, and the "
            f"package's own classes and functions)")


class _PlainGetattr(ast.NodeTransformer):
    """getattr(obj, "name") read as obj.name, getattr(obj, "name", default) as `obj.name or
    default`: the attribute is then held to the attribute rules. A getattr with a computed name
    stays, and is refused."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        args = node.args
        if not (isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(args) in (2, 3)
                and not node.keywords and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
                and args[1].value.isidentifier()):
            return node
        read = ast.copy_location(ast.Attribute(args[0], args[1].value, ast.Load()), node)
        return read if len(args) == 2 else ast.copy_location(ast.BoolOp(ast.Or(), [read, args[2]]), node)


def region_problems(code: str, package: Path = PACKAGE_DIR, region: str | None = None) -> list[str]:
    """Why the code of one region may not run, one short rule each (empty: it may). `region`, its
    name, places it in its file and function: its bare names are then held to that scope."""
    try:
        tree = ast.parse("def region():\n" + textwrap.indent(code or "pass\n", "    "))
    except SyntaxError as exc:
        return [f"not valid Python (line {max((exc.lineno or 2) - 1, 1)})"]
    tree = _PlainGetattr().visit(tree)
    known = package_names(package)
    denied_everywhere = DENIED_NAMES | known.foreign
    denied_attributes = DENIED_ATTRIBUTES | DENIED_NAMES | known.modules
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    modules: dict[str, str] = {m: m for m in ALLOWED_IMPORTS}  # a name in the region -> the module it is
    classes = set(known.classes)
    problems: list[str] = []
    # A name the region does not bind, that no code of the package names and that no builtin has
    # would be a NameError, unless something put it in the module's globals: never reach it.
    bound_here = set(bound_or_named(tree, loaded=False))
    if region in known.scopes:  # the names its function and its file bind, as at run time
        rel, around = known.scopes[region]
        nameable = around | known.defined[rel] | known.imported[rel]
        # a global of the file, its own or taken from the package, is held to the rules of a
        # region's own `from . import`: no object (a Path, a console), no function that reaches files
        for name in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - bound_here - around:
            where, what = known.origins[rel].get(name, (rel, name))
            if what in known.variables.get(where, ()) and what not in known.literals[where]:
                problems.append(f"a region may not use `{name}`: an object of its file's globals, not a plain value "
                                f"(it may reach files or the interpreter)")
            elif what in known.unsafe.get(where, ()):
                problems.append(f"a region may not use `{name}` (its code reaches files, processes or the interpreter)")
    else:
        nameable = known.spelled
    nameable = nameable | bound_here | set(dir(builtins))

    def attribute_problem(attr: str) -> str | None:
        if _is_dunder(attr) or attr in denied_attributes:
            return f"a region may not use the attribute `.{attr}` (it reaches outside the engine)"
        if attr.endswith(("_path", "_dir", "_file", "_filename")):  # a Path reaches the file system
            return f"a region may not use the attribute `.{attr}` (a file's path: no exercise needs one)"
        return None

    # imports first: they decide which names are modules and classes
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ALLOWED_IMPORTS or "." in alias.name:
                    problems.append(_import_rule(alias.name))
                else:
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if module in NAMES_FROM:
                problems += [_import_rule(f"{module}.{a.name}") for a in node.names if a.name not in NAMES_FROM[module]]
                continue
            if module.split(".")[0] not in ALLOWED_IMPORTS or "." in module:
                problems.append(_import_rule(module))
                continue
            for alias in node.names:
                why = attribute_problem(alias.name) if alias.name != "*" else "a region may not import `*`"
                if why or alias.name.startswith("_"):
                    problems.append(why or f"a region may not import the private `{alias.name}`")
                    continue
                if module_name_problem(module, alias.name):
                    problems.append(module_name_problem(module, alias.name))
                    continue
                value = _resolve(module, [alias.name])
                if isinstance(value, types.ModuleType):
                    problems.append(f"a region may not import the module `{module}.{alias.name}` (use "
                                    f"`{module}.{alias.name}.NAME` after `import {module}`)")
                elif isinstance(value, type):
                    classes.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom):  # from the package
            for alias in node.names:
                name = alias.name
                files = known.candidates(node.level, node.module)
                parts = (node.module or "").split(".") + [name]
                if (name == "*" or any(_is_dunder(p) or p.startswith("_") or p in denied_everywhere | {"course"}
                                       for p in parts if p)):
                    problems.append(f"a region may not import `{name}` from the package")
                elif not files or any(name in known.imported[f] for f in files) or not any(
                        name in known.defined[f] for f in files):
                    problems.append(f"a region may import from the package only a class, function or constant that "
                                    f"a module defines, not `{name}` (a module, or what a module imported)")
                elif any(name in known.variables[f] and name not in known.literals[f] for f in files):
                    problems.append(f"a region may import from the package only classes, functions and constants of "
                                    f"plain values, not `{name}` (an object: it may reach files or the interpreter)")
                elif any(name in known.unsafe.get(f, ()) for f in files):
                    problems.append(f"a region may not import `{name}` from the package (its code reaches files, "
                                    f"processes or the interpreter)")
                elif name in known.classes:
                    classes.add(alias.asname or name)

    annotations = {id(n) for holder in ast.walk(tree) for part in (
        [holder.annotation] if isinstance(holder, (ast.AnnAssign, ast.arg)) and holder.annotation else
        [holder.returns] if isinstance(holder, (ast.FunctionDef, ast.Lambda)) and getattr(holder, "returns", None)
        else []) for n in ast.walk(part)}  # a type hint names a class or module without using it
    for node in ast.walk(tree):
        parent = parents.get(node)
        if isinstance(node, DENIED_NODES):
            problems.append(f"a region may not use `{type(node).__name__.lower()}`")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_dunder(node.value.strip()):
            problems.append(f"a region may not write a dunder name, even as a string (`{node.value.strip()}`)")
        elif isinstance(node, ast.keyword) and node.arg in DENIED_KEYWORDS:
            problems.append(f"a region may not pass `{node.arg}=` ({DENIED_KEYWORDS[node.arg]})" if node.arg else
                            f"a region may not pass **keywords ({DENIED_KEYWORDS[None]})")
        elif isinstance(node, ast.arg) and node.arg == "self" or isinstance(node, ast.Name) and node.id == "self" \
                and not isinstance(node.ctx, ast.Load):
            # `self` is the method's own: a parameter or variable of that name would open any
            # object's private attributes (the rule below spells them by that name)
            problems.append("a region may not bind the name `self` (a parameter, lambda argument or variable)")
        elif isinstance(node, ast.Name) and node.id not in nameable:
            problems.append(f"a region may not use the name `{node.id}`: neither the region, its function nor its "
                            f"file defines it (a module it needs: import it in the region; a name the module gets from outside is never reached)")
        elif isinstance(node, ast.Name):
            problems += _name_problems(node, parent, parents, modules, classes, denied_everywhere,
                                       hint=id(node) in annotations)
        elif isinstance(node, ast.Attribute):
            why = attribute_problem(node.attr)
            if why:
                problems.append(why)
            # A name read straight off an allowed module is MODULE_NAMES' to judge; one level further
            # (`torch.Tensor.new`, a class's attribute) it is held to the lists as on any object.
            elif _module_path(node.value, modules) not in MODULE_NAMES and node.attr not in (
                    known.attributes | TENSOR_METHODS | BUILTIN_METHODS):
                problems.append(f"a region may not use the attribute `.{node.attr}`: neither the engine's code, a "
                                f"tensor (region_policy_lists.TENSOR_METHODS) nor a builtin type has it")
            elif node.attr.startswith("_") and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                problems.append(f"a region may use a private attribute only on `self`, not `.{node.attr}`")
            elif not isinstance(node.ctx, ast.Load) and (node.attr in known.methods or node.attr in TEST_SWITCHES):
                # an engine method replaced on a live object (`self.kv_ledger.allocate = ...`), or the
                # tests' own audit switched off, changes what the tests see, not what the code does
                problems.append(f"a region may not assign or delete `.{node.attr}` (a method of the engine's "
                                f"classes, or a switch of the tests)")
    return list(dict.fromkeys(problems))


def refusal(bodies: dict[str, str], vet: Callable[..., list[str]] = region_problems) -> str:
    """Why an exercise's region code (region name -> code) may not run, in the one line that the
    grader records and the student's checker prints ('' where it may run)."""
    problems = list(dict.fromkeys(p for name, code in bodies.items() for p in vet(code, region=name)))
    return f"not run: {first_few(problems, '; ')}" if problems else ""


def first_few(items: tuple[str, ...] | list[str], separator: str, most: int = 3) -> str:
    """The first `most` items whole, joined by `separator`, and how many more: a line that is short
    and never cut mid-sentence (the refusal above; a cell of the grader's sheet, grade.py)."""
    more = f" (and {len(items) - most} more)" if len(items) > most else ""
    return separator.join(items[:most]) + more


def _module_path(node: ast.AST, modules: dict[str, str]) -> str | None:
    """The dotted name `node` reads from an imported module (`torch.cuda` for `torch.cuda`, with
    `import torch`), or None where it is not such a chain."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        above = _module_path(node.value, modules)
        return None if above is None else f"{above}.{node.attr}"
    return None


def _name_problems(node: ast.Name, parent: ast.AST | None, parents: dict, modules: dict[str, str],
                   classes: set[str], denied: frozenset[str] | set[str], hint: bool = False) -> list[str]:
    name = node.id
    if name == "type" and _compared_type(node, parent, parents):
        return []
    if name in NARROWED:
        return [f"a region may use `{name}` {NARROWED[name]}"]
    if name in denied or _is_dunder(name):
        return [f"a region may not use the name `{name}` (it reaches outside the engine)"]
    if hint:  # inside a type hint: named, never used
        return []
    if hasattr(builtins, name) and name not in SAFE_BUILTINS and not (
            name[:1].isupper() and isinstance(getattr(builtins, name), type)
            and issubclass(getattr(builtins, name), BaseException)):
        return [f"a region may not use the builtin `{name}`"]
    if name in modules:
        if not isinstance(node.ctx, ast.Load):
            return [f"a region may not rebind the module name `{name}`"]
        if not (isinstance(parent, ast.Attribute) and parent.value is node):
            return [f"a region may use the module `{name}` only as `{name}.NAME` (not store, pass or return it)"]
        chain, top = [], parent
        while isinstance(top, ast.Attribute):
            chain.append(top.attr)
            up = parents.get(top)
            if not (isinstance(up, ast.Attribute) and up.value is top):
                break
            top = up
        if not isinstance(top.ctx, ast.Load):
            return [f"a region may not change what a module holds (`{name}.{'.'.join(chain)}`)"]
        module = modules[name]
        for attr in chain:  # through the allowed modules (torch, then torch.cuda) to the object named
            if module not in MODULE_NAMES:
                break
            if module_name_problem(module, attr):
                return [module_name_problem(module, attr)]
            module = f"{module}.{attr}"
        value = _resolve(modules[name], chain)
        if isinstance(value, types.ModuleType):
            return [f"a region may use the module `{name}.{'.'.join(chain)}` only as `{name}.{'.'.join(chain)}.NAME`"]
        if isinstance(value, type) and not _class_use_ok(top, parents):
            return [f"a region may only call, read from or test with isinstance the class `{name}.{'.'.join(chain)}`"]
        return []
    if name in classes and (not isinstance(node.ctx, ast.Load) or not _class_use_ok(node, parents)):
        return [f"a region may only call, read from or test with isinstance the class `{name}`"]
    return []


def _compared_type(node: ast.Name, parent: ast.AST | None, parents: dict) -> bool:
    """type(x), one argument, as an operand of a comparison: the one use of `type` a region may
    make (a call of the class it gives, type(t)(name, bases, namespace), would make a class)."""
    return (isinstance(parent, ast.Call) and parent.func is node and len(parent.args) == 1 and not parent.keywords
            and not isinstance(parent.args[0], ast.Starred) and isinstance(parents.get(parent), ast.Compare))


def _class_use_ok(node: ast.expr, parents: dict) -> bool:
    """A class used as a value only to call it, read an attribute (not assign or delete it) or in
    isinstance/issubclass's second argument (a tuple of classes too)."""
    parent = parents.get(node)
    if (isinstance(parent, ast.Call) and parent.func is node) or (
            isinstance(parent, ast.ExceptHandler) and parent.type is node) or isinstance(parent, (ast.Raise,
                                                                                                 ast.Compare)):
        return True
    if isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load):
        return True  # SpanName["SAMPLE"], list[BatchView]
    if isinstance(parent, ast.Attribute) and parent.value is node:
        top = parent
        while isinstance(parents.get(top), ast.Attribute) and parents[top].value is top:
            top = parents[top]
        return isinstance(top.ctx, ast.Load)
    if isinstance(parent, ast.Tuple) and isinstance(parent.ctx, ast.Load):
        node, parent = parent, parents.get(parent)
        if isinstance(parent, ast.ExceptHandler) and parent.type is node:
            return True
    return (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
            and parent.func.id in ("isinstance", "issubclass") and parent.args[1:2] == [node])
