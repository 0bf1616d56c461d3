"""A terminal timeline of a traced run: see the bubble, and see it go away.

`render_timeline(spans, title)` draws, at the console's width, one row per lane (the host,
then each device stream) on a shared time axis in milliseconds, for a few steady-state
iterations taken from the middle of the run. Read it column by column: whatever is stacked in one column happened at
the same time. `export_timelines(timelines, "x.svg")` (or "x.html") saves them as a picture for slides.

- normal loop: after each forward the device row shows a red gap (the bubble) exactly
  where the host row commits, schedules and launches (C, S, L). The device waits for them.
- overlap loop: the host's C/S/L sit under a green forward block. The "launch" row shows
  that batch n+1 was launched while the device was still running batch n.

A column is one cell of time (its width is printed in the header). Spans shorter than a
cell are still drawn, the way trace viewers draw a tiny slice as at least one pixel: every
S, L and C gets a cell of its own (shifted right a column or two where several share one),
and a device gap covering at least a quarter of a cell is drawn as a gap. Gaps smaller than
that (the stream's own per-forward overhead) are not.
"""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.panel import Panel
from rich.text import Text

from ..tracer import HOST_LANE, HOST_WORK, Span, SpanName
from .trace import lanes_of, pipeline_metrics

# Keyed by span name, plus three cell kinds that are no span: the odd batches' forwards, the
# batch label drawn inside a forward, and a device gap.
STYLES = {
    SpanName.SCHEDULE: "bold black on dodger_blue2",
    SpanName.LAUNCH: "bold black on magenta",
    SpanName.COMMIT: "bold black on yellow",
    SpanName.SAMPLE: "bold black on orange1",
    SpanName.IO: "bold black on grey70",
    SpanName.WAIT: "grey50",
    SpanName.FORWARD: "green3",
    "forward_alt": "green4",
    "label": "bold white on dark_green",
    "idle": "bold red",
}
GLYPHS = {SpanName.SCHEDULE: "S", SpanName.LAUNCH: "L", SpanName.COMMIT: "C", SpanName.SAMPLE: "M", SpanName.IO: "I",
          SpanName.WAIT: "░", SpanName.FORWARD: "█", "forward_alt": "▓", "idle": "·"}
GAP_CELL_FRACTION = 0.25  # a device gap covering this much of a cell is drawn


def pick_window(spans: list[Span], max_iterations: int) -> tuple[list[int], float, float]:
    """Up to `max_iterations` consecutive iterations from the middle of the run, and the time
    window they cover: from their first host span to the end of the last forward they launched."""
    iterations = sorted({sp.iteration for sp in spans if sp.lane == HOST_LANE})
    if not iterations:  # device spans only
        iterations = sorted({sp.iteration for sp in spans})
    k = max(1, min(max_iterations, len(iterations)))
    first = (len(iterations) - k) // 2
    chosen = iterations[first:first + k]
    inside = [sp for sp in spans if sp.iteration in chosen]
    host = [sp for sp in inside if sp.lane == HOST_LANE] or inside
    t0 = min(sp.start for sp in host)
    t1 = max(sp.end for sp in inside)
    return chosen, t0, t1


def _cover(spans: list[Span], a: float, b: float) -> list[tuple[Span, float]]:
    """The spans that overlap the cell [a, b), with how long each covers it."""
    out = []
    for sp in spans:
        c = min(b, sp.end) - max(a, sp.start)
        if c > 0:
            out.append((sp, c))
    return out


def _largest(cover: list[tuple[Span, float]]) -> Span:
    return max(cover, key=lambda item: item[1])[0]


def _host_layout(spans: list[Span], edges: list[float]) -> list[Span | None]:
    """Per cell, the host work span drawn there. Every S/L/C span keeps at least one cell of its
    own, the way a trace viewer draws a tiny slice as at least one pixel: when several fall in
    one cell, the later ones move right into the next free cells (a column or two at most)."""
    width = len(edges) - 1
    cells: list[Span | None] = [None] * width
    next_free = 0
    for sp in sorted((sp for sp in spans if sp.name in HOST_WORK), key=lambda sp: sp.start):
        first, last = _column(max(sp.start, edges[0]), edges), _column(min(sp.end, edges[-1]) - 1e-12, edges)
        if first is None or last is None or sp.end <= edges[0]:
            continue
        first = max(first, next_free)
        if first >= width:
            break
        for c in range(first, max(first, last) + 1):
            cells[c] = sp
        next_free = max(first, last) + 1
    return cells


