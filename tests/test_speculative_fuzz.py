"""The differential fuzz (test_fuzz.py) over speculative decoding and mixed chunk: both loops, random
aborts, flushes and arrivals, against the plain normal loop without aborts. Greedy requests only
under speculation (its sampling keeps the target's distribution, not the plain sampler's tokens:
test_speculative.py tests that), with max_new_tokens cut to what the pool can promise a verify."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from minisgl import LLM

from .test_fuzz import FUZZ_SECONDS, FUZZ_SEED, Scenario, check_scenario, draw_scenario

K = 2


def for_speculation(sc: Scenario) -> Scenario:
    kv_tokens = sc.engine["kv_tokens"]
    params = [replace(p, temperature=0.0, seed=None,
                      max_new_tokens=max(1, min(p.max_new_tokens, kv_tokens - len(prompt) - 2 * (K + 1))))
              for p, prompt in zip(sc.params, sc.prompts)]
    keep = [i for i, prompt in enumerate(sc.prompts) if len(prompt) + 1 + 2 * (K + 1) <= kv_tokens]
    return replace(sc, prompts=[sc.prompts[i] for i in keep], params=[params[i] for i in keep],
                   arrival=[sc.arrival[i] for i in keep],
                   abort_at={keep.index(i): t for i, t in sc.abort_at.items() if i in keep})


def fuzz(qwen3: str, seconds: float, **features) -> None:
    with LLM(qwen3) as llm:
        vocab = llm.engine.model.vocab_size
    start = time.perf_counter()
    scenarios = requests = aborts = 0
    speculating = "speculative_algorithm" in features
    while scenarios == 0 or time.perf_counter() - start < seconds:
        sc = draw_scenario(FUZZ_SEED * 1_000_003 + scenarios, vocab)
        if speculating:
            sc = for_speculation(sc)
        if sc.prompts:
            n, sent = check_scenario(qwen3, sc, **features)
            requests, aborts = requests + n, aborts + sent
        scenarios += 1
    print(f"\nfuzz {features}: {scenarios} scenarios, {requests} requests, {aborts} aborts, 0 mismatches")
    assert aborts > 0 or scenarios < 3  # the run did exercise aborts


@pytest.mark.parametrize("features", [
    pytest.param(dict(speculative_algorithm="ngram", speculative_num_steps=K), id="ngram"),
    pytest.param("standalone", id="standalone", marks=pytest.mark.full),
    pytest.param(dict(enable_mixed_chunk=True), id="mixed-chunk"),
])
def test_features_match_plain_decoding_under_random_aborts(qwen3, features):
    if features == "standalone":  # the target drafts for itself: every draft is accepted
        features = dict(speculative_algorithm="standalone", speculative_draft_model_path=qwen3,
                        speculative_num_steps=K)
    fuzz(qwen3, FUZZ_SECONDS / 2, **features)
