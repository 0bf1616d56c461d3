"""What crosses a step boundary in the scheduler: batch views, result-queue entries, counters.

The result queue pairs each launched batch with a `BatchView` frozen at launch, never the live
`RunningBatch` that schedule() filters and merges in place (lessons/readings §5)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .engine import ForwardBatch, ForwardResult
from .request import Req
from .tracer import SpanName


@dataclass
class BatchView:
    """What result processing needs to interpret batch n's rows: a snapshot taken at launch."""

    batch_id: int
    is_prefill: bool
    reqs: list[Req]
    rows: list[int]
    generations: list[int]
    samples: list[bool]  # does row i's sampled token become an output? (no: a non-final prefill chunk)
    qo_lens: list[int]

    def snapshot(self) -> "BatchView":
        return self  # built per batch and never mutated: already a snapshot


class RunningBatch:
    """The live decode batch. Filtered and merged in place every step, like SGLang's running_batch."""

    def __init__(self) -> None:
        self.batch_id = -1
        self.is_prefill = False
        self.reqs: list[Req] = []

    # Derived from the *current* members: why the result queue must not hold this object (batch_snapshot).
    @property
    def rows(self) -> list[int]:
        return [r.row for r in self.reqs]

    @property
    def generations(self) -> list[int]:
        return [r.row_generation for r in self.reqs]

    @property
    def samples(self) -> list[bool]:
        return [True] * len(self.reqs)

    @property
    def qo_lens(self) -> list[int]:
        return [1] * len(self.reqs)

    def snapshot(self) -> BatchView:
        # >>> exercise 3: snapshot
        return BatchView(self.batch_id, False, list(self.reqs), self.rows, self.generations, self.samples,
                         self.qo_lens)
        # <<< exercise 3


@dataclass
class Planned:
    forward: ForwardBatch
    view: BatchView | RunningBatch


@dataclass
class InFlight:
    """An entry of the result queue: (batch snapshot, result handle) (lessons/readings §5)."""

    view: BatchView | RunningBatch
    result: ForwardResult


@dataclass
class SchedulerStats:
    batches: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    overshoot_tokens: int = 0  # late results dropped because their request had already finished
    overshoot_steps: int = 0  # decode rows launched for a request whose samples already reached its length
    stale_row_results: int = 0  # late results whose row had been recycled (ABA, detected by generation)
    cached_tokens: int = 0  # prompt tokens served from the radix cache at admission
    early_commits: int = 0  # batch n-1 committed before batch n launched (future_map off, prefill_sync)
    decode_rows: int = 0  # requests over all decode batches: / decode_batches = requests decoding at once
    prefill_tokens: int = 0  # prompt tokens over all prefill batches: / prefill_batches = tokens per prefill batch
    retractions: int = 0  # running requests sent back to waiting for lack of KV (admission="optimistic")
    retracted_late_results: int = 0  # in-flight results of requests retracted since their launch, skipped
    delayed_samples: int = 0  # grammar batches whose sampling waited for the previous commit
    spec_verify_rows: int = 0  # speculation: requests over all committed verify steps
    spec_accepted_tokens: int = 0  # speculation: tokens those verify steps accepted (/ rows: tokens per verify)
    # (LAUNCH | COMMIT | RETRACT, batch_id) in order (RETRACT: the batch being planned): the latest 65536 only, so a long run's memory stays flat.
    events: deque[tuple[SpanName, int]] = field(default_factory=lambda: deque(maxlen=1 << 16))
