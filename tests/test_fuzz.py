"""Randomized differential test: the overlap loop against the normal loop, under random aborts.

Each scenario draws an engine (small KV pool, few rows, small prefill chunks, an optional
device delay) and a workload (shared prompt prefixes for the radix cache, greedy and seeded
sampling, stop ids, staggered arrivals, aborts at random steps, cache flushes). It runs three
times: normal loop without aborts (the reference), then normal and overlap with the aborts.
`check_invariants()` runs after every step. Every request that was not aborted must give the
reference's tokens and finish reason in both loops; an aborted one a prefix of them. After
the drain every pool is whole.

A few seconds by default; longer with MINISGL_FUZZ_SECONDS=600, another sequence of
scenarios with MINISGL_FUZZ_SEED=N. A failure names the scenario seed that reproduces it.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

from minisgl import LLM, SamplingParams

from .conftest import assert_pool_whole

FUZZ_SECONDS = float(os.environ.get("MINISGL_FUZZ_SECONDS", "4"))
FUZZ_SEED = int(os.environ.get("MINISGL_FUZZ_SEED", "0"))


@dataclass
class Scenario:
    seed: int
    engine: dict
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrival: list[int]  # the step before which request i is added
    abort_at: dict[int, int] = field(default_factory=dict)  # request -> step before which it is aborted
    flush_at: set[int] = field(default_factory=set)


def draw_scenario(seed: int, vocab: int) -> Scenario:
    rng = random.Random(seed)
    kv_tokens = rng.randint(48, 320)
    engine = dict(kv_tokens=kv_tokens, max_running_requests=rng.randint(1, 6), chunk_size=rng.randint(4, 48),
                  device_delay_ms=rng.choice([0.0, 0.0, 1.0]))
    stems = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 16))] for _ in range(3)]
    n = rng.randint(1, 8)
    prompts, params = [], []
    for _ in range(n):
        prompt = rng.choice(stems)[:] if rng.random() < 0.6 else []
        prompt += [rng.randrange(3, vocab) for _ in range(rng.randint(0 if prompt else 1, 14))]
        prompts.append(prompt)
        max_new = rng.randint(1, min(24, kv_tokens - len(prompt) - 1))
        sampled = rng.random() < 0.5
        params.append(SamplingParams(
            max_new_tokens=max_new, temperature=rng.uniform(0.3, 1.5) if sampled else 0.0,
            top_k=rng.choice([-1, 1, 5, 50]), top_p=rng.choice([1.0, 0.9, 0.5]),
            seed=rng.randrange(-2**63, 2**63) if sampled else None, ignore_eos=rng.random() < 0.7,
            stop_token_ids=tuple(rng.randrange(3, vocab) for _ in range(rng.randint(0, 2)))))
    arrival = [rng.randint(0, 12) for _ in range(n)]
    abort_at = {i: arrival[i] + rng.randint(0, 16) for i in range(n) if rng.random() < 0.4}
    flush_at = {rng.randint(0, 30) for _ in range(rng.randint(0, 2))}
    return Scenario(seed, engine, prompts, params, arrival, abort_at, flush_at)


def run(model: str, sc: Scenario, loop: str, aborts: bool, **features) -> tuple[dict[int, tuple[list[int], str]], int]:
    """Drive the scenario step by step (with `features`: more LLM settings); returns request ->
    (tokens, finish reason), and how many aborts were sent."""
    llm = LLM(model, loop=loop, **sc.engine, **features)
    rid_of: dict[int, int] = {}
    outs: dict[int, tuple[list[int], str]] = {}
    index_of: dict[int, int] = {}
    sent = 0
    step = 0
    while len(rid_of) < len(sc.prompts) or llm.has_unfinished():
        for i in (i for i, t in enumerate(sc.arrival) if t == step):
            rid_of[i] = llm.add_request(sc.prompts[i], sc.params[i])
            index_of[rid_of[i]] = i
        for i in (i for i, t in sc.abort_at.items() if aborts and t == step and i in rid_of):
            if i not in outs:  # finished and collected: nothing left to abort
                llm.abort(rid_of[i])
                sent += 1
        if step in sc.flush_at:
            llm.flush_cache()
        for out in llm.step():
            outs[index_of[out.rid]] = (out.token_ids, out.finish_reason)
        llm.check_invariants()
        step += 1
        assert step < 2000, f"scenario {sc.seed}: {loop} loop does not finish"
    assert_pool_whole(llm)
    llm.close()
    return outs, sent


def check_scenario(model: str, sc: Scenario, **features) -> tuple[int, int]:
    """Both loops with aborts (and `features`) against the plain normal loop without them."""
    reference, _ = run(model, sc, "normal", aborts=False)
    sent = 0
    for loop in ("normal", "overlap"):
        outs, n = run(model, sc, loop, aborts=True, **features)
        sent += n
        for i, (tokens, reason) in sorted(outs.items()):
            ref_tokens, ref_reason = reference[i]
            where = f"scenario seed {sc.seed}, {loop} loop, request {i}"
            if reason == "abort":
                assert i in sc.abort_at, where
                assert tokens == ref_tokens[:len(tokens)], f"{where}: aborted output is not a prefix"
            else:
                assert (tokens, reason) == (ref_tokens, ref_reason), where
        assert len(outs) == len(sc.prompts), f"scenario seed {sc.seed}, {loop} loop: a request got no output"
    return len(sc.prompts), sent


def test_overlap_matches_normal_under_random_aborts(qwen3):
    with LLM(qwen3) as llm:
        vocab = llm.engine.model.vocab_size
    start = time.perf_counter()
    scenarios = requests = aborts = 0
    while scenarios == 0 or time.perf_counter() - start < FUZZ_SECONDS:
        n, sent = check_scenario(qwen3, draw_scenario(FUZZ_SEED * 1_000_003 + scenarios, vocab))
        scenarios, requests, aborts = scenarios + 1, requests + n, aborts + sent
    print(f"\nfuzz: {scenarios} scenarios (x3 runs), {requests} requests, {aborts} aborts sent, "
          f"{time.perf_counter() - start:.1f} s, seed {FUZZ_SEED}")
    assert aborts > 0 or scenarios < 3  # the run did exercise aborts
