"""The messages a student sees: a failed test's rule in its test file's own words (TestTexts).

They are built from the test files' text only: a failure is shown as the message the test wrote
for it, with the values the run put in shown only where they are numbers or strings of the test
file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

EXCEPTION_NAME = re.compile(r"[A-Za-z_][\w.]{0,80}")  # an exception's type, as a rule may name it
Template = tuple[str | None, ...]  # a failure message as a test writes it: its text, None where it puts a value in
MAX_TEMPLATES = 64  # the messages one expression can give (each choice, x if c else y, doubles them)
SHOWN_VALUE = re.compile(r"[-+]?\d+(\.\d+)?|True|False|None")  # a value of a message shown as it came


def _templates(expr: ast.expr, names: dict[str, ast.expr]) -> list[Template]:
    """The messages an expression of a test can give: a string; an f-string, whose values are
    holes, except a name of the file bound to a message (`{RULE}`); such a name; a sum or a choice
    (`x if c else y`) of these. Anything else is one hole."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [(expr.value,)]
    if isinstance(expr, ast.Name) and expr.id in names:
        inner = dict(names)
        return _templates(inner.pop(expr.id), inner)  # each name read once: no loop through names
    if isinstance(expr, ast.FormattedValue) and expr.conversion == -1 and expr.format_spec is None:
        return _templates(expr.value, names)
    if isinstance(expr, ast.JoinedStr):
        found: list[Template] = [()]
        for value in expr.values:
            found = [a + b for a in found for b in _templates(value, names)][:MAX_TEMPLATES]
        return found
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return [a + b for a in _templates(expr.left, names) for b in _templates(expr.right, names)][:MAX_TEMPLATES]
    if isinstance(expr, ast.IfExp):
        return (_templates(expr.body, names) + _templates(expr.orelse, names))[:MAX_TEMPLATES]
    return [(None,)]


def _messages(node: ast.AST) -> list[ast.expr]:
    """The failure messages written under `node`: `assert x, MESSAGE`, `raise SomeError(MESSAGE, ...)`
    and `pytest.fail(MESSAGE)`."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert) and sub.msg is not None:
            found.append(sub.msg)
        elif isinstance(sub, ast.Raise) and isinstance(sub.exc, ast.Call) and sub.exc.args:
            found.append(sub.exc.args[0])
        elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "fail"
              and sub.args):
            found.append(sub.args[0])
    return found


def _bound_once(nodes: list[ast.AST]) -> dict[str, ast.expr]:
    """Names assigned exactly once among `nodes` (`RULE = "..."`), with their values: a name bound
    twice could hold either, and stays a hole."""
    bound: dict[str, list[ast.expr]] = {}
    for node in nodes:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(node.value)
    return {name: values[0] for name, values in bound.items() if len(values) == 1}


def _words(text: str) -> str:
    return " ".join(text.split())


class TestTexts:
    """The failure messages of each test function (and of its module's helpers), as the test files
    write them: the only text a student's rule may show. A rule is the message the student saw,
    with each value in it shown only where it is a number or a string of the test file (anything
    else, which the checked code could have put there, shows as `…`)."""

    def __init__(self, tests_dirs: list[Path]):
        # file -> (its templates, its strings, test name -> (the test's templates, its docstring's first paragraph))
        self._by_file: dict[str, tuple[list[Template], set[str], dict[str, tuple[list[Template], str]]]] = {}
        for folder in tests_dirs:
            for path in folder.glob("test_*.py"):
                tree = ast.parse(path.read_text())
                names = _bound_once(tree.body)
                strings = {_words(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                           and isinstance(n.value, str)}
                functions, everywhere = {}, []
                for node in tree.body:
                    own = dict(names, **_bound_once(list(ast.walk(node)))) if isinstance(node, ast.FunctionDef) \
                        else names
                    found = [t for message in _messages(node) for t in _templates(message, own)]
                    everywhere += found
                    if isinstance(node, ast.FunctionDef):
                        functions[node.name] = (found, (ast.get_docstring(node) or "").split("\n\n")[0])
                self._by_file[path.name] = (everywhere, strings, functions)

    def rule(self, nodeid: str, message: str, exception: str) -> str:
        """The test's own words for this failure: the message it wrote that the failure holds (its
        own messages before its file's helpers'), else its docstring's first paragraph, else its
        name; and the exception's type when it is not an assert."""
        file, _, name = nodeid.partition("::")
        name = name.split("[")[0]
        everywhere, strings, functions = self._by_file.get(Path(file).name, ([], set(), {}))
        templates, doc = functions.get(name, ([], ""))
        words = _words(message)
        said = next((best for group in (templates, everywhere) if (best := max(
            (r for r in (_render(t, words, strings) for t in group) if r), default=None))), None)
        # the test's name states its rule too: test_a_row_is_freed_at_once -> "a row is freed at once"
        said_text = said[1] if said else _words(doc) or name.removeprefix("test_").replace("_", " ")
        raised = exception if EXCEPTION_NAME.fullmatch(exception or "") and exception != "AssertionError" else ""
        return f"{name}: {said_text}" + (f" (raised {raised})" if raised else "")


def _render(template: Template, words: str, strings: set[str]) -> tuple[int, str] | None:
    """Where `words` (a failure, whitespace collapsed) holds the template's text, in order: how
    much text matched and the template's sentence, each hole shown as the failure fills it if that
    is a number or a string of the test file, else as `…`. None if the text is not all there (or
    is under 12 characters: too little to tell one message from another)."""
    parts: list[str | None] = []
    for part in template:  # adjacent texts, and adjacent holes, are one
        if part is not None and parts and parts[-1] is not None:
            parts[-1] += part
        elif part is not None or not parts or parts[-1] is not None:
            parts.append(part)
    found, pos, matched = [], 0, 0  # found: (start, end) of each text part in words
    for part in parts:
        text = _words(part) if part is not None else ""
        start = words.find(text, pos) if text else pos
        if start < 0:
            return None
        found.append((start, start + len(text)))
        pos, matched = start + len(text), matched + len(text)
    if matched < 12:
        return None
    shown = []
    for i, part in enumerate(parts):
        if part is not None:
            shown.append(part)
            continue
        value = words[found[i - 1][1] if i else 0:found[i + 1][0] if i + 1 < len(parts) else len(words)].strip()
        if i == 0:  # the exception's name before the message
            value = re.sub(r"^[A-Za-z_][\w.]*: ", "", value)
        if i == len(parts) - 1:  # pytest's explanation of the assert after it
            value = value.split(" assert ")[0]
        shown.append(value if SHOWN_VALUE.fullmatch(value) or _words(value).strip("'\"") in strings else "…")
    return matched, _words("".join(shown))