def _host_row(spans: list[Span], layout: list[Span | None], edges: list[float]) -> Text:
    row = Text()
    for cell, a, b in zip(layout, edges, edges[1:]):
        if cell is not None:
            row.append(GLYPHS[cell.name], STYLES[cell.name])
            continue
        cover = _cover(spans, a, b)  # no work drawn here: show waiting, if any
        if cover:
            sp = _largest(cover)
            row.append(GLYPHS.get(sp.name, "▒"), STYLES.get(sp.name, "white"))
        else:
            row.append(" ")
    return row


def _device_cells(spans: list[Span], edges: list[float], lane_start: float, lane_end: float) -> list[Span | str | None]:
    """Per cell: the forward span drawn there, "idle" (a gap inside the lane's busy period), or None."""
    cells: list[Span | str | None] = []
    for a, b in zip(edges, edges[1:]):
        cover = _cover(spans, a, b)
        # Idle time in the cell that lies between the lane's first start and last end.
        inside = max(0.0, min(b, lane_end) - max(a, lane_start))
        busy = sum(c for _, c in cover)  # may double count overlapping spans: then idle is just 0
        idle = max(0.0, inside - busy)
        if idle >= GAP_CELL_FRACTION * (b - a) and inside > 0:
            cells.append("idle")
        elif cover:
            cells.append(_largest(cover))
        else:
            cells.append(None)
    return cells


def _device_row(cells: list[Span | str | None]) -> Text:
    row = Text()
    i = 0
    while i < len(cells):
        cell = cells[i]
        if cell is None:
            row.append(" ")
            i += 1
            continue
        if cell == "idle":
            row.append(GLYPHS["idle"], STYLES["idle"])
            i += 1
            continue
        j = i
        while j < len(cells) and cells[j] is cell:
            j += 1
        assert isinstance(cell, Span)
        n = j - i
        kind = SpanName.FORWARD if cell.batch_id % 2 == 0 else "forward_alt"  # neighbours stay apart
        style, glyph = STYLES[kind], GLYPHS[kind]
        label = f"b{cell.batch_id}" if cell.batch_id >= 0 else cell.name[:3]
        if n >= len(label) + 2:  # room for the label with a block either side
            left = (n - len(label)) // 2
            row.append(glyph * left, style)
            row.append(label, STYLES["label"])
            row.append(glyph * (n - left - len(label)), style)
        else:
            row.append(glyph * n, style)
        i = j
    return row


def _marker_row(layout: list[Span | None]) -> Text:
    """Where each batch was launched (the first cell of its L), with its batch id: "▲b7"."""
    width = len(layout)
    chars = [" "] * width
    last = -1
    for col, sp in enumerate(layout):
        if sp is None or sp.name != SpanName.LAUNCH or (col > 0 and layout[col - 1] is sp) or col <= last:
            continue
        label = f"▲b{sp.batch_id}" if sp.batch_id >= 0 else "▲"
        if col + len(label) > width:
            label = "▲"
        for k, ch in enumerate(label):
            if col + k < width:
                chars[col + k] = ch
        last = col + len(label)  # next label must start after this one
    return Text("".join(chars), style="magenta")


def _column(t: float, edges: list[float]) -> int | None:
    if t < edges[0] or t >= edges[-1]:
        return None
    step = (edges[-1] - edges[0]) / (len(edges) - 1)
    return min(len(edges) - 2, int((t - edges[0]) / step))


