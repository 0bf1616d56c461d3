"""The map's SGLang and mini-SGLang names (lessons/readings §13, §18 and the side-by-side reading) are defined
at the pinned versions, as the stored manifest lists them; a misspelled one anywhere in the map fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minisgl.course import check_map, upstream_map

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def names():
    return upstream_map.load_manifest(), upstream_map.minisgl_names()


def map_spans():
    return [(path.name, number, source, code) for path in upstream_map.MAP_FILES
            for number, source, code in upstream_map.spans(path.read_text())
            if upstream_map.candidate(code) and upstream_map.candidate(code)[0] != "commit"]


def misspell(code: str) -> str:
    """The span with its name (or the last part of its dotted name, or its file name) changed."""
    kind, value = upstream_map.candidate(code)
    if kind == "path":
        stem = re.search(r"[\w-]+(?=\.\w+$|/?$)", value)
        return code.replace(value, value[:stem.end()] + "zq" + value[stem.end():])
    start = code.index(value.replace("_", "-")) if code.startswith("--") else code.index(value)
    return code[:start + len(value)] + "_zq" + code[start + len(value):]


def test_the_readings_pass():
    assert upstream_map.scan() == []


def test_check_map_runs_the_upstream_check_too():
    assert check_map.scan(upstream=lambda: ["an SGLang name that is not there"]) == ["an SGLang name that is not there"]


def test_every_name_of_the_map_is_checked_and_fails_when_misspelled(names):
    upstream, own = names
    spans = map_spans()
    assert len(spans) > 300  # the map is checked, not skipped
    for source in ("sglang", "mini-sglang"):
        assert any(s == source for _, _, s, _ in spans), source  # both upstream columns are found
    for file, number, source, code in spans:
        assert upstream_map.problem(source, code, upstream, own) is None, (file, number, code)
        wrong = misspell(code)
        assert upstream_map.problem(source, wrong, upstream, own), (file, number, wrong)


def test_a_column_accepts_only_its_own_code_base(names):
    upstream, own = names
    table = ("| minisgl | SGLang (file: function) | mini-SGLang |\n| --- | --- | --- |\n"
             "| `Scheduler.commit` | `FutureMap.resolve_seq_lens_cpu` | `Scheduler._process_last_data` |\n"
             "| `Scheduler.commit` | `Scheduler._process_last_data` | `FutureMap.resolve_seq_lens_cpu` |\n"
             "| `Scheduler.commit` | `FutureMap.pubish` | `DecodeManager.new_token_ratio` |\n")
    assert upstream_map.check_text(table, upstream, own) == [
        "line 4: `Scheduler._process_last_data` is not defined in SGLang at the pinned version",
        "line 4: `FutureMap.resolve_seq_lens_cpu` is not defined in mini-SGLang at the pinned version",
        "line 5: `FutureMap.pubish` is not defined in SGLang at the pinned version",
        "line 5: `DecodeManager.new_token_ratio` is not defined in mini-SGLang at the pinned version",
    ]


def test_a_name_written_after_a_file_must_be_defined_in_that_file(names):
    """A reader of SGLang found `ScheduleBatch.copy` placed in scheduler.py: the name resolved, so
    only the file it was written after could say it was wrong."""
    upstream, own = names
    table = ("| minisgl | SGLang |\n| --- | --- |\n"
             "| `BatchView.snapshot` | scheduler.py: `ScheduleBatch.copy` |\n"
             "| `BatchView.snapshot` | managers/schedule_batch.py: `ScheduleBatch.copy` |\n")
    assert upstream_map.check_text(table, upstream, own) == [
        "line 3: `ScheduleBatch.copy` is not defined in scheduler.py but in python/sglang/srt/managers/schedule_batch.py"]
    claims = [c for path in upstream_map.MAP_FILES for c in upstream_map.FILE_CLAIM.findall(path.read_text())]
    assert len(claims) > 20  # the map's file claims are read, and pass (test_the_readings_pass)


def test_prose_names_flags_variables_paths_and_commits(names):
    upstream, own = names
    right = ("`FutureMap.publish(x)` `req.kv.kv_committed_len` `--disable-overlap-schedule` "
             "`SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP=1` `managers/overlap_utils.py` "
             "`MINISGL_DISABLE_OVERLAP_SCHEDULING=1` `Scheduler.overlap_loop(last)` `future_map` "
             "`20fcd7f3c6a1898a61139fae1c97cc7a40bd8d66` `len(output_ids) + 1` `-(row + 1)`\n")
    assert upstream_map.check_text(right, upstream, own) == []
    wrong = ("`FutureMap.publsh(x)` `req.kv.kv_comitted_len` `--disable-overlap-schedul` "
             "`SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAPP=1` `managers/overlap_utilz.py` `20fcd7f`\n")
    assert [p.split(": ", 1)[1] for p in upstream_map.check_text(wrong, upstream, own)] == [
        "`FutureMap.publsh` is not defined in minisgl, SGLang or mini-SGLang at the pinned version",
        "`req.kv.kv_comitted_len` is not defined in minisgl, SGLang or mini-SGLang at the pinned version",
        "`disable_overlap_schedul` is not defined in minisgl, SGLang or mini-SGLang at the pinned version",
        "`SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAPP` is not defined in minisgl, SGLang or mini-SGLang at the "
        "pinned version",
        "`managers/overlap_utilz.py` is not defined in minisgl, SGLang or mini-SGLang at the pinned version",
        "`20fcd7f` is a short commit id: give all 40 characters",
    ]


def test_names_from_elsewhere_are_used_and_not_defined_at_the_pins(names):
    upstream, _ = names
    used = {upstream_map.candidate(code)[1] for _, _, _, code in map_spans()}
    for name in upstream_map.NAMED_ELSEWHERE:
        assert name in used, name  # an entry the map no longer uses must go
        assert not any(n.resolves(name) for n in upstream.values()), name  # defined now: not history


def test_the_manifest_records_the_sources_it_was_made_from():
    manifest = json.loads(upstream_map.MANIFEST.read_text())
    assert manifest["sources"] == upstream_map.SOURCES
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["sources"]["mini-sglang"]["commit"])
    assert set(manifest["names"]) == set(upstream_map.SOURCES)
    for names in manifest["names"].values():
        assert names["files"] and names["classes"] and names["functions"]


def test_building_from_a_folder_without_the_sources_is_one_clear_error(tmp_path, capsys):
    before = upstream_map.MANIFEST.read_text()
    with pytest.raises(SystemExit) as stop:
        upstream_map.main(["build", "--sglang", str(tmp_path), "--mini-sglang", str(tmp_path)])
    assert stop.value.code == 2 and "no sglang/ package" in capsys.readouterr().err
    assert upstream_map.MANIFEST.read_text() == before
