"""Device spans on CUDA, for the tracer (minisgl/tracer.py): a pair of CUDA events around the
work, turned into times on the host clock once the device has passed both. Recording never syncs the device, and
only the pairs of the forwards still in flight stay alive (not one pair per forward so far)."""

from __future__ import annotations

import time
from collections import deque

import torch

# (name, lane, start, end, iteration, batch_id): a tracer Span's fields, times in host seconds
SpanFields = tuple[str, str, float, float, int, int]


class CudaSpans:
    def __init__(self) -> None:
        self.pending: deque[tuple[str, str, torch.cuda.Event, torch.cuda.Event, int, int]] = deque()
        self.origin: tuple[torch.cuda.Event, float] | None = None  # the first event, and the host time it was recorded

    def begin(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self.origin is None:
            self.origin = (event, time.perf_counter())
        return event

    def end(self, start: torch.cuda.Event, name: str, lane: str, iteration: int, batch_id: int) -> list[SpanFields]:
        """Record the end of a span; returns the spans the device has finished by now."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((name, lane, start, end, iteration, batch_id))
        return self.resolve(wait=False)

    def resolve(self, wait: bool) -> list[SpanFields]:
        """The pending pairs as spans, oldest first: those the device has passed, or, with `wait`,
        all of them after a sync."""
        if not self.pending or self.origin is None:
            return []
        if wait:
            torch.cuda.synchronize()
        origin_event, origin_time = self.origin
        spans = []
        while self.pending and (wait or all(e.query() for e in (origin_event, *self.pending[0][2:4]))):
            name, lane, start, end, iteration, batch_id = self.pending.popleft()
            spans.append((name, lane, origin_time + origin_event.elapsed_time(start) / 1000.0,
                          origin_time + origin_event.elapsed_time(end) / 1000.0, iteration, batch_id))
        return spans
