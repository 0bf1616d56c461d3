"""No module global of minisgl is assigned from outside its module, read from the source with `ast`.

A knob that a test or a benchmark overwrites (`fused_ops.ENABLED = False`) changes every engine of
the process, outlives the test that set it, and is invisible to `EngineConfig`: settings are passed
in instead (an `EngineConfig` field, a constructor argument). Scanned: minisgl/, tests/,
benchmarks/, lessons/. Caught, where `mod` names an imported minisgl module:

- `mod.NAME = ...` (also `+=`, `del mod.NAME`, and `a.b.NAME = ...` on the dotted module path);
- `setattr(mod, ...)`, `monkeypatch.setattr(mod, ...)`, `delattr(...)`;
- `monkeypatch.setattr("minisgl.x.NAME", ...)` and `mock.patch("minisgl.x.NAME", ...)`.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("minisgl", "tests", "benchmarks", "lessons")
SETTERS = {"setattr", "delattr", "patch", "object"}  # setattr(), monkeypatch.setattr(), mock.patch(.object)()


@cache
def is_minisgl_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return dotted.split(".")[0] == "minisgl" and (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file())


def package_of(path: Path) -> str:
    """The dotted package a file's relative imports start from ('' outside minisgl/)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[0] == "minisgl" else ""


def module_aliases(tree: ast.AST, path: Path) -> dict[str, str]:
    """Local name -> the minisgl module it is bound to by an import in this file."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and is_minisgl_module(alias.name):
                    aliases[alias.asname] = alias.name
                elif alias.name.split(".")[0] == "minisgl":
                    aliases["minisgl"] = "minisgl"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = package_of(path).split(".")
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if is_minisgl_module(f"{base}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def dotted_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def module_of(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The minisgl module an expression names (`fused_ops`, `minisgl.gpu.fused_ops`), or None."""
    name = dotted_name(node)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    if head not in aliases:
        return None
    full = aliases[head] + (f".{rest}" if rest else "")
    return full if is_minisgl_module(full) else None


def assignments_in(path: Path, source: str | None = None) -> list[str]:
    """'file:line  module.NAME' for each assignment to a global of a minisgl module other than this file's."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    aliases = module_aliases(tree, path)
    own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    found = []

    def report(node: ast.AST, module: str, attr: str) -> None:
        if module != own:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}  {module}.{attr}")

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in [t for tt in targets for t in (tt.elts if isinstance(tt, ast.Tuple) else [tt])]:
            if isinstance(target, ast.Attribute) and (module := module_of(target.value, aliases)):
                report(node, module, target.attr)
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called not in SETTERS:
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("minisgl."):
                module, _, attr = first.value.rpartition(".")
                report(node, module, attr)
            elif (module := module_of(first, aliases)) and len(node.args) > 1:
                attr = node.args[1].value if isinstance(node.args[1], ast.Constant) else "?"
                report(node, module, str(attr))
    return found


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py"))


def test_the_scanner_catches_every_form():
    """Each form the scanner claims to catch is caught, and an instance's attribute is not."""
    sample = (
        "import minisgl.gpu.fused_ops as fo\n"
        "import minisgl\n"
        "from minisgl.gpu import flashinfer_backend\n"
        "from minisgl import config\n"
        "fo.ENABLED = False\n"
        "minisgl.gpu.fused_ops.ENABLED = False\n"
        "flashinfer_backend.LIMIT += 1\n"
        "def t(monkeypatch):\n"
        "    monkeypatch.setattr(config, 'free_memory_bytes', None)\n"
        "    monkeypatch.setattr('minisgl.config.free_memory_bytes', None)\n"
        "    setattr(fo, 'ENABLED', True)\n"
        "    engine = object()\n"
        "    engine.ENABLED = False\n"
        "    monkeypatch.setattr(engine, 'forward', None)\n")
    found = assignments_in(ROOT / "tests" / "sample.py", sample)
    assert [line.split("  ")[1] for line in found] == [
        "minisgl.gpu.fused_ops.ENABLED", "minisgl.gpu.fused_ops.ENABLED", "minisgl.gpu.flashinfer_backend.LIMIT",
        "minisgl.config.free_memory_bytes", "minisgl.config.free_memory_bytes", "minisgl.gpu.fused_ops.ENABLED"]


def test_no_module_global_is_assigned_from_outside():
    found = [line for path in scanned_files() for line in assignments_in(path)]
    assert not found, "minisgl module globals assigned from outside their module (pass a setting):\n" + "\n".join(found)
