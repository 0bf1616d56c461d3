"""The named seams: where a feature plugs into the lesson core.

A plain step (reserve admission, no grammar, no logprobs) runs only lesson-core code: at each
seam it checks one attribute, finds nothing plugged in, and goes on. The features live in
`minisgl/features/`; the core never imports them (tests/test_fence.py, tests/test_layout.py).

| seam                    | asked in                         | used for                            |
| ----------------------- | -------------------------------- | ----------------------------------- |
| `Features.admission`    | admission, each decode step      | admission="optimistic" (retraction) |
| `Features.prefill_gate` | admission                        | min_prefill_tokens > 0 (the GPU)    |
| `Features.grammar`      | planning, after launch or commit | a batch with a grammar              |
| `Features.logprobs`     | planning, commit                 | a batch asking for logprobs         |
| `constraint.Constraint` | a request's commit               | `SamplingParams.grammar`            |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    from .batch import BatchView, InFlight, RunningBatch
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
