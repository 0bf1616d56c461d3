"""Constrained decoding (delayed sampling) and per-token logprobs (launch snapshot), in both loops.

The grammar used on the tiny random models cycles through three disjoint token sets, so a mask
built from a state one token behind always allows only tokens the true state forbids: the
`grammar_delayed_sample` symptom shows on the first decode step of every request.
"""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.features.grammar import Grammar
from minisgl.tracer import SpanName

from .conftest import assert_pool_whole

PROMPTS = ["hello there", "the lazy dog jumps over the fox and runs far away", "count 1 to 9:", "abc def",
           "a much longer prompt that needs several chunks to prefill at chunk size sixteen, surely"]
CYCLE = Grammar({0: {5: 1, 6: 1, 7: 1}, 1: {10: 2, 11: 2, 12: 2}, 2: {20: 0, 21: 0, 22: 0}})


def params(grammar: Grammar | None = None, logprobs: int | None = None) -> list[SamplingParams]:
    """Greedy and seeded sampling, one per prompt."""
    return [SamplingParams(max_new_tokens=12, ignore_eos=True, grammar=grammar, logprobs=logprobs,
                           temperature=0.0 if i % 2 == 0 else 0.8, seed=i) for i in range(len(PROMPTS))]


def generate(model: str, loop: str, *disabled: str, sp: list[SamplingParams] | None = None, **kwargs):
    llm = LLM(model, loop=loop, disable=disabled, chunk_size=16, device_delay_ms=2, **kwargs)
    outs = llm.generate(PROMPTS, sp or params(CYCLE))
    assert_pool_whole(llm)
    return llm, outs


@pytest.fixture(scope="module")
def normal_grammar(qwen3):
    llm, outs = generate(qwen3, "normal")
    llm.close()
    return [o.token_ids for o in outs]


def test_grammar_is_checked_at_the_api_boundary(llm):
    with pytest.raises(ValueError, match="leads to state 9"):
        Grammar({0: {5: 9}})
    with pytest.raises(ValueError, match="start state 3"):
        Grammar({0: {5: 0}}, start=3)
    with pytest.raises(ValueError, match="allows no token"):
        Grammar({0: {}})
    with pytest.raises(ValueError, match="at least one step"):
        Grammar.sequence_of([])  # was a bare KeyError
    with pytest.raises(TypeError, match="grammar must be"):
        SamplingParams(grammar={0: {5: 0}})
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["hi"], SamplingParams(grammar=Grammar({0: {10**6: 0}})))


def test_every_output_follows_its_grammar_in_both_loops(qwen3, normal_grammar):
    llm, outs = generate(qwen3, "overlap", trace=True)
    assert [o.token_ids for o in outs] == normal_grammar  # overlap == normal, greedy and seeded
    assert all(CYCLE.accepts_prefix(t) and len(t) == 12 for t in normal_grammar)
    # The delayed sampling is in the timeline: a host span (masks + launch) and a device span per batch.
    lanes = {sp.lane for sp in llm.engine.tracer.resolve() if sp.name == SpanName.SAMPLE}
    assert len(lanes) == 2 and llm.stats.delayed_samples == llm.stats.batches
    llm.close()


def test_batches_without_grammar_are_not_delayed(qwen3):
    llm = LLM(qwen3, loop="overlap")
    llm.generate(PROMPTS, params())
    assert llm.stats.delayed_samples == 0 and llm.stats.batches > 0
    llm.close()


def test_grammar_delayed_sample_off_masks_one_token_behind(qwen3, normal_grammar):
    llm, outs = generate(qwen3, "overlap", "grammar_delayed_sample")
    broken = [o.token_ids for o in outs if not CYCLE.accepts_prefix(o.token_ids)]
    assert len(broken) == len(PROMPTS), broken  # the first decode step's mask is the prefill's
    llm.close()
    llm, outs = generate(qwen3, "normal", "grammar_delayed_sample")  # nothing in flight: the naive mask is right
    assert [o.token_ids for o in outs] == normal_grammar
    llm.close()


def test_demo_add_grammar_digits_then_stop():
    from minisgl import demo_model_path
    digits_then_stop = Grammar.sequence_of([[223], range(18, 28)], repeat_last=True, end=[1])  # " ", digits, EOS
    llm = LLM(demo_model_path(), loop="overlap", device_delay_ms=2)
    outs = llm.generate(["add 17 25:", "count 3 to 9:", "reverse cat dog:"],
                        SamplingParams(max_new_tokens=8, grammar=digits_then_stop))
    assert outs[0].text == " 42" and all(digits_then_stop.accepts_prefix(o.token_ids) for o in outs)
    assert all(o.finish_reason == "stop" for o in outs)
    llm.close()


# ------------------------------------------------------------------ logprobs
def float32_reference(model: str, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at each generated position: [len(tokens), vocab]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1:-1]
    return logits.float().log_softmax(-1)


@pytest.fixture(scope="module")
def normal_logprobs(qwen3):
    llm, outs = generate(qwen3, "normal", sp=params(logprobs=3))
    llm.close()
    return outs


def test_logprobs_identical_in_both_loops_under_chunked_prefill(qwen3, normal_logprobs):
    llm, outs = generate(qwen3, "overlap", sp=params(logprobs=3))
    assert [o.logprobs for o in outs] == [o.logprobs for o in normal_logprobs]
    for o in outs:
        assert [lp.token_id for lp in o.logprobs] == o.token_ids and all(len(lp.top) == 3 for lp in o.logprobs)
    llm.close()


def test_logprobs_match_a_float32_reference(qwen3, normal_logprobs):
    for out in normal_logprobs[:3]:
        ref = float32_reference(qwen3, out.prompt_token_ids, out.token_ids)
        chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([lp.logprob for lp in out.logprobs]), chosen, atol=1e-4)
        top = ref.topk(3, dim=-1)
        assert [[t for t, _ in lp.top] for lp in out.logprobs] == top.indices.tolist()
        assert torch.allclose(torch.tensor([[v for _, v in lp.top] for lp in out.logprobs]), top.values, atol=1e-4)


def test_logprob_snapshot_off_each_logprob_lands_one_token_late(qwen3, normal_logprobs):
    llm, outs = generate(qwen3, "overlap", "logprob_snapshot", sp=params(logprobs=3))
    assert [o.token_ids for o in outs] == [o.token_ids for o in normal_logprobs]  # the tokens are right
    for out, ref in zip(outs, normal_logprobs):
        # The live lengths are one ahead wherever batch n+1 had already launched the request's next
        # position: entry i then holds token i-1's logprob (or nothing), no longer token i's.
        misplaced = [i for i, (lp, token) in enumerate(zip(out.logprobs, out.token_ids))
                     if lp is None or lp.token_id != token or lp != ref.logprobs[i]]
        assert len(misplaced) >= len(out.token_ids) // 2, (misplaced, out.logprobs)
        late = [i for i in range(1, len(ref.logprobs)) if out.logprobs[i] == ref.logprobs[i - 1]]
        assert late, out.logprobs
    llm.close()
