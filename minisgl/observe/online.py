"""`bench --workload online --rate R`: requests arrive over time instead of all at once.

Arrivals follow a Poisson process (exponential gaps with mean 1/R, seeded), the request
lengths are the offline workload's. The driver adds each request when its arrival time has
come, steps the scheduler while there is work, and sleeps until the next arrival when there
is none. What it reports is latency, where the two loops differ even when the device keeps
up with the load: time to first token and the gap between consecutive tokens (ITL), p50 and
p99, next to throughput and the share of the run the device was busy.
"""

from __future__ import annotations

import random
import time

from ..tracer import HOST_LANE
from .trace import _percentile, merge_intervals


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times in seconds from the start: cumulative exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def run_online(llm, prompts: list[list[int]], params: list, rate: float, seed: int = 0) -> dict:
    """Drive `llm` with Poisson arrivals; figures in seconds (latencies) and tokens/s."""
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    llm.engine.tracer.clear()
    reqs = []
    start = time.perf_counter()
    i = 0
    while i < len(prompts) or llm.has_unfinished():
        now = time.perf_counter() - start
        while i < len(prompts) and arrivals[i] <= now:
            llm.add_request(prompts[i], params[i])
            req = llm.scheduler.waiting[-1]
            # The request arrived at its Poisson time; the driver only sees it at the next turn
            # of this loop, and that wait is part of its latency.
            req.times.arrival = start + arrivals[i]
            reqs.append(req)
            i += 1
        if llm.has_unfinished():
            llm.step()
        elif i < len(prompts):
            time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
    end = time.perf_counter()
    times = [r.times.token_times for r in reqs]
    ttft = [t[0] - r.times.arrival for r, t in zip(reqs, times) if t]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    spans = llm.engine.tracer.resolve()
    busy = sum(e - s for s, e in merge_intervals([(sp.start, sp.end) for sp in spans if sp.lane != HOST_LANE]))
    tokens = sum(len(t) for t in times)
    return {"rate": rate, "num_requests": len(reqs), "output_tokens": tokens, "wall_s": end - start,
            "output_tok_per_s": tokens / (end - start),
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "itl_p50_s": _percentile(itl, 50), "itl_p99_s": _percentile(itl, 99),
            "device_busy": busy / (end - start)}
