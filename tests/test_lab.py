"""The loop-comparison lab (`python -m minisgl lab`), the bench tables and the timeline layout.

Speed itself is never asserted here (that is what the lab prints); these tests check the
formulas, the chart, the JSON schema and that the figures of a tiny sweep are consistent.
"""

from __future__ import annotations

import io
import json
import math
import random

import pytest
from rich.console import Console

from minisgl.frontend.cli import main
from minisgl.observe.bench import print_ratios, print_results
from minisgl.observe.lab import host_delay_for, steps_for
from minisgl.observe.lab_report import lab_table, render_chart
from minisgl.observe.timeline import render_timeline
from minisgl.observe.trace import ideal_ratio, realised_share, share_of_gain, stepwise_ideal
from minisgl.tracer import Span, SpanName

POINT_KEYS = {"c_over_g", "ideal", "ratio_median", "ratio_min", "ratio_max", "busy_normal", "busy_overlap"}


def test_ideal_ratio_rises_to_two_at_the_crossover_then_the_host_caps_it():
    g = 10.0
    assert ideal_ratio(g, 2.5) == pytest.approx(1.25)  # C < G: (G+C)/G
    assert ideal_ratio(g, g) == pytest.approx(2.0)  # the crossover
    assert ideal_ratio(g, 30.0) == pytest.approx(4 / 3)  # C > G: (G+C)/C
    assert ideal_ratio(g, 0.0) == pytest.approx(1.0)
    assert ideal_ratio(4.0, 7.0) == ideal_ratio(7.0, 4.0)  # whichever side is longer caps the step


def test_the_ideal_step_by_step_pays_for_taking_turns():
    """Near C = G the mean of max(G_k, C_k) is longer than max of the means: the crossover's 2.0
    is out of reach when the host is late on some steps and early on others."""
    g, c = [2.0, 2.0, 2.0, 2.0], [1.5, 2.5, 1.5, 2.5]  # means 2.0 and 2.0: the curve says 2
    assert stepwise_ideal(g, c) == pytest.approx(16 / 9)  # steps 2, 2.5, 2, 2.5: 4 / 2.25
    # With one side always the longer it is the curve of the means.
    assert stepwise_ideal([5.0, 6.0], [1.0, 2.0]) == pytest.approx(ideal_ratio(5.5, 1.5))
    assert stepwise_ideal([5.0, 6.0, 7.0], [1.0]) == pytest.approx(ideal_ratio(5.0, 1.0))  # paired as far as both go
    assert math.isnan(stepwise_ideal([], [1.0]))
    # Never above the curve of the paired steps' means.
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 20)
        g, c = [rng.uniform(1, 3) for _ in range(n)], [rng.uniform(0.5, 4) for _ in range(n)]
        assert stepwise_ideal(g, c) <= ideal_ratio(sum(g) / n, sum(c) / n) + 1e-12


def test_realised_share():
    assert realised_share(1.5, 1.5) == pytest.approx(1.0)
    assert realised_share(1.0, 1.5) == pytest.approx(0.0)
    assert realised_share(1.25, 1.5) == pytest.approx(0.5)
    assert math.isnan(realised_share(1.02, 1.0))  # nothing to gain: no share


def test_the_share_of_the_gain_only_where_the_rounds_can_show_it():
    assert share_of_gain([1.2, 1.25, 1.3], 1.5) == (pytest.approx(0.5), "")  # the median's share
    for ratios, why in (([1.25], "one round"), ([0.9, 1.25, 1.6], "not larger than the run-to-run spread")):
        share, said = share_of_gain(ratios, 1.5)
        assert math.isnan(share) and why in said
    assert math.isnan(share_of_gain([1.0, 1.0], 1.0)[0])  # nothing to gain


def test_host_delays_and_steps():
    # G 10 ms, the host's own work 1 ms: C/G 0.5 needs 4 ms more, C/G 0.05 needs none.
    assert [host_delay_for(0.010, 0.001, x) for x in (0.5, 2.0, 0.05)] == pytest.approx([4.0, 19.0, 0.0])
    assert steps_for(0.010, 0.010, run_s=1.0, min_steps=10, max_steps=400) == 50
    assert steps_for(0.010, 0.090, run_s=1.0, min_steps=20, max_steps=400) == 20
    assert steps_for(0.0001, 0.0, run_s=1.0, min_steps=20, max_steps=400) == 400


def _point(x: float, ratio: float) -> dict:
    return {"c_over_g": x, "ratio_median": ratio, "ratio_min": ratio - 0.05, "ratio_max": ratio + 0.05}


