"""Recording where time goes: host spans on the scheduler, device spans on the engine stream.

Recording is off unless asked for (`LLM(..., trace=True)`), and cheap when on: a span is
one tuple appended to a list. Host spans are timed on the scheduler thread. Device spans
are timed where the work really runs: on the CPU stream's worker thread, or, on CUDA, by a
pair of CUDA events resolved after the run (so recording never syncs the device).

Reading a finished trace (below the Tracer):
- `to_chrome_trace` / `write_chrome_trace`: open the run in Perfetto or chrome://tracing.
- `pipeline_metrics`: device busy fraction, the idle gaps between forwards (the bubble),
  G (device time per forward) and C (host work per iteration: schedule + launch + commit
  spans, waiting excluded). These are the only G and C in minisgl: bench, lab, lessons and
  the timeline all read them here. The serial loop's step is about G + C; the overlap
  loop's about max(G, C): `ideal_ratio`, and `realised_share` of a measured ratio.
- `request_metrics`: TTFT, TPOT and end-to-end latency over finished requests.
`minisgl.observe.timeline.render_timeline` draws the same spans in the terminal.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch


@dataclass
class Span:
    name: str  # receive | schedule | launch | wait | commit | forward | ...
    lane: str  # "host" or the device stream's name
    start: float  # seconds, time.perf_counter() clock
    end: float
    iteration: int
    batch_id: int = -1

    @property
    def duration(self) -> float:
        return self.end - self.start


class Tracer:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []
        self.iteration = 0
        self._cuda_pending: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event, int, int]] = []
        self._cuda_origin: tuple[torch.cuda.Event, float] | None = None

    @contextmanager
    def host(self, name: str, batch_id: int = -1) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(name, "host", start, time.perf_counter(), self.iteration, batch_id))

    def device_begin(self, stream_name: str, device: torch.device) -> object:
        """Call where device work starts (inside the stream's closure on CPU)."""
        if not self.enabled:
            return None
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            if self._cuda_origin is None:
                self._cuda_origin = (event, time.perf_counter())
            return event
        return time.perf_counter()

    def device_end(self, token: object, name: str, stream_name: str, device: torch.device, iteration: int,
                   batch_id: int) -> None:
        if token is None:
            return
        if device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._cuda_pending.append((name, stream_name, token, end, iteration, batch_id))  # type: ignore[arg-type]
        else:
            self.spans.append(Span(name, stream_name, token, time.perf_counter(), iteration, batch_id))  # type: ignore[arg-type]

    def resolve(self) -> list[Span]:
        """Turn pending CUDA event pairs into spans on the host clock (syncs once, at the end)."""
        if self._cuda_pending and self._cuda_origin is not None:
            torch.cuda.synchronize()
            origin_event, origin_time = self._cuda_origin
            for name, lane, start, end, iteration, batch_id in self._cuda_pending:
                s = origin_time + origin_event.elapsed_time(start) / 1000.0
                e = origin_time + origin_event.elapsed_time(end) / 1000.0
                self.spans.append(Span(name, lane, s, e, iteration, batch_id))
            self._cuda_pending.clear()
        self.spans.sort(key=lambda sp: sp.start)
        return self.spans

    def metrics(self) -> dict:
        """`pipeline_metrics` of everything recorded so far."""
        return pipeline_metrics(self.resolve())

    def write_chrome_trace(self, path: str | Path) -> None:
        write_chrome_trace(self.resolve(), path)

    def clear(self) -> None:
        self.spans.clear()
        self._cuda_pending.clear()
        self._cuda_origin = None


# --------------------------------------------------------------------------- export and metrics
#
# Everything below reads a finished list of spans (call `Tracer.resolve()` first on CUDA).
# Lanes: "host" is the scheduler thread; every other lane is a device stream.

HOST_LANE = "host"


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
            "name": sp.name if sp.batch_id < 0 else f"{sp.name} b{sp.batch_id}",
            "cat": "host" if sp.lane == HOST_LANE else "device",
            "ph": "X",
            "pid": 1,
            "tid": tids[sp.lane],
            "ts": round((sp.start - origin) * 1e6, 3),
            "dur": round(max(0.0, sp.end - sp.start) * 1e6, 3),
            "args": {"kind": sp.name, "iteration": sp.iteration, "batch_id": sp.batch_id},
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
    - num_forwards, device_time_per_forward_s (G): count and mean length of "forward" spans.
    - num_iterations, host_time_per_iteration_s (C): mean, over the iterations that did any
      host work, of that iteration's host span time excluding "wait" (waiting is not work).
    - exposed_host_time_per_step_s: device idle time per forward (idle_gap_total_s /
      num_forwards): the part of the host's work the device had to sit through. The serial
      loop exposes about C per step; the overlap loop close to nothing while G > C.
    - host_wait_fraction: time the host spent in "wait" spans, over wall_s.
    """
    out: dict[str, float | int] = {
        "wall_s": 0.0, "device_busy_fraction": 0.0, "idle_gap_total_s": 0.0, "idle_gap_mean_s": 0.0,
        "idle_gap_median_s": 0.0, "num_idle_gaps": 0, "num_forwards": 0, "device_time_per_forward_s": 0.0,
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

    forwards = [sp.duration for sp in spans if sp.lane != HOST_LANE and sp.name == "forward"]
    out["num_forwards"] = len(forwards)
    if forwards:
        out["device_time_per_forward_s"] = sum(forwards) / len(forwards)
        out["exposed_host_time_per_step_s"] = out["idle_gap_total_s"] / len(forwards)

    per_iteration: dict[int, float] = {}
    wait = 0.0
    for sp in spans:
        if sp.lane != HOST_LANE:
            continue
        if sp.name == "wait":
            wait += sp.duration
        else:
            per_iteration[sp.iteration] = per_iteration.get(sp.iteration, 0.0) + sp.duration
    out["num_iterations"] = len(per_iteration)
    if per_iteration:
        out["host_time_per_iteration_s"] = sum(per_iteration.values()) / len(per_iteration)
    out["host_wait_fraction"] = wait / wall if wall > 0 else 0.0
    return out


def ideal_ratio(g: float, c: float) -> float:
    """The overlap loop's best throughput over the normal loop's: a serial step costs G + C,
    an overlapped one max(G, C). 2 at C = G; above it the host caps the gain at (G+C)/C."""
    return (g + c) / max(g, c)


def realised_share(ratio: float, ideal: float) -> float:
    """The part of the possible gain that was realised: (ratio - 1) / (ideal - 1). 1 = all of
    it, 0 = none; noise can put it a little above 1. NaN when there was nothing to gain."""
    return (ratio - 1) / (ideal - 1) if ideal > 1 else float("nan")


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
