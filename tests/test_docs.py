"""The map to SGLang (lessons/readings §13 and the side-by-side reading) names only minisgl code that exists."""

from __future__ import annotations

from pathlib import Path

from minisgl.course import check_map

ROOT = Path(__file__).resolve().parents[1]


def test_every_minisgl_name_in_the_map_exists():
    assert check_map.scan() == []


def test_the_map_check_reports_a_misspelled_name():
    names = check_map.PackageNames(ROOT / "minisgl")
    # misspelled members are reported, spelled right they pass
    table = ("| minisgl | SGLang |\n| --- | --- |\n| `Scheduler.overlap_lop(last)` | x |\n| `future_mapp` | y |\n"
             "| `Grammar.initial_stat` | z |\n")
    assert check_map.check_text(table, names) == [
        "line 3: `Scheduler.overlap_lop` is not defined in minisgl/",
        "line 4: `future_mapp` is not defined in minisgl/",
        "line 5: `Grammar.initial_stat` is not defined in minisgl/",
    ]
    spelled_right = table.replace("overlap_lop", "overlap_loop").replace("future_mapp", "future_map").replace(
        "initial_stat`", "is_final`")
    assert check_map.check_text(spelled_right, names) == []