def test_chart_puts_markers_on_the_ideal_curve():
    points = [_point(x, ideal_ratio(1.0, x)) for x in (0.25, 1.0, 3.0)]
    lines = render_chart(points, width=40)
    assert len(lines) == 13 + 2  # ratio 0.9 to 2.1 in rows of 0.1, the axis, its labels
    assert all(len(line) <= 40 for line in lines)
    plot = lines[:13]
    assert sum(line.count("●") for line in plot) == 3
    # The median at C/G = 1 sits on the row labelled 2.0, the top of the ideal curve.
    two = next(line for line in plot if line.lstrip().startswith("2.0"))
    assert "●" in two
    # Ranges are drawn around each median.
    assert sum(line.count("│") for line in plot) > 3
    assert "C/G" in lines[-1] and "3" in lines[-1]


def test_chart_cuts_a_stray_range_at_the_edge():
    lines = render_chart([_point(1.0, 1.9), {**_point(2.0, 1.5), "ratio_max": 3.4}], width=40)
    assert len(lines) == 13 + 2  # the axis still ends at 2.1: the range is cut, not the chart stretched
    assert lines[0].count("│") == 2  # the left border and the cut range


def test_chart_marks_a_step_by_step_ideal_below_the_curve():
    lines = render_chart([{**_point(1.0, 1.6), "ideal": 1.75}], width=40)
    rows = {mark: next(i for i, line in enumerate(lines) if mark in line) for mark in "○●"}
    two = next(i for i, line in enumerate(lines) if line.lstrip().startswith("2.0"))
    assert sum(line.count("○") for line in lines) == 1
    assert two < rows["○"] < rows["●"]  # rows count down: the curve's 2.0, this ideal, the median


def test_chart_shows_a_point_far_from_the_ideal_off_the_curve():
    lines = render_chart([_point(1.0, 1.1)], width=40)
    two = next(line for line in lines if line.lstrip().startswith("2.0"))
    assert "●" not in two and "·" in two  # the ideal's peak is drawn, the measurement is lower


