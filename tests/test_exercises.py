"""Exercises (lessons/exercises/): skeletons are generated from the marked reference code, so they
are up to date by construction. Here: every marker is well formed and comment-only, each
skeleton has every region replaced and still imports, its test selection fails cleanly on
NotImplementedError (pytest exit code 1, not a collection error), and the reference passes
every selection.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "lessons" / "exercises" / "make_exercise.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("make_exercise", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_exercise"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_markers_are_well_formed_and_cover_every_exercise():
    files = tool.marked_files()
    numbers = {n for ns in files.values() for n in ns}
    assert numbers == set(tool.EXERCISES), (numbers, sorted(tool.EXERCISES))
    assert set(map(str, files)) <= {"scheduler.py", "batch.py", "future_map.py"}  # the only files lessons may mark


def test_markers_are_comments_only():
    """Dropping every marker line leaves the same program: the reference is unchanged by them."""
    for rel in tool.marked_files():
        source = (tool.PACKAGE / rel).read_text()
        lines = source.splitlines(keepends=True)
        markers = [line for line in lines if tool.START.match(line) or tool.MORE.match(line) or tool.END.match(line)]
        assert all(line.lstrip().startswith("#") for line in markers)
        bare = "".join(line for line in lines if line not in markers)
        assert ast.dump(ast.parse(source)) == ast.dump(ast.parse(bare))


def test_region_parser_rejects_broken_markers():
    with pytest.raises(ValueError, match="not closed"):
        tool.regions(["# >>> exercise 1: x", "pass"])
    with pytest.raises(ValueError, match="without a start"):
        tool.regions(["pass", "# <<< exercise 1"])
    with pytest.raises(ValueError, match="nest"):
        tool.regions(["# >>> exercise 1: x", "# >>> exercise 2: y", "# <<< exercise 2", "# <<< exercise 1"])


def test_generate_never_overwrites_a_learners_copy(tmp_path):
    assert cli("generate", "2", "--dest", str(tmp_path)).returncode == 0
    mine = tmp_path / "minisgl" / "future_map.py"
    mine.write_text(mine.read_text() + "# my work\n")
    kept = cli("generate", "2", "--dest", str(tmp_path))
    assert kept.returncode == 0 and "kept your existing copy" in kept.stdout
    assert mine.read_text().endswith("# my work\n")
    assert cli("generate", "2", "--dest", str(tmp_path), "--force").returncode == 0
    assert "# my work" not in mine.read_text()


@pytest.mark.parametrize("number", sorted(tool.EXERCISES))
def test_skeleton_fails_cleanly_with_not_implemented(tmp_path, number):
    assert cli("generate", str(number), "--dest", str(tmp_path)).returncode == 0
    for rel in tool.marked_files():
        skeleton = (tmp_path / "minisgl" / rel).read_text()
        ast.parse(skeleton)
        left = [r for r in tool.regions(skeleton.splitlines()) if r[0] == number]
        assert not left, f"{rel}: exercise {number} regions left in the skeleton"
        expected = sum(r[0] == number for r in tool.regions((tool.PACKAGE / rel).read_text().splitlines()))
        assert skeleton.count(f'"exercise {number}: ') == expected  # one raise per region
    done = cli("check", str(number), "--dest", str(tmp_path), "--", "-x")
    out = done.stdout + done.stderr
    assert f"minisgl under test: {tmp_path.resolve()}" in out  # the copy, not the reference, was imported
    assert done.returncode == 1, out[-3000:]  # 1: tests failed; 2+: collection or usage error
    assert "NotImplementedError" in out and f"exercise {number}:" in out
    assert "error" not in out.splitlines()[-1].lower(), out[-2000:]


def test_reference_passes_every_selection():
    done = cli("check", "all", "--reference")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
