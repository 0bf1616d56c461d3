"""What the code between an exercise's markers may reach, checked before it runs.

The grader runs a submission's region code inside the process that runs the exercise's tests, so
code that reached the interpreter (its modules, frames, files, processes) could rewrite the test
report or read files it must not. No exercise needs any of that: a region works on the engine's
own objects (`self`, the batch, tensors). So a region may not import anything but a few harmless
modules, name a dunder or a builtin that reaches the interpreter, or use an attribute that leads to
the file system, the process or the interpreter. A region that does is not run; its exercise gets
no marks, with the rule it broke.

This is a check on the source, not a sandbox: the judge (judge.py) still runs every check in a
fresh process in a throw-away copy, and trusts no report the child could forge.
"""

from __future__ import annotations

import ast
import textwrap

ALLOWED_IMPORTS = frozenset({"torch", "copy", "math", "time", "itertools", "functools", "collections",
                             "heapq", "bisect"})
DENIED_NAMES = frozenset({
    # builtins that reach the interpreter, its objects by name, or the files
    "eval", "exec", "compile", "open", "getattr", "setattr", "delattr", "globals", "locals", "vars", "dir",
    "breakpoint", "input", "help", "memoryview", "type", "object", "super", "exit", "quit", "classmethod",
    "staticmethod", "property",
    # modules a file of the package may have imported
    "os", "sys", "subprocess", "gc", "inspect", "ctypes", "importlib", "builtins", "signal", "socket", "shutil",
    "pathlib", "Path", "io", "pickle", "marshal", "faulthandler", "multiprocessing", "tempfile", "threading",
    "pytest", "_pytest", "runpy", "atexit", "resource", "weakref", "traceback", "linecache", "site", "typing",
    "operator", "logging", "json", "contextlib", "dataclasses",
})
DENIED_ATTRIBUTES = frozenset({
    # the interpreter and its frames
    "os", "sys", "modules", "builtins", "f_globals", "f_locals", "f_back", "f_code", "tb_frame", "tb_next",
    "gi_frame", "gi_code", "cr_frame", "ag_frame", "mro", "format", "format_map", "settrace", "setprofile",
    "attrgetter", "methodcaller", "get_type_hints", "environ", "putenv",
    # processes
    "system", "popen", "fork", "forkpty", "kill", "killpg", "setsid", "spawnv", "execv", "execve", "Thread",
    "Process", "Popen",
    # files
    "open", "load", "loads", "save", "dump", "dumps", "tofile", "fromfile", "from_file", "memmap", "savetxt",
    "savez", "loadtxt", "write_text", "write_bytes", "read_text", "read_bytes", "unlink", "rmdir", "rmtree",
    "rename", "chmod", "symlink", "mkdir", "makedirs", "export_chrome_trace", "export_stacks",
    # torch's doors to compiled code, other processes and files
    "ops", "library", "utils", "hub", "jit", "compile", "serialization", "multiprocessing", "distributed",
    "package", "testing", "fx", "overrides", "export", "classes", "profiler", "autograd", "onnx", "np",
    "numpy", "import_module",
})
DENIED_NODES = (ast.Global, ast.Nonlocal, ast.ClassDef, ast.AsyncFunctionDef, ast.Await)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def region_problems(code: str) -> list[str]:
    """Why the code of one region may not run, one short rule each (empty: it may)."""
    try:
        tree = ast.parse("def region():\n" + textwrap.indent(code or "pass\n", "    "))
    except SyntaxError as exc:
        return [f"not valid Python (line {max((exc.lineno or 2) - 1, 1)})"]
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, DENIED_NODES):
            problems.append(f"a region may not use `{type(node).__name__.lower()}`")
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # the package's own modules
            names = [node.module or "", *(alias.name for alias in node.names)]
            problems += [f"a region may not import `{name}` from the package" for name in names
                         if name.split(".")[0] in DENIED_NAMES | {"course"} or _is_dunder(name) or name == "*"]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or "."]
            problems += [f"a region may import only {', '.join(sorted(ALLOWED_IMPORTS))} (or from the package), "
                         f"not `{m}`" for m in modules if m.split(".")[0] not in ALLOWED_IMPORTS or "." in m]
        elif isinstance(node, ast.Name) and (node.id in DENIED_NAMES or _is_dunder(node.id)):
            problems.append(f"a region may not use the name `{node.id}` (it reaches outside the engine)")
        elif isinstance(node, ast.Attribute):
            if _is_dunder(node.attr) or node.attr in DENIED_ATTRIBUTES:
                problems.append(f"a region may not use the attribute `.{node.attr}` (it reaches outside the engine)")
            elif node.attr.startswith("_") and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                problems.append(f"a region may use a private attribute only on `self`, not `.{node.attr}`")
    return list(dict.fromkeys(problems))
