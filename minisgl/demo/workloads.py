"""A workload that fills the KV pool with promises it does not use: the demo's answers stop early
(EOS after a few tokens) under a long max_new_tokens, while every other request ignores EOS and
decodes to its limit. Reserve admission then keeps the pool mostly promised and empty; optimistic
admission runs more requests at once and has to retract some (lesson 10, the retraction tests)."""

from __future__ import annotations

from ..sampling_params import SamplingParams
from .tasks import demo_prompts


def early_stop_workload(n: int = 24, max_new_tokens: int = 64, seed: int = 0) -> tuple[list[str], list[SamplingParams]]:
    """n demo prompts; odd ones stop at EOS, even ones run to max_new_tokens; every third is seeded sampling."""
    prompts = [prompt for prompt, _ in demo_prompts(n, seed=seed)]
    params = [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=i % 2 == 0,
                             temperature=0.8 if i % 3 == 0 else 0.0, seed=seed * 1000 + i if i % 3 == 0 else None)
              for i in range(n)]
    return prompts, params
