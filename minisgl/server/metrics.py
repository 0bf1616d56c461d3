"""Prometheus metrics under SGLang's names (`sglang:` becomes `minisgl:`), in a registry of
the server's own (so that two servers in one process never share figures). Two differ from
SGLang's: `minisgl:aborted_requests_total` is minisgl's own (SGLang's `num_aborted_requests`
counts requests refused by a full queue; this one, generations cut short while running), and
`minisgl:gen_throughput` is a window over the last seconds in the HTTP process (SGLang's: the
scheduler's decode log interval)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .messages import Load

# Seconds: from a millisecond (a decode step of a small model) to a minute (a long queue).
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_WINDOW_S = 5.0


class TokenRate:
    """Tokens per second over the last THROUGHPUT_WINDOW_S seconds."""

    def __init__(self) -> None:
        self.events: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float) -> None:
        self.events.append((now, n))
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        return sum(n for _, n in self.events) / THROUGHPUT_WINDOW_S

    def _trim(self, now: float) -> None:
        while self.events and self.events[0][0] < now - THROUGHPUT_WINDOW_S:
            self.events.popleft()


class LatencyHistogram:
    """A histogram of seconds in /metrics, observed and read on the event loop's thread only: plain
    counts, where prometheus_client's Histogram takes a lock per observation (one per token here)."""

    def __init__(self, name: str, doc: str, model_name: str, registry: CollectorRegistry) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bucket's bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, seconds: float, times: int = 1) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += times  # the first bound >= seconds
        self.sum += seconds * times

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative = list(accumulate(self.counts))
        bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        family.add_metric([self.model_name], list(zip(bounds, cumulative)), self.sum)
        yield family


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"minisgl:{name}", doc, labels.keys(), registry=self.registry).labels(**labels)

        self.num_running = gauge("num_running_reqs", "Requests admitted (prefilling or decoding)")
        self.num_queue = gauge("num_queue_reqs", "Requests waiting for admission")
        self.token_usage = gauge("token_usage", "Share of the KV pool held by requests")
        self.gen_throughput = gauge("gen_throughput", f"Generated tokens/s over the last {THROUGHPUT_WINDOW_S:g} s")
        self.rate = TokenRate()
        self.gen_throughput.set_function(self.rate.rate)
        self.ttft = LatencyHistogram("minisgl:time_to_first_token_seconds", "Arrival at the server to the first token",
                                     model_name, self.registry)
        self.itl = LatencyHistogram("minisgl:inter_token_latency_seconds", "Gap between two tokens of a request",
                                    model_name, self.registry)
        self.prompt_tokens = Counter("minisgl:prompt_tokens", "Prompt tokens submitted", labels.keys(),
                                     registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("minisgl:generation_tokens", "Tokens generated", labels.keys(),
                                         registry=self.registry).labels(**labels)
        self.aborted = Counter("minisgl:aborted_requests", "Generations cut short while the engine ran them (client "
                               "gone, shutdown); not those a stop string ended, nor those refused", labels.keys(),
                               registry=self.registry).labels(**labels)

    def observe_load(self, load: Load) -> None:
        self.num_running.set(load.num_running)
        self.num_queue.set(load.num_queue)
        self.token_usage.set(load.kv_used / load.kv_total)

    def clear_load(self) -> None:
        """The scheduler process is gone: nothing runs, waits or holds KV any more."""
        for gauge in (self.num_running, self.num_queue, self.token_usage):
            gauge.set(0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
