"""The named seams: where a feature plugs into the lesson core.

A plain step (reserve admission, no grammar, no logprobs) checks each seam of `Features`, finds nothing
plugged in and goes on, running only lesson-core code; the core never imports `minisgl/features/`
(tests/test_fence.py, tests/test_layout.py). A request's grammar is a `constraint.Constraint`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    from .batch import BatchView, InFlight, RunningBatch
    from .engine import ForwardResult
    from .request import Req
    from .sampling_params import TokenLogprob

class AdmissionPolicy(Protocol):
    def charged(self, reqs: Iterable[Req]) -> int:
        """KV slots the admitted `reqs` are counted as still needing when a new request asks."""

    def retract_for_decode(self, running: list[Req], available: Callable[[], int],
                           retract: Callable[[Req], None]) -> bool:
        """Retract requests until the next decode step fits; False: not even one fits yet."""


class PrefillGatePolicy(Protocol):
    def is_open(self, waiting: Iterable[Req], *, running: int, prefilling: int, free_rows: int,
                kv_headroom: Callable[[], int]) -> bool: ...


class GrammarSeam(Protocol):
    def plan(self, reqs: Sequence[Req]) -> tuple[bool, Any]:
        """(delay the sampling?, a mask built now or None) for a batch with a grammar."""

    def launch(self, inflight: InFlight) -> None:
        """The delayed sampling of `inflight`, once every earlier batch is committed."""


class SpeculationSeam(Protocol):
    def prefill_step(self) -> Any:
        """The device step of a prefill batch (ForwardBatch.device_step): it also feeds the drafter."""

    def plan_decode(self, sched: Any) -> Any:
        """The decode step as a verify step of K+1 tokens per running request (a Planned)."""

    def accepted(self, view: BatchView, result: ForwardResult) -> tuple[BatchView, ForwardResult]:
        """A verify batch's result as the commit reads it: one row per accepted token."""


class MixedChunkSeam(Protocol):
    def mix(self, sched: Any, tokens: Any, reqs: list[Req], qo_lens: list[int], kv_lens: list[int],
            samples: list[bool]) -> None:
        """Append one decode token of each running request to a prefill batch being planned."""


class LogprobsSeam(Protocol):
    def plan(self, reqs: Sequence[Req], kv_lens: Sequence[int]) -> Any: ...

    def by_row(self, view: BatchView | RunningBatch, result: Any, tokens: list[int],
               snapshot: bool) -> dict[int, tuple[int, TokenLogprob]]: ...


@dataclass(frozen=True)
class Features:
    """What is plugged in; None keeps the lesson core's plain behaviour."""

    admission: AdmissionPolicy | None = None  # None: reserve admission, nothing is ever retracted
    prefill_gate: PrefillGatePolicy | None = None  # None: admit whatever fits at every step
    grammar: GrammarSeam | None = None  # asked only for a batch with a grammar (LLM always plugs it in)
    logprobs: LogprobsSeam | None = None  # asked only for a batch asking for logprobs (likewise)
    speculation: SpeculationSeam | None = None  # None: a decode step is one token per request
    mixed_chunk: MixedChunkSeam | None = None  # None: prefill and decode batches are separate forwards
