"""Reading a finished trace: the spans that `minisgl/tracer.py` recorded.

- `to_chrome_trace` / `write_chrome_trace`: open the run in Perfetto or chrome://tracing.
- `pipeline_metrics`: device busy fraction, the idle gaps between forwards (the bubble),
  G (device time per forward) and C (host work per iteration: schedule + launch + commit
  spans, plus the io spans of a serving loop that records them, lesson 13; waiting
  excluded). These are the only G and C in minisgl: bench, lab, lessons and the timeline
  all read them here. The serial loop's step is about G + C; the overlap
  loop's about max(G, C): `ideal_ratio`, and `share_of_gain` of measured ratios. On a GPU
  a forward's span also holds the end of its own launch; `forward_after_launch_s` is G
  without it, the G of the ideal in `bench` and `lab`.
- `request_metrics`: TTFT, TPOT and end-to-end latency over finished requests.
`minisgl.observe.timeline.render_timeline` draws the same spans in the terminal.

Everything here reads a finished list of spans (call `Tracer.resolve()` first on CUDA).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..tracer import HOST_LANE, HOST_WORK, Span, SpanName


def lanes_of(spans: list[Span]) -> list[str]:
    """Lane names in display order: the host first, then device streams by first appearance."""
    device: list[str] = []
    for sp in sorted(spans, key=lambda s: s.start):
        if sp.lane != HOST_LANE and sp.lane not in device:
            device.append(sp.lane)
    return [HOST_LANE] + device


def to_chrome_trace(spans: list[Span]) -> dict:
    """Spans as a Chrome trace object ("X" complete events; opens in Perfetto or chrome://tracing).

    Times are microseconds since the first span starts. One process (pid 1), one thread id
    per lane: the host is tid 1, device streams follow. Each event's args carry the
    scheduler iteration and the batch id (-1 when the span belongs to no batch).
    """
    lanes = lanes_of(spans)
    tids = {lane: i + 1 for i, lane in enumerate(lanes)}
    origin = min((sp.start for sp in spans), default=0.0)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "minisgl"}}]
    for lane, tid in tids.items():
        label = "host (scheduler)" if lane == HOST_LANE else f"device: {lane}"
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
    for sp in sorted(spans, key=lambda s: (s.start, s.end)):
        events.append({
            "name": sp.name.value if sp.batch_id < 0 else f"{sp.name.value} b{sp.batch_id}",
            "cat": "host" if sp.lane == HOST_LANE else "device",
            "ph": "X",
            "pid": 1,
            "tid": tids[sp.lane],
            "ts": round((sp.start - origin) * 1e6, 3),
            "dur": round(max(0.0, sp.end - sp.start) * 1e6, 3),
            "args": {"kind": sp.name.value, "iteration": sp.iteration, "batch_id": sp.batch_id},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: list[Span], path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_chrome_trace(spans)))


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals, as sorted disjoint intervals (touching ones are joined)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def pipeline_metrics(spans: list[Span]) -> dict:
    """Where the time went. All times in seconds.

    - wall_s: first span start to last span end.
    - device_busy_fraction: length of the union of all device-lane spans divided by the
      device window (first device start to last device end). Overlapping spans count once.
    - idle_gap_total_s / idle_gap_mean_s / idle_gap_median_s / num_idle_gaps: the gaps
      between consecutive intervals of that union: the bubbles.
    - num_forwards, device_time_per_forward_s (G): count and mean length of FORWARD spans.
    - forward_after_launch_s (G after launch): mean, over FORWARD spans, of the part after the
      host's LAUNCH span of the same batch ended. On a GPU a forward's span opens at its input
      copy, queued first, and the device then waits for the rest of the launch (the attention
      plan, the graph replay): the span holds launch work whenever the device had nothing else
      queued (always in the normal loop). This is the forward without it: the G that an overlap
      loop whose queue never runs dry sees. On the CPU's emulated stream both are about equal.
      It compares device and host times: on CUDA the trace places device events on the host
      clock from its first event (`Tracer.resolve`), exact when the device was idle then, as
      after a warm-up or a synchronize.
    - num_iterations, host_time_per_iteration_s (C): mean, over the iterations that did any
      host work, of that iteration's host span time excluding WAIT (waiting is not work).
    - exposed_host_time_per_step_s: device idle time per forward (idle_gap_total_s /
      num_forwards): the part of the host's work the device had to sit through. The serial
      loop exposes about C per step; the overlap loop close to nothing while G > C.
    - host_wait_fraction: time the host spent in WAIT spans, over wall_s.
    """
    out: dict[str, float | int] = {
        "wall_s": 0.0, "device_busy_fraction": 0.0, "idle_gap_total_s": 0.0, "idle_gap_mean_s": 0.0,
        "idle_gap_median_s": 0.0, "num_idle_gaps": 0, "num_forwards": 0, "device_time_per_forward_s": 0.0,
        "forward_after_launch_s": 0.0,
        "num_iterations": 0, "host_time_per_iteration_s": 0.0, "exposed_host_time_per_step_s": 0.0,
        "host_wait_fraction": 0.0,
    }
    if not spans:
        return out
    wall = max(sp.end for sp in spans) - min(sp.start for sp in spans)
    out["wall_s"] = wall

    device = merge_intervals([(sp.start, sp.end) for sp in spans if sp.lane != HOST_LANE])
    if device:
        window = device[-1][1] - device[0][0]
        busy = sum(end - start for start, end in device)
        out["device_busy_fraction"] = busy / window if window > 0 else 1.0
        gaps = [nxt[0] - prev[1] for prev, nxt in zip(device, device[1:])]
        if gaps:
            out["idle_gap_total_s"] = sum(gaps)
            out["idle_gap_mean_s"] = sum(gaps) / len(gaps)
            out["idle_gap_median_s"] = _percentile(gaps, 50)
            out["num_idle_gaps"] = len(gaps)

    forwards = [sp for sp in spans if sp.lane != HOST_LANE and sp.name == SpanName.FORWARD]
    out["num_forwards"] = len(forwards)
    if forwards:
        out["device_time_per_forward_s"] = sum(sp.duration for sp in forwards) / len(forwards)
        out["exposed_host_time_per_step_s"] = out["idle_gap_total_s"] / len(forwards)
        after_launch = forwards_after_launch(spans)
        out["forward_after_launch_s"] = sum(after_launch) / len(after_launch)

    per_iteration = _host_work_per_iteration(spans)
    out["num_iterations"] = len(per_iteration)
    if per_iteration:
        out["host_time_per_iteration_s"] = sum(per_iteration.values()) / len(per_iteration)
    wait = sum(sp.duration for sp in spans if sp.lane == HOST_LANE and sp.name == SpanName.WAIT)
    out["host_wait_fraction"] = wait / wall if wall > 0 else 0.0
    return out


def forwards_after_launch(spans: list[Span]) -> list[float]:
    """Each forward's device time after its own launch returned (see pipeline_metrics), in batch order."""
    launched = {sp.batch_id: sp.end for sp in spans if sp.lane == HOST_LANE and sp.name == SpanName.LAUNCH}
    forwards = sorted((sp for sp in spans if sp.lane != HOST_LANE and sp.name == SpanName.FORWARD),
                      key=lambda sp: sp.batch_id)
    return [max(0.0, sp.end - max(sp.start, launched.get(sp.batch_id, sp.start))) for sp in forwards]


def host_work_by_span(spans: list[Span]) -> dict[int, dict[SpanName, float]]:
    """{iteration: {span name: seconds}}: each iteration's host work (HOST_WORK spans; waiting
    is not work), for iterations that did any."""
    out: dict[int, dict[SpanName, float]] = {}
    for sp in spans:
        if sp.lane == HOST_LANE and sp.name in HOST_WORK:
            by_name = out.setdefault(sp.iteration, {})
            by_name[sp.name] = by_name.get(sp.name, 0.0) + sp.duration
    return out


def _host_work_per_iteration(spans: list[Span]) -> dict[int, float]:
    """{iteration: its host work}: C of each iteration that did any."""
    return {iteration: sum(by_name.values()) for iteration, by_name in host_work_by_span(spans).items()}


def host_work_by_launch(spans: list[Span]) -> list[float]:
    """The host work of each iteration that launched a batch, in launch order: C step by step.
    An iteration that launched nothing (the last commit, a wait for memory) is left out, so it
    cannot shift the steps that follow when they are paired with forwards."""
    per_iteration = _host_work_per_iteration(spans)
    launches = sorted((sp.start, sp.iteration) for sp in spans if sp.lane == HOST_LANE and sp.name == SpanName.LAUNCH)
    return [per_iteration[iteration] for _, iteration in launches]


def ideal_ratio(g: float, c: float) -> float:
    """The overlap loop's best throughput over the normal loop's: a serial step costs G + C,
    an overlapped one max(G, C). 2 at C = G; above it the host caps the gain at (G+C)/C."""
    return (g + c) / max(g, c)


def stepwise_ideal(g_steps: list[float], c_steps: list[float]) -> float:
    """The ideal ratio built step by step: the serial step G_k + C_k against an overlapped one
    that costs the longer of the two, max(G_k, C_k), over the steps paired in order (as far as
    both lists go): (mean G + mean C) / mean max(G_k, C_k). With one side always the longer it
    is ideal_ratio of the means; where the two take turns it is lower, never higher: a step
    whose host work runs late delays the device, one that is early gains nothing (a loop one
    batch ahead cannot bank it). NaN without a pair."""
    pairs = list(zip(g_steps, c_steps))
    if not pairs:
        return float("nan")
    return sum(g + c for g, c in pairs) / sum(max(g, c) for g, c in pairs)


def realised_share(ratio: float, ideal: float) -> float:
    """The part of the possible gain that was realised: (ratio - 1) / (ideal - 1). 1 = all of
    it, 0 = none; noise can put it a little above 1. NaN when there was nothing to gain."""
    return (ratio - 1) / (ideal - 1) if ideal > 1 else float("nan")


def share_of_gain(ratios: list[float], ideal: float) -> tuple[float, str]:
    """realised_share of the median of paired overlap/normal ratios (one per round), where the
    rounds can show it: (share, ""). Otherwise (NaN, why not): one round shows nothing of the
    spread, and a spread (largest - smallest ratio) not below the possible gain (ideal - 1)
    makes the share noise divided by a small number (shares far outside 0-100 % on a loaded
    2-core machine). Lesson 8, `bench --compare-loops` and the lab all print the share through this."""
    if len(ratios) < 2:
        return float("nan"), "one round shows nothing of the spread"
    spread = max(ratios) - min(ratios)
    if spread >= ideal - 1:
        return float("nan"), (f"the possible gain ({ideal - 1:.0%}) is not larger than the run-to-run spread "
                              f"of the ratio ({spread:.0%}), so it would be noise")
    return realised_share(statistics.median(ratios), ideal), ""


def request_metrics(outputs: list) -> dict:
    """Latency figures over finished requests (RequestOutput), in seconds.

    TTFT: arrival to first committed token. TPOT (= mean inter-token latency, ITL): per
    request (last token - first token) / (tokens - 1), averaged over requests with two or
    more tokens. E2E: arrival to last token. Percentiles interpolate linearly.
    """
    ttft = [o.metrics["ttft"] for o in outputs if "ttft" in o.metrics]
    tpot = [o.metrics["tpot"] for o in outputs if "tpot" in o.metrics]
    e2e = [o.metrics["e2e"] for o in outputs if "e2e" in o.metrics]
    return {
        "num_requests": len(outputs),
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p90_s": _percentile(ttft, 90),
        "tpot_mean_s": _mean(tpot),
        "e2e_mean_s": _mean(e2e),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _percentile(values: list[float], q: float) -> float:
    """q-th percentile, linear interpolation between the two nearest ranks (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
