"""Constrained decoding: a small finite-state grammar over token ids, and the masks it makes.

A `Grammar` says, for each state, which token ids may come next and which state each one
leads to. A state with no allowed token is final: the request finishes ("stop") when it gets
there. Each request with a grammar carries its state (`Req.grammar_state`), advanced when a
token is committed, never earlier: the host learns a token only at its batch's commit.

That is the overlap trap (lessons/readings §16): the mask for batch n+1's sample depends on
batch n's token, which the overlap loop commits only after launching batch n+1. So with a
grammar in the batch the scheduler launches n+1's forward, commits n (advancing the states),
and only then builds n+1's masks and launches its sampling (`DelayedSampling.launch`, SGLang's
`delay_sample_func`). The switch `grammar_delayed_sample` off builds the masks at planning,
from a state one token behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import torch

from ..checks import INT64_MAX, check_int, is_int
from ..models.sampler import apply_token_mask
from ..request import Req
from ..constraint import REJECTED, Constraint
from ..tracer import SpanName

if TYPE_CHECKING:
    from ..batch import InFlight
    from ..engine import Engine, ForwardResult
    from ..scheduler import Scheduler


@dataclass(frozen=True)
class Grammar(Constraint):
    """A finite-state constraint: `transitions[state]` maps each allowed next token to the next state.

    Built from a mapping {state: {token: next_state}}; stored as sorted tuples, so that the
    grammar is hashable (SamplingParams is frozen) and nobody edits it in flight."""

    transitions: Mapping[int, Mapping[int, int]] | tuple
    start: int = 0

    def __post_init__(self) -> None:
        table = self.transitions
        if not isinstance(table, Mapping):
            raise TypeError(f"grammar transitions must be a mapping {{state: {{token: next_state}}}}, "
                            f"got {type(table).__name__}")
        for state, edges in table.items():
            check_int("grammar state", state, 0, INT64_MAX)
            if not isinstance(edges, Mapping):
                raise TypeError(f"grammar state {state}: transitions must be a mapping {{token: next_state}}, "
                                f"got {type(edges).__name__}")
            for token, target in edges.items():
                check_int(f"grammar state {state}: token id", token, 0, INT64_MAX)
                if not is_int(target) or target not in table:
                    raise ValueError(f"grammar state {state}: token {token} leads to state {target!r}, "
                                     f"which the grammar does not define")
        if not is_int(self.start) or self.start not in table:
            raise ValueError(f"grammar start state {self.start!r} is not one of its states {sorted(table)}")
        if not table[self.start]:
            raise ValueError(f"grammar start state {self.start} allows no token (it is final)")
        frozen = tuple(sorted((s, tuple(sorted(edges.items()))) for s, edges in table.items()))
        object.__setattr__(self, "transitions", frozen)
        object.__setattr__(self, "_edges", {s: dict(edges) for s, edges in frozen})

    def initial_state(self) -> int:
        return self.start

    def validate(self, vocab: int) -> None:
        """Every token id must be in [0, vocab): a mask cannot allow a token the model lacks."""
        for state, edges in self._edges.items():
            bad = [t for t in edges if t >= vocab]
            if bad:
                raise ValueError(f"grammar state {state} allows token id(s) {bad[:4]} outside the vocabulary "
                                 f"[0, {vocab})")

    def allowed(self, state: int) -> tuple[int, ...] | None:
        """The token ids allowed next; None when unconstrained (final or rejected state)."""
        edges = self._edges.get(state)
        return tuple(edges) if edges else None

    def advance(self, state: int, token: int) -> int:
        """The state after `token`; REJECTED if the token was not allowed."""
        return self._edges.get(state, {}).get(token, REJECTED)

    def is_final(self, state: int) -> bool:
        return state in self._edges and not self._edges[state]

    def accepts_prefix(self, tokens: Iterable[int]) -> bool:
        """True if `tokens` follows the grammar from its start state (not necessarily to the end)."""
        state = self.start
        for token in tokens:
            if self.is_final(state):
                return False  # nothing may follow a final state
            state = self.advance(state, token)
            if state == REJECTED:
                return False
        return True

    @classmethod
    def sequence_of(cls, steps: Sequence[Iterable[int]], repeat_last: bool = False,
                    end: Iterable[int] = ()) -> "Grammar":
        """One allowed set per position: state i allows steps[i] and leads to i+1. `repeat_last`:
        the last set may repeat; `end`: tokens that may follow the last set and end the output."""
        if not steps:
            raise ValueError("a grammar needs at least one step (a set of allowed tokens)")
        table: dict[int, dict[int, int]] = {}
        final = len(steps)
        for i, allowed in enumerate(steps):
            table[i] = {t: i + 1 for t in allowed}
        last = final - 1
        if repeat_last:
            table[last] = {t: last for t in steps[last]}
        table[last].update({t: final for t in end})
        table[final] = {}
        return cls(table)


@dataclass(frozen=True)
class TokenMask:
    """Which tokens each row of a batch may sample: `allowed` per row, None for an unconstrained row.
    Built on the host from the grammar states; applied on the device (engine.py)."""

    allowed: tuple[tuple[int, ...] | None, ...]

    @property
    def constrains(self) -> bool:
        return any(a is not None for a in self.allowed)

    def apply(self, logits: torch.Tensor, to_device: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
        """Runs on the engine stream: every token a constrained row may not sample gets -inf."""
        return apply_token_mask(logits, *(to_device(ids) for ids in self.index_lists()))

    def index_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(rows constrained, row of each allowed entry, token of each allowed entry): the three
        index lists the device scatters into a [B, vocab] mask."""
        constrained = [i for i, a in enumerate(self.allowed) if a is not None]
        rows = [i for i in constrained for _ in self.allowed[i]]  # type: ignore[union-attr]
        tokens = [t for i in constrained for t in self.allowed[i]]  # type: ignore[union-attr]
        return constrained, rows, tokens


