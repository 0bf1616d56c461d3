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
from typing import Callable, Iterable, Literal

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


# Open the gate anyway once this share of the rows is free (the running batch drained to 7/8 of
# max_running_requests): where the target cannot be reached (short prompts, a small KV pool) the
# decode batch still stays nearly full. At 256 rows that is 32 free rows, more than the ~13
# prompts of the offline workload (~560 tokens each) the 7,168-token default target needs.
GATE_DRAIN_FRACTION = 0.875


@dataclass(frozen=True)
class PrefillGate:
    """Whether new requests may be admitted now, while others decode (issue 27).

    On a GPU an eager prefill batch costs a fixed host time to launch (about 6 ms for the
    Qwen3-0.6B shape) whatever its size, up to a few thousand tokens. Admitted as running
    requests finish, one or two at a time, every prefill batch is that fixed cost. The gate
    lets requests in only when the batch they form is worth a launch. It is open when:

    - `target` is 0 (off: admit whatever fits at every step; the default on the CPU);
    - nothing decodes (the device would idle: never stall);
    - a chunked prompt continues (`prefilling`: the batch launches anyway, new requests ride along);
    - the requests that fit now form at least `target` prompt tokens;
    - the waiting queue holds fewer than `target` tokens in all (slow arrivals: waiting for
      more would only add latency, without bound in an online workload);
    - the running batch has drained to GATE_DRAIN_FRACTION of max_running_requests.

    "Fit now" is an estimate made before admitting: a free row each and their whole KV promise
    against `kv_headroom`, in queue order, as `Scheduler._admit` takes them, but without the
    radix cache's prefix matches (a lookup locks nodes): a cached prefix makes the real batch
    smaller and its promise smaller. The gate only delays admission, `_admit` still decides it.
    """

    target: int  # prompt tokens a prefill batch should reach; 0: off
    max_running_requests: int

    def is_open(self, waiting: Iterable[Req], *, running: int, prefilling: int, free_rows: int,
                kv_headroom: Callable[[], int]) -> bool:
        """`running`, `prefilling`: requests decoding, and admitted with a prompt left to launch;
        `free_rows`: the request table's free rows; `kv_headroom()`: the slots a new request may be
        promised (`Scheduler._kv_headroom`), asked only when the queue must be walked (optimistic
        admission sums over every running request)."""
        if self.target == 0 or running == 0 or prefilling > 0:
            return True
        if running <= GATE_DRAIN_FRACTION * self.max_running_requests:
            return True
        free_rows = min(free_rows, self.max_running_requests - running - prefilling)
        queued = fitting = 0  # prompt tokens in the queue so far, and of the requests that fit
        fits, headroom = True, kv_headroom()
        for req in waiting:
            queued += req.prefill_len
            need = req.prefill_len + req.max_new_tokens - len(req.output_ids) + 1  # _admit's promise, no prefix
            fits = fits and free_rows > 0 and need <= headroom
            if fits:
                fitting += req.prefill_len
                free_rows -= 1
                headroom -= need
            if fitting >= self.target:
                return True
            if not fits and queued >= self.target:
                return False
        return queued < self.target
