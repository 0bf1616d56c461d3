"""Recording where time goes: host spans on the scheduler, device spans on the engine stream.

Off unless asked for (`LLM(..., trace=True)`); device spans are timed where the work runs (the CPU
worker thread, or CUDA event pairs that never sync the device). `minisgl/observe/` reads the trace."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from .gpu.cuda_spans import CudaSpans


class SpanName(StrEnum):
    """What a span times. The scheduler's stats.events use LAUNCH, COMMIT and RETRACT too."""

    SCHEDULE = "schedule"  # host: plan the next batch
    LAUNCH = "launch"  # host: queue its forward on the engine stream
    WAIT = "wait"  # host: block until a batch's copy_done (waiting, not work)
    COMMIT = "commit"  # host: apply a batch's sampled tokens
    FORWARD = "forward"  # device: copy-in, forward and sampling of one batch (not a delayed sampling)
    RETRACT = "retract"  # a marker in stats.events, never a span: a decode step sent requests back to waiting
    SAMPLE = "sample"  # host: build a grammar batch's masks and launch its delayed sampling; device: that sampling
    IO = "io"  # host: a serving loop's own work between two steps, on the scheduler's thread (requests in, outputs out)


# Host spans that are work (WAIT is not); their sum per iteration is C.
HOST_WORK = (SpanName.SCHEDULE, SpanName.LAUNCH, SpanName.COMMIT, SpanName.SAMPLE, SpanName.IO)
HOST_LANE = "host"  # the scheduler thread; every other lane is a device stream


@dataclass
class Span:
    name: SpanName
    lane: str  # HOST_LANE or the device stream's name
    start: float  # seconds, time.perf_counter() clock
    end: float
    iteration: int
    batch_id: int = -1

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class BatchRecord:
    """One launched batch as the run-level breakdown needs it (recorded only while tracing)."""

    batch_id: int
    is_prefill: bool
    num_reqs: int
    num_tokens: int  # new tokens
    attended_positions: int  # positions attended over, all requests together
    attention_pairs: int  # sum over requests of new tokens x positions: prefill attention work
    padded_reqs: int  # rows actually computed: the CUDA-graph size a decode batch is padded to


class Tracer:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []
        self.batches: list[BatchRecord] = []  # every batch launched while enabled
        self.iteration = 0
        self._cuda: CudaSpans | None = None  # made by the first device span on CUDA

    @contextmanager
    def host(self, name: SpanName, batch_id: int = -1) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(name, HOST_LANE, start, time.perf_counter(), self.iteration, batch_id))

    def device_begin(self, device: torch.device) -> object:
        """Call where device work starts (inside the stream's closure on CPU)."""
        if not self.enabled:
            return None
        if device.type == "cuda":
            if self._cuda is None:
                from .gpu.cuda_spans import CudaSpans
                self._cuda = CudaSpans()
            return self._cuda.begin()
        return time.perf_counter()

    def device_end(self, token: object, name: SpanName, stream_name: str, device: torch.device, iteration: int,
                   batch_id: int) -> None:
        if token is None:
            return
        if device.type == "cuda":
            done = self._cuda.end(token, name, stream_name, iteration, batch_id)  # type: ignore[union-attr, arg-type]
            self.spans.extend(Span(*fields) for fields in done)
        else:
            self.spans.append(Span(name, stream_name, token, time.perf_counter(), iteration, batch_id))  # type: ignore[arg-type]

    def resolve(self) -> list[Span]:
        """All spans, sorted, the pending CUDA pairs resolved (syncs once, at the end)."""
        if self._cuda is not None:
            self.spans.extend(Span(*fields) for fields in self._cuda.resolve(wait=True))
        self.spans.sort(key=lambda sp: sp.start)
        return self.spans

    def clear(self) -> None:
        self.spans.clear()
        self.batches.clear()
        self._cuda = None
