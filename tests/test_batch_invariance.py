"""The CPU forward is batch-invariant by default: a request's logprobs come out bit for bit the
same alone or in a batch, at any chunk size, with its prefix from the radix cache or computed,
after a retraction, in either loop. So its tokens agree by construction, even at a near-tie:
here one is built (two top logits less than 1e-5 apart, the size of the drift a
batch-dependent float32 forward shows) and resolves the same way in every case."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams, demo_model_path
from minisgl.demo.workloads import early_stop_workload

from .conftest import assert_pool_whole, copy_model

PROMPT = [17, 99, 4, 230, 61, 8, 145, 77, 3, 190, 52, 211, 36, 9, 120, 64, 88, 5, 173, 41, 26, 150]
OTHERS = [[5, 6, 7], [200, 31, 9, 14, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83], list(range(40, 75))]
A, B = 300, 301  # the near-tie's tokens (not in PROMPT)
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=5)


def bits(out) -> list:
    """A request's tokens and every logprob float of them (== on floats is bit equality here)."""
    return [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]


def alone_and_batched(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list]:
    """The prompt's bits: alone from an empty cache, in a batch (its prefix now cached), in a
    batch again from an empty cache."""
    llm.flush_cache()
    runs = [bits(llm.generate([prompt], params)[0])]
    runs.append(bits(llm.generate([OTHERS[0], prompt, *OTHERS[1:]], params)[1]))
    llm.flush_cache()
    runs.append(bits(llm.generate([*OTHERS, prompt], params)[-1]))
    return runs


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_logprobs_are_bit_equal_alone_batched_chunked_and_cached(qwen3, loop):
    with LLM(qwen3, loop="normal") as llm:
        expected = bits(llm.generate([PROMPT], PARAMS)[0])
    for chunk_size in (None, 5, 16):
        with LLM(qwen3, loop=loop, chunk_size=chunk_size) as llm:
            for i, got in enumerate(alone_and_batched(llm, PROMPT, PARAMS)):
                assert got == expected, f"{loop} loop, chunk size {chunk_size}, case {i}: other bits"
            assert_pool_whole(llm)


def test_a_prefix_decoded_once_is_the_same_prefilled_or_cached(qwen3):
    """The prompt plus its first outputs as a new prompt: the outputs' K/V were written by decode
    steps (kept in the radix cache) or are now prefilled: the continuation's bits are the same."""
    with LLM(qwen3, loop="normal") as llm:
        first = llm.generate([PROMPT], PARAMS)[0]
        longer = PROMPT + first.token_ids[:4]
        params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=5)
        from_cache = bits(llm.generate([longer], params)[0])
        llm.flush_cache()
        prefilled = bits(llm.generate([longer], params)[0])
    assert from_cache == prefilled == bits(first)[4:]


@pytest.mark.full  # 20 s: the retraction workload twice
def test_retraction_keeps_the_logprob_bits():
    """Optimistic admission retracts requests and prefills their outputs again: the same bits
    as reserve admission, which never retracts."""
    prompts, params = early_stop_workload()
    params = [SamplingParams(**{**p.__dict__, "logprobs": 2}) for p in params]
    outs = {}
    for admission in ("reserve", "optimistic"):
        with LLM(demo_model_path(), loop="overlap", admission=admission, kv_tokens=200) as llm:
            outs[admission] = [bits(o) for o in llm.generate(prompts, params)]
            retractions = llm.stats.retractions
    assert retractions > 0, "the workload must force retractions"
    assert outs["optimistic"] == outs["reserve"]


@pytest.fixture(scope="module")
def near_tie(qwen3, tmp_path_factory) -> str:
    """A copy of the tiny model whose lm_head makes tokens A and B the top two after PROMPT, their
    logits about 1e-6 apart, and the gap sensitive to the final hidden state h: row A is 6 h/|h|^2,
    row B that plus 1e-6 h/|h|^2 plus a unit vector orthogonal to h (0 on h, not on a drifted h)."""
    path = copy_model(qwen3, tmp_path_factory.mktemp("near_tie") / "model")
    seen = []
    with LLM(path, loop="normal") as llm:
        hook = llm.engine.model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0][-1].clone()))
        llm.generate([PROMPT], SamplingParams(max_new_tokens=1))
        hook.remove()
    h = seen[-1].double()
    unit = h / h.dot(h)  # unit . h == 1
    across = torch.randn(h.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    across -= across.dot(h) * unit
    weights = load_file(path / "model.safetensors")
    head = weights["lm_head.weight"]
    head[A] = (6.0 * unit).float()
    head[B] = ((6.0 + 1e-6) * unit + across / across.norm()).float()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_near_tie_resolves_the_same_way_everywhere(near_tie, loop):
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=2)
    with LLM(near_tie, loop="normal") as llm:
        expected = bits(llm.generate([PROMPT], params)[0])
    (token, _, top) = expected[0]
    assert {t for t, _ in top} == {A, B} and abs(top[0][1] - top[1][1]) < 1e-5, top  # the tie was built
    for chunk_size in (None, 3, 7):
        with LLM(near_tie, loop=loop, chunk_size=chunk_size) as llm:
            for i, got in enumerate(alone_and_batched(llm, PROMPT, params)):
                assert got[0][0] == token, f"the near-tie went the other way ({loop}, chunk {chunk_size}, case {i})"
                assert got == expected
