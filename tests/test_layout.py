"""The package's layering, read from the source with `ast` (nothing is imported).

Every import counts: at module level, inside functions (imported on first use) and under
`if TYPE_CHECKING:`, because each is a dependency a reader has to follow.

- no import circle anywhere in minisgl/;
- the lesson core (the modules at the top of minisgl/) imports nothing from `observe/`,
  `frontend/` or `features/`: it stands on its own; the features plug into its seams
  (seams.py), and the front end and the tools are built on it;
- `models/` is plain torch: nothing in it imports `gpu/`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minisgl"


def module_name(path: Path) -> str:
    parts = ("minisgl", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The minisgl modules that module `name` imports (a `from package import module` names the module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def find_cycle() -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(GRAPH):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_layout_parser_sees_known_imports():
    # Guards the checks below against a parser that finds nothing (they would all pass).
    assert "minisgl.engine" in GRAPH["minisgl.scheduler"]
    assert "minisgl.config" in GRAPH["minisgl.frontend.llm"]
    assert "minisgl.frontend.cli" in GRAPH["minisgl.__main__"]
    assert "minisgl.models.checkpoint" in GRAPH["minisgl.config"]  # imported inside a function


def test_no_import_circle():
    assert find_cycle() is None, f"import circle: {' -> '.join(find_cycle() or [])}"


def test_the_core_imports_no_feature_front_end_or_tool():
    core = [name for name, path in MODULES.items() if path.parent == PACKAGE and path.name != "__main__.py"
            and name != "minisgl"]
    assert "minisgl.scheduler" in core and "minisgl.engine" in core and "minisgl.features.grammar" in MODULES
    wrong = {name: sorted(t for t in GRAPH[name] if t.startswith(("minisgl.observe", "minisgl.frontend",
                                                                     "minisgl.features")))
             for name in core}
    assert not {k: v for k, v in wrong.items() if v}


def test_models_do_not_import_gpu():
    wrong = {name: sorted(t for t in GRAPH[name] if t.startswith("minisgl.gpu"))
             for name in MODULES if name.startswith("minisgl.models")}
    assert not {k: v for k, v in wrong.items() if v}