def _axis(t0: float, t1: float, origin: float, width: int, pad: int) -> Text:
    """Tick marks and labels in ms since the run's first span (the Chrome trace's zero)."""
    marks = [" "] * width
    labels = [" "] * width
    step = max(12, width // 6)
    for col in range(0, width, step):
        ms = (t0 + (t1 - t0) * col / width - origin) * 1e3
        text = f"{ms:.1f}"
        if col + len(text) > width:
            break
        marks[col] = "╵"
        labels[col:col + len(text)] = text
    return Text(" " * pad + "".join(marks) + "\n" + "ms".ljust(pad) + "".join(labels), style="dim")


def _legend() -> Text:
    legend = Text("  ")
    for name in (*HOST_WORK, SpanName.WAIT):
        legend.append(GLYPHS[name], STYLES[name])
        legend.append(f" {name}  ")
    legend.append("\n  ")
    legend.append("███", STYLES[SpanName.FORWARD])
    legend.append("b7", STYLES["label"])
    legend.append(" forward of batch 7  ")
    legend.append("···", STYLES["idle"])
    legend.append(" device idle (the bubble)")
    return legend


def _summary(spans: list[Span]) -> Text:
    m = pipeline_metrics(spans)
    text = Text("  whole run: ", style="dim")
    text.append(f"device busy {m['device_busy_fraction'] * 100:.1f}%", style="bold")
    text.append(f"  idle/forward {m['exposed_host_time_per_step_s'] * 1e3:.2f} ms"
                f"  G {m['device_time_per_forward_s'] * 1e3:.2f} ms  C {m['host_time_per_iteration_s'] * 1e3:.2f} ms")
    text.append("\n  G: device time per forward.  C: host work per iteration (S+L+C, no wait)."
                "\n  ▲bN over a block of b(N-1): launched while the device was busy;"
                "\n  ▲bN over red ···: the device sat idle until the host had launched it.", style="dim")
    return text


class Timeline:
    """The renderable `render_timeline` returns: laid out when printed, at the width given or
    the console's, whichever is smaller, so that no row ever wraps."""

    def __init__(self, spans: list[Span], title: str, width: int | None, max_iterations: int) -> None:
        self.spans, self.title, self.width, self.max_iterations = spans, title, width, max_iterations

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = min(self.width or options.max_width, options.max_width)
        yield _panel(self.spans, self.title, width, self.max_iterations)


def render_timeline(spans: list[Span], title: str, width: int | None = None, max_iterations: int = 6) -> Timeline:
    """A Gantt-like rich renderable of `spans`, at most `width` columns wide (panel border
    included; default: the console's width)."""
    return Timeline(spans, title, width, max_iterations)


def export_timelines(timelines: list[Timeline], path: str | Path, width: int = 100) -> Path:
    """Draw `timelines` one above the other, as on a terminal `width` columns wide, into a picture
    for slides: an SVG when `path` ends in .svg, a self-contained HTML page when it ends in .html
    (rich's recording console; the colours are the terminal's)."""
    path = Path(path)
    if path.suffix not in (".svg", ".html"):
        raise ValueError(f"{path}: a timeline is exported to .svg or .html, not {path.suffix or 'no suffix'!r}")
    # A recording console of its own: nothing reaches the real terminal, and the picture does
    # not depend on the width or colour support of the terminal the command ran in.
    recorder = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor", highlight=False)
    for timeline in timelines:
        recorder.print(timeline)
    if path.suffix == ".svg":
        recorder.save_svg(str(path), title=" / ".join(tl.title for tl in timelines))
    else:
        recorder.save_html(str(path))
    return path


def _panel(spans: list[Span], title: str, width: int, max_iterations: int) -> Panel:
    if not spans:
        return Panel(Text("no spans recorded: run with LLM(..., trace=True)"), title=title, width=width)
    lanes = lanes_of(spans)
    pad = max(len(SpanName.LAUNCH), *(len(lane) for lane in lanes)) + 1
    bar = max(10, width - 4 - pad)  # panel border and padding take 4 columns
    origin = min(sp.start for sp in spans)
    chosen, t0, t1 = pick_window(spans, max_iterations)
    if t1 <= t0:
        t1 = t0 + 1e-6
    edges = [t0 + (t1 - t0) * i / bar for i in range(bar + 1)]
    visible = [sp for sp in spans if sp.end > t0 and sp.start < t1]

    rows: list[Text] = []
    for lane in lanes:
        lane_spans = [sp for sp in visible if sp.lane == lane]
        if lane == HOST_LANE:
            layout = _host_layout(lane_spans, edges)
            rows.append(Text(lane.ljust(pad), style="bold") + _host_row(lane_spans, layout, edges))
            rows.append(Text(SpanName.LAUNCH.ljust(pad), style="dim") + _marker_row(layout))
        else:
            every = [sp for sp in spans if sp.lane == lane]
            cells = _device_cells(lane_spans, edges, min(sp.start for sp in every), max(sp.end for sp in every))
            rows.append(Text(lane.ljust(pad), style="bold") + _device_row(cells))

    cell_ms = (t1 - t0) / bar * 1e3
    header = Text(f"iterations {chosen[0]}–{chosen[-1]} of {len({sp.iteration for sp in spans})}  ·  "
                  f"1 column ≈ {cell_ms:.2f} ms", style="dim")
    body = Group(header, *rows, _axis(t0, t1, origin, bar, pad), _legend(), _summary(spans))
    return Panel(body, title=title, width=width, title_align="left")
