"""The lab's report (observe/lab.py measures, this module shows): the table of points, the
terminal chart of the medians against the ideal, and the legend.

A point is the dict `Point.to_json()` writes (c_over_g, ideal, ideal_of_means, ratio_median,
ratio_min, ratio_max, ...), so a saved `--json` can be drawn again.
"""

from __future__ import annotations

import math

from rich import box
from rich.columns import Columns
from rich.table import Table
from rich.text import Text

from .bench import console
from .trace import ideal_ratio


# --------------------------------------------------------------------------- the chart


def render_chart(points: list[dict], width: int = 40) -> list[str]:
    """Measured median (●) with its range (│) against the ideal curve (·), ratio over C/G.

    `points` are dicts with c_over_g, ratio_median, ratio_min, ratio_max (the JSON points), and
    may hold the point's own step-by-step ideal (`ideal`, drawn ○ where it leaves the curve).
    The ideal is drawn as a function of C/G: (G+C)/max(G,C) = (1+x)/max(1,x). Whole C/G
    values fall on columns and every row is 0.1 (0.2 for a wide spread) of ratio, so the
    peak 2.0 at C/G = 1 is drawn exactly. Ranges beyond the axis stop at its edge. Returns plain lines: the plot, the axis, its labels.
    """
    label_w = 5
    plot_w = max(10, width - label_w - 6)  # room for the axis name after the last tick
    x_need = max([3.0] + [p["c_over_g"] for p in points]) * 1.05
    per_unit = max(1, int((plot_w - 1) // x_need))  # columns per unit of C/G
    # The axis spans the ideal (1 to 2) and the medians; a stray repeat's range is cut at the edge.
    medians = [p["ratio_median"] for p in points]
    y_lo = math.floor(min([1.0] + medians) * 10) / 10 - 0.1
    y_hi = math.ceil(max([2.0] + medians) * 10) / 10 + 0.1
    step = 0.1 if y_hi - y_lo <= 1.5 else 0.2
    height = round((y_hi - y_lo) / step) + 1
    grid = [[" "] * plot_w for _ in range(height)]

    def col(x: float) -> int:
        return min(plot_w - 1, max(0, round(x * per_unit)))

    def row(y: float) -> int:
        return min(height - 1, max(0, round((y_hi - y) / step)))

    for c in range(plot_w):
        grid[row(ideal_ratio(1.0, c / per_unit))][c] = "·"
    for p in points:
        c = col(p["c_over_g"])
        for r in range(row(p["ratio_max"]), row(p["ratio_min"]) + 1):
            grid[r][c] = "│"
        if "ideal" in p:  # over the range, under the median
            grid[row(p["ideal"])][c] = "○"
        grid[row(p["ratio_median"])][c] = "●"
    ticks = {row(y): f"{y:.1f}" for y in (1.0, 1.5, 2.0) if y_lo <= y <= y_hi}
    lines = [f"{ticks.get(r, ''):>{label_w - 1}} {'┤' if r in ticks else '│'}" + "".join(grid[r])
             for r in range(height)]
    axis, labels = ["─"] * plot_w, [" "] * plot_w
    for x in range((plot_w - 1) // per_unit + 1):
        axis[col(x)] = "┬"
        labels[col(x)] = str(x)[-1]
    lines.append(" " * (label_w - 1) + " └" + "".join(axis))
    lines.append(" " * (label_w + 1) + "".join(labels).rstrip() + "  C/G")
    return lines


def chart_text(points: list[dict], width: int = 40) -> Text:
    text = Text("overlap/normal vs C/G\n", style="bold")
    text.append("● measured median  │ range  · (G+C)/max(G,C)  ○ the point's ideal\n", style="dim")
    body = Text("\n".join(render_chart(points, width)))
    body.highlight_regex("●", "bold green")
    body.highlight_regex("[·○]", "cyan")
    return text + body


# --------------------------------------------------------------------------- the table


def lab_table(points: list[dict]) -> Table:
    """One row per point; fits 80 columns (two-line headers, no vertical rules)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
                  title="overlap vs normal (G from the overlap runs, C from the normal runs)",
                  title_justify="left")
    for col in ("C/G", "G\nms", "C\nms", "busy\nnorm/ovl", "idle ms\nnorm/ovl", "ideal", "ovl/\nnorm",
                "range", "share"):
        table.add_column(col, justify="right", no_wrap=True)
    for p in points:
        share = "–" if math.isnan(p["share"]) else f"{p['share']:.0%}"
        table.add_row(f"{p['c_over_g']:.2f}", f"{p['g_ms']:.1f}", f"{p['c_ms']:.1f}",
                      f"{p['busy_normal']:.0%}/{p['busy_overlap']:.0%}",
                      f"{p['idle_normal_ms']:.1f}/{p['idle_overlap_ms']:.1f}",
                      f"{p['ideal']:.2f}", f"{p['ratio_median']:.2f}",
                      f"{p['ratio_min']:.2f}–{p['ratio_max']:.2f}", share)
    return table


LEGEND = """\
C/G: host work per iteration C (schedule, launch, commit; normal runs) over G,
the device time per forward after its launch returned (overlap runs).
busy, idle: device busy fraction and device idle per forward, normal/overlap.
ideal: (G+C) over the mean of max(G_k, C_k), step by step (the chart's ○); the
chart's curve is (G+C)/max(G,C) of the means (JSON: ideal_of_means).  ovl/norm,
range: overlap/normal throughput, median and range over the repeats.
share: (median-1)/(ideal-1), the part of the possible gain that was realised;
– where the range is as wide as the possible gain (ideal-1), or one repeat."""


def report(points: list[dict], runtime_s: float) -> None:
    """The table and the chart: side by side where the console is wide enough, else stacked."""
    if console.width >= 125:
        console.print(Columns([lab_table(points), chart_text(points, 44)], padding=(0, 3)))
    else:
        console.print(lab_table(points))
        console.print(chart_text(points, min(72, console.width - 2)))
    console.print(LEGEND, style="dim", highlight=False)
    worst = max(abs(p["ratio_median"] / p["ideal"] - 1) for p in points)
    console.print(f"largest distance of a median from its ideal: {worst:.1%}; runtime {runtime_s:.0f} s")
