"""Admission policies: how much KV a request must be able to get before it is admitted.

- "reserve" (the default): the pool must promise a new request everything it may ever need,
  prompt + max_new_tokens + 1 overshoot slot, on top of what running requests were promised.
  A running request then never runs out of slots and nothing is ever retracted.
- "optimistic" (SGLang's default behaviour; lessons/readings §15): a new request is still
  charged in full, but running requests are charged only a fraction of the decode slots they
  may still take, the *new-token ratio*. The ratio starts high, decays a little after every
  decode step that found its slots, and is raised again after a retraction. When a decode
  step cannot get one slot per running request, the scheduler retracts requests
  (`Scheduler._retract_for_decode`): they give their KV back and wait to be re-prefilled.

The numbers are SGLang's defaults (checked in readings §15), except the decay length and the
retraction headroom, scaled down for runs of a few hundred steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Literal

from .request import Req

Admission = Literal["reserve", "optimistic"]


@dataclass(frozen=True)
class RatioSchedule:
    init: float = 0.7  # SGLang: SGLANG_INIT_NEW_TOKEN_RATIO
    min_factor: float = 0.14  # SGLang: SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR (min = init * factor)
    decay_steps: int = 100  # SGLang: 600 (SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS); our runs are shorter
    retract_headroom_steps: int = 4  # SGLang: 20 (SGLANG_RETRACT_DECODE_STEPS); our pools are smaller


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


def optimistic_charge(reqs: Iterable[Req], ratio: float) -> int:
    """KV slots that admitted requests are counted as still needing when a new one asks (optimistic).

    `reserved_tokens` is what a request may still allocate: its admission promise minus what it
    allocated (reserve charges exactly that sum, kept in `Scheduler._reserved`). Optimistic
    charges the unlaunched prompt in full and only `ratio` of the decode part."""
    total = 0
    for r in reqs:
        prompt_left = max(0, r.prefill_len - r.launched_len)
        total += prompt_left + math.ceil(ratio * max(0, r.reserved_tokens - prompt_left))
    return total
