"""Exercise 5: at the commit point a finished request hands exactly its committed KV to the radix cache."""

import pytest

from minisgl import LLM, SamplingParams, demo_model_path, demo_prompts

from .conftest import assert_pool_whole

FIVE = SamplingParams(max_new_tokens=5, ignore_eos=True)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_finished_request_leaves_its_committed_kv_in_the_cache(qwen3, loop):
    llm = LLM(qwen3, loop=loop)
    (out,) = llm.generate(["hello there"], FIVE)
    prompt = out.prompt_token_ids
    # KV exists for the prompt and the first 4 outputs: the 5th token was sampled, never fed back.
    assert llm.memory_report()["kv_cached"] == len(prompt) + 4
    longer = prompt + out.token_ids
    (again,) = llm.generate([longer], FIVE)
    assert llm.stats.cached_tokens == len(prompt) + 4  # the second request reused all of it
    (cold,) = LLM(qwen3, loop="normal").generate([longer], FIVE)
    assert again.token_ids == cold.token_ids  # ...and what it read was right
    assert_pool_whole(llm)


def test_overshoot_kv_is_not_checkpointed(qwen3):
    (ref,) = LLM(qwen3, loop="normal").generate(["abc"], SamplingParams(max_new_tokens=20, ignore_eos=True))
    k = next(i for i, t in enumerate(ref.token_ids) if i >= 2 and t not in ref.token_ids[:i])
    llm = LLM(qwen3, loop="overlap")
    (out,) = llm.generate(["abc"], SamplingParams(max_new_tokens=20, stop_token_ids=(ref.token_ids[k],)))
    assert out.token_ids == ref.token_ids[:k + 1] and out.finish_reason == "stop"
    assert llm.stats.overshoot_tokens == 1  # a step past the stop token was in flight...
    # ...but only KV written by committed batches is cached: prompt + k outputs.
    assert llm.memory_report()["kv_cached"] == len(out.prompt_token_ids) + k
    assert_pool_whole(llm)


def test_lesson_7_workload_overlap_equals_normal():
    """Requests end by length at different steps while others keep decoding (lesson 7, demo model)."""
    prompts = [p for p, _ in demo_prompts(16, seed=0)]
    params = [SamplingParams(max_new_tokens=2 + i % 5) for i in range(len(prompts))]
    outs = {}
    for loop in ("normal", "overlap"):
        llm = LLM(demo_model_path(), loop=loop, kv_tokens=4096)
        outs[loop] = [o.token_ids for o in llm.generate(prompts, params)]
        assert_pool_whole(llm)
    assert outs["overlap"] == outs["normal"]