def _render(renderable, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_lab_table_fits_80_columns():
    p = {"c_over_g": 0.25, "g_ms": 123.4, "c_ms": 30.9, "busy_normal": 0.8, "busy_overlap": 0.99,
         "idle_normal_ms": 31.2, "idle_overlap_ms": 10.1, "ideal": 1.25, "ratio_median": 1.24, "ratio_min": 1.2,
         "ratio_max": 1.27, "share": 0.96}
    text = _render(lab_table([p, {**p, "share": float("nan")}]), 80)
    assert max(map(len, text.splitlines())) <= 80
    assert "96%" in text and "1.20–1.27" in text and "…" not in text  # no header cut


def _bench_run(loop: str, delay: float, tok_s: float, repeat: int) -> dict:
    return {"loop": loop, "delay_ms": delay, "output_tok_per_s": tok_s, "repeat": repeat,
            "pipe_device_busy_fraction": 0.9, "pipe_exposed_host_time_per_step_s": 0.001,
            "pipe_device_time_per_forward_s": 0.011, "pipe_forward_after_launch_s": 0.010,
            "pipe_host_time_per_iteration_s": 0.0025,
            "req_ttft_mean_s": 0.02, "req_tpot_mean_s": 0.012}


def test_bench_tables_fit_80_columns_and_pair_repeats():
    results = [_bench_run("normal", 2.0, 100.0, 0), _bench_run("overlap", 2.0, 125.0, 0),
               _bench_run("overlap", 2.0, 120.0, 1), _bench_run("normal", 2.0, 100.0, 1),
               _bench_run("normal", 2.0, 80.0, 2), _bench_run("overlap", 2.0, 100.0, 2)]
    console = Console(record=True, width=80, file=io.StringIO())
    print_results(results, console)
    print_ratios(results, console)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80
    assert "…" not in text
    # Paired ratios 1.25, 1.20, 1.25: median 1.25, range 1.20-1.25; ideal (10+2.5)/10 = 1.25: all of the gain.
    assert "1.25x" in text and "1.20–1.25" in text and "100%" in text
    header = next(line for line in text.splitlines() if "busy" in line)
    assert header.index("busy") < header.index("tok/s")  # the robust figures first
    assert "not computed" not in text


def test_bench_prints_no_share_where_the_ratios_spread_wider_than_the_gain():
    """Paired ratios 1.25, 0.80, 1.20 around an ideal of 1.25: a range of 0.45 against a possible
    gain of 0.25. The share, (1.20 - 1)/0.25 = 80 %, would be noise: lesson 8's rule refuses it."""
    results = [_bench_run("normal", 2.0, 100.0, 0), _bench_run("overlap", 2.0, 125.0, 0),
               _bench_run("overlap", 2.0, 80.0, 1), _bench_run("normal", 2.0, 100.0, 1),
               _bench_run("normal", 2.0, 100.0, 2), _bench_run("overlap", 2.0, 120.0, 2)]
    console = Console(record=True, width=80, file=io.StringIO())
    print_ratios(results, console)
    text = console.export_text()
    assert "0.80–1.25" in text and "80%" not in text
    assert "delay 2 ms: share of the gain not computed; the possible gain (25%) is not larger" in " ".join(text.split())


def S(name, lane, start_ms, end_ms, iteration, batch_id=-1):
    return Span(name, lane, start_ms / 1e3, end_ms / 1e3, iteration, batch_id)


def test_timeline_keeps_short_host_spans_visible_and_fits_the_console():
    # S, L and C of 0.05 ms each inside one 1-ms column: each still gets a cell.
    spans = []
    for i in range(6):
        t = 10.0 * i
        spans += [S(SpanName.COMMIT, "host", t, t + 0.05, i + 1, i - 1),
                  S(SpanName.SCHEDULE, "host", t + 0.05, t + 0.1, i + 1),
                  S(SpanName.LAUNCH, "host", t + 0.1, t + 0.15, i + 1, i),
                  S(SpanName.WAIT, "host", t + 0.15, t + 9.0, i + 1, i),
                  S(SpanName.FORWARD, "engine", t + 0.2, t + 9.0, i + 1, i)]
    for width in (80, 120):
        text = _render(render_timeline(spans, "short spans"), width)
        assert max(map(len, text.splitlines())) <= width
        host = next(line for line in text.splitlines() if line.strip("│ ").startswith("host"))
        assert host.count("C") >= 5 and host.count("S") >= 5 and host.count("L") >= 5, host
        assert "CSL" in host
        marks = next(line for line in text.splitlines() if line.strip("│ ").startswith("launch"))
        assert marks.index("▲") == host.index("L")  # the marker sits on the launch it labels


@pytest.mark.full  # a real sweep; the lab's argument checks run in both tiers
def test_lab_mini_sweep_writes_the_json_schema(tmp_path, capsys):
    out = tmp_path / "lab.json"
    rc = main(["lab", "--points", "0.5,2", "--repeats", "2", "--run-s", "0.3", "--min-steps", "20",
               "--device-delay-ms", "4", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ideal" in text and "C/G" in text and "●" in text  # the table and the chart
    points = json.loads(out.read_text())["points"]
    assert len(points) == 2
    for p in points:
        assert POINT_KEYS <= p.keys()
        assert p["ratio_min"] <= p["ratio_median"] <= p["ratio_max"]
        assert p["ideal_of_means"] == pytest.approx(ideal_ratio(p["g_ms"], p["c_ms"]))
        # step by step the ideal is at most the curve, up to the medians of whole runs against
        # the means of their paired steps
        assert p["ideal"] <= p["ideal_of_means"] * 1.01
        assert p["c_over_g"] == pytest.approx(p["c_ms"] / p["g_ms"])
        assert 0 < p["busy_normal"] < p["busy_overlap"] <= 1  # the normal loop idles through C
        assert len(p["ratios"]) == 2
    low, high = points
    assert low["c_over_g"] < 1 < high["c_over_g"]
    # Host-bound (C about 2G, mostly sleep): overlap still hides all of G, clearly faster.
    assert high["ratio_median"] > 1.15


@pytest.mark.parametrize("extra", [["lab", "--points", "a,b"], ["lab", "--points", "0,1"],
                                   ["lab", "--host-delays", "-1"], ["lab", "--host-delays", "nan"],
                                   ["lab", "--repeats", "0"], ["lab", "--run-s", "0"], ["lab", "--run-s", "nan"],
                                   ["lab", "--json", "/no/such/dir/lab.json"],
                                   ["bench", "--json", "/no/such/dir/b.json"], ["bench", "--compare-loops", "--delays", "abc"],
                                   ["trace", "--out", "/no/such/dir/t.json"]])
def test_lab_bad_options_exit_2(extra, capsys):
    """Refused at once, with one line: never after minutes of measuring."""
    try:
        code = main(extra)
    except SystemExit as exc:  # argparse rejects a bad flag type itself
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
