"""The map to SGLang (lessons/readings §13 and the side-by-side reading) names only minisgl code that exists."""

from __future__ import annotations

from pathlib import Path

from minisgl.course import check_map

ROOT = Path(__file__).resolve().parents[1]


def test_every_minisgl_name_in_the_map_exists():
    assert check_map.scan() == []


def test_the_map_check_reports_a_misspelled_name():
    names = check_map.PackageNames(ROOT / "minisgl")
    # Scheduler._release is inherited (release.py's ReleaseMixin): a base's members count, misspelled ones do not
    table = ("| minisgl | SGLang |\n| --- | --- |\n| `Scheduler.overlap_lop(last)` | x |\n| `future_mapp` | y |\n"
             "| `Scheduler._releas` | z |\n")
    assert check_map.check_text(table, names) == [
        "line 3: `Scheduler.overlap_lop` is not defined in minisgl/",
        "line 4: `future_mapp` is not defined in minisgl/",
        "line 5: `Scheduler._releas` is not defined in minisgl/",
    ]
    spelled_right = table.replace("overlap_lop", "overlap_loop").replace("future_mapp", "future_map").replace(
        "_releas`", "_release`")
    assert check_map.check_text(spelled_right, names) == []
