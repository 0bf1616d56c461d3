"""Seeded mixed workloads and a driver that runs them through the incremental API."""

from __future__ import annotations

import random
from dataclasses import dataclass

from minisgl import LLM, SamplingParams


@dataclass
class Arrival:
    step: int  # scheduler iteration at which the request is added
    prompt: list[int]
    params: SamplingParams


def random_workload(seed: int, vocab: int, n: int = 10) -> list[Arrival]:
    """Mixed prompt lengths, shared prefixes, max_new_tokens 1..64, greedy and seeded sampling,
    staggered arrivals. Stop tokens are added later by `with_stops` once we know the outputs."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(rng.randint(10, 30))]
    arrivals = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        prompt = shared + tail if rng.random() < 0.4 else tail
        sampled = rng.random() < 0.3
        params = SamplingParams(max_new_tokens=rng.choice([1, 2, 5, 17, 33, 64]),
                                temperature=0.8 if sampled else 0.0, top_k=40 if sampled else -1,
                                top_p=0.95 if sampled else 1.0, seed=rng.randrange(1 << 30) if sampled else None,
                                ignore_eos=True)
        arrivals.append(Arrival(step=rng.choice([0, 0, 0, 1, 3, 7, 12]), prompt=prompt, params=params))
    return arrivals


def with_stops(arrivals: list[Arrival], outputs: list[list[int]], seed: int) -> list[Arrival]:
    """Give about half the requests a stop token that they emit at some step, so that requests
    stop (like EOS) at different steps within one batch."""
    rng = random.Random(seed)
    out = []
    for arrival, tokens in zip(arrivals, outputs):
        params = arrival.params
        if tokens and rng.random() < 0.5:
            stop = tokens[rng.randrange(len(tokens))]
            params = SamplingParams(**{**params.__dict__, "stop_token_ids": (stop,)})
        out.append(Arrival(arrival.step, arrival.prompt, params))
    return out


def run(llm: LLM, arrivals: list[Arrival], max_steps: int = 10_000) -> list[tuple[list[int], str]]:
    """Add each request at its arrival step, step until all finish; outputs in arrival order."""
    rids: dict[int, int] = {}
    results: dict[int, tuple[list[int], str]] = {}
    step = 0
    while len(results) < len(arrivals):
        for i, a in enumerate(arrivals):
            if a.step == step:
                rids[llm.add_request(a.prompt, a.params)] = i
        for out in llm.step():
            results[rids[out.rid]] = (out.token_ids, out.finish_reason)
        step += 1
        assert step < max_steps, "workload did not finish"
    while llm.has_unfinished():  # the overshoot step still in flight
        llm.step()
    return [results[i] for i in range(len(arrivals))]