def build_mask(grammars: Sequence[Constraint | None], states: Sequence) -> TokenMask:
    """The mask for one batch's sample, from each request's grammar and the state it is in now.
    Rows with a grammar of another backend (features/xgrammar_backend.py) add that backend's mask."""
    fsm = TokenMask(tuple(g.allowed(s) if isinstance(g, Grammar) else None for g, s in zip(grammars, states)))
    other = next((g for g in grammars if g is not None and not isinstance(g, Grammar)), None)
    if other is None:
        return fsm
    return type(other).batch_mask(fsm, grammars, states)  # the other backend adds its rows to the FSM's


def launch_sample(engine: Engine, result: ForwardResult, mask: TokenMask) -> None:
    """Queue the delayed sampling of a launched forward on the engine stream, with masks built
    after the forward was launched (SGLang's launch_batch_sample_if_needed); no wait. Queued
    before the next batch's forward: that forward reads this batch's tokens from the FutureMap,
    and a CUDA-graph replay rewrites the logits buffer held here. `copy_done` moves past the
    sampling: the result-queue entry holds this same result, so its commit waits for it."""
    delayed = result.delayed
    assert delayed is not None, f"batch {result.batch_id}: its sampling was not delayed, or was launched already"
    result.delayed = None
    iteration, tracer = engine.tracer.iteration, engine.tracer

    def sample_held() -> None:
        begin = tracer.device_begin(engine.device)
        logits, inp = delayed.held.pop()
        engine.sample(delayed.batch, inp, logits, mask, result.next_tokens, result.next_tokens_host, result.logprobs)
        tracer.device_end(begin, SpanName.SAMPLE, engine.stream.name, engine.device, iteration, result.batch_id)

    engine.stream.launch(sample_held)
    result.copy_done = engine.stream.record_event()


class DelayedSampling:
    """The grammar seam: a batch with a grammar samples only after every earlier batch is committed.

    The scheduler calls `plan` while planning such a batch, and `launch` once the batch before it
    is committed (right after the launch in normal_loop, after the commit of n-1 in overlap_loop)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def on(self, mechanism: str) -> bool:
        return self.sched.on(mechanism)

    def plan(self, reqs: Sequence[Req]) -> tuple[bool, TokenMask | None]:
        """(delay the sampling?, the mask if it is built now) for a batch with a grammar."""
        params = [r.params for r in reqs]
        mask = None
        # >>> exercise 10: delay the sampling
        delay_sample = self.on("grammar_delayed_sample")
        if not delay_sample:
            # WRONG on purpose: masks from the states at planning, which in the overlap loop
            # lack the token batch n-1 is still sampling (one token behind).
            mask = build_mask([p.grammar for p in params], [r.grammar_state for r in reqs])
        # <<< exercise 10
        return delay_sample, mask

    def launch(self, inflight: InFlight) -> None:
        """Build the batch's masks from the grammar states now and launch its sampling (SGLang's
        launch_batch_sample_if_needed; lessons/readings §16)."""
        sched = self.sched
        # >>> exercise 10: launch the delayed sampling
        result = inflight.result
        # The mask needs each request's latest token: every earlier batch must be committed, so
        # that the states are not one token behind (what grammar_delayed_sample off shows).
        assert sched.rows.done_id == result.batch_id - 1, "delayed sampling before the previous batch's commit"
        with sched.tracer.host(SpanName.SAMPLE, result.batch_id):
            reqs = inflight.view.reqs  # the batch's own rows, in its order: one mask entry per row
            launch_sample(sched.engine, result, build_mask([r.params.grammar for r in reqs],
                                                           [r.grammar_state for r in reqs]))
        sched.stats.delayed_samples += 1
        # <<< exercise 10
