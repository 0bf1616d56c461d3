"""Optimistic admission and retraction (admission="optimistic", lesson 10).

The lesson core's "reserve" admission promises a new request everything it may ever need on top
of what running requests were promised, so nothing is ever retracted. "Optimistic" (SGLang's
behaviour; lessons/readings §15) still charges a new request in full, but running requests only
a fraction of the decode slots they may still take, the *new-token ratio*. The ratio starts high,
decays a little after every decode step that found its slots, and is raised after a retraction.
When a decode step cannot get one slot per running request, `retract_for_decode` sends requests
back to waiting: they give their KV back and are re-prefilled later, with identical output.

The numbers are SGLang's defaults (readings §15), except the decay length and the retraction
headroom, scaled down for runs of a few hundred steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..request import Req


@dataclass(frozen=True)
class RatioSchedule:
    init: float = 0.7  # SGLang: SGLANG_INIT_NEW_TOKEN_RATIO
    min_factor: float = 0.14  # SGLang: SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR (min = init * factor)
    decay_steps: int = 100  # SGLang: 600 (SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS); our runs are shorter
    # Retract until this many decode steps fit, and re-estimate the ratio with them. SGLang retracts
    # only until the next step fits and uses SGLANG_RETRACT_DECODE_STEPS (20) for the ratio and the
    # tree eviction (readings §15): minisgl's small pools would retract again at once.
    retract_headroom_steps: int = 4


@dataclass
class NewTokenRatio:
    """The fraction of its remaining decode slots that a running request is charged at admission."""

    schedule: RatioSchedule = field(default_factory=RatioSchedule)
    current: float = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.schedule.init

    @property
    def minimum(self) -> float:
        return self.schedule.init * self.schedule.min_factor

    def decay_step(self) -> None:
        """A decode step found its slots: be a little more optimistic."""
        s = self.schedule
        self.current = max(self.current - (s.init - self.minimum) / s.decay_steps, self.minimum)

    def after_retract(self, survivors: list[Req]) -> None:
        """A decode step ran out of slots: re-estimate from what the survivors really produced,
        plus the headroom steps, as a share of what they may produce (at most 1: reserve)."""
        decoded = sum(len(r.output_ids) for r in survivors)
        may = sum(r.max_new_tokens for r in survivors)
        self.current = min(1.0, (decoded + self.schedule.retract_headroom_steps * len(survivors)) / (may + 1))


class OptimisticAdmission:
    """The admission seam's policy: what admitted requests are charged, and retraction."""

    def __init__(self) -> None:
        self.new_token_ratio = NewTokenRatio()

    def charged(self, reqs: Iterable[Req]) -> int:
        """KV slots admitted requests are counted as still needing when a new one asks: the
        unlaunched prompt in full, and only the ratio of the decode part. (`reserved_tokens` is
        what a request may still allocate; reserve admission charges all of it.)"""
        total = 0
        for r in reqs:
            prompt_left = max(0, r.prefill_len - r.launched_len)
            total += prompt_left + math.ceil(self.new_token_ratio.current * max(0, r.reserved_tokens - prompt_left))
        return total

    def retract_for_decode(self, running: list[Req], available: Callable[[], int],
                            retract: Callable[[Req], None]) -> bool:
        """Retract requests (`retract`: the scheduler sends one back to waiting) until the next
        decode step gets one slot per running request (SGLang: check_decode_mem, retract_decode).
        False: not even one request fits until the batch in flight commits its finishes."""
        if available() >= len(running):
            self.new_token_ratio.decay_step()
            return True
        # Retract until a few steps fit (fewer retractions in a row), keeping at least one request.
        steps = self.new_token_ratio.schedule.retract_headroom_steps
        while len(running) > 1 and available() < len(running) * steps:
            # SGLang's order: the request with the fewest outputs goes first, the longer prompt on a tie.
            retract(min(running, key=lambda r: (len(r.output_ids), -r.prompt_len)))
            self.new_token_ratio.after_retract(running)
        return available() >= len(running)
