"""Speculative decoding, mixed chunk and xgrammar on CUDA (run on the H200; skipped without CUDA).

float32 + the torch backend on CUDA streams: speculation (ngram, and standalone with the target as
its own draft) and mixed chunk give plain decoding's tokens in both loops, and the pool comes back
whole. bf16 + FlashInfer + CUDA graphs: the same runs finish whole, and a draft identical to the
target is accepted (a stale length or a wrong relay on the device would make every draft wrong).
With deterministic=True (bf16), the two loops give each other's tokens. xgrammar's bitmask on the
device: JSON that follows the schema in both loops.
"""

from __future__ import annotations

import json

import pytest

from minisgl import LLM, SamplingParams

from .conftest import assert_pool_whole

pytestmark = pytest.mark.cuda
K = 3
PROMPTS = [f"request {i} " * (i % 7 + 1) for i in range(12)]
# No two share a first token, so none can reuse another's cached prefix (see the deterministic test).
DISTINCT_PROMPTS = [f"{chr(97 + i)}{i} request " * (i % 7 + 1) for i in range(12)]
PARAMS = [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True) for i in range(12)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    """The "small" preset (head_dim 128, which FlashInfer's kernels support), as tests/test_cuda.py."""
    from minisgl.demo.tiny import make_tiny

    return str(make_tiny(tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", preset="small", seed=3))


def features(model: str) -> dict[str, dict]:
    return {"ngram": dict(speculative_algorithm="ngram", speculative_num_steps=K),
            "standalone": dict(speculative_algorithm="standalone", speculative_num_steps=K,
                               speculative_draft_model_path=model),
            "mixed chunk": dict(enable_mixed_chunk=True, chunk_size=16)}


def generate(model: str, prompts: list[str] = PROMPTS, **settings) -> tuple[list[list[int]], dict]:
    with LLM(model, device="cuda", **settings) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        assert_pool_whole(llm)
        llm.check_invariants()
        return tokens, vars(llm.stats).copy()


@pytest.mark.parametrize("loop", ["overlap", "normal"])
@pytest.mark.parametrize("feature", ["ngram", "standalone", "mixed chunk"])
def test_features_give_plain_decodings_tokens_float32(qwen3, feature, loop):
    plain, _ = generate(qwen3, dtype="float32", loop="normal")
    got, stats = generate(qwen3, dtype="float32", loop=loop, **features(qwen3)[feature])
    assert got == plain
    if feature != "mixed chunk":
        assert stats["spec_verify_rows"] > 0


@pytest.mark.parametrize("feature", ["ngram", "standalone", "mixed chunk"])
def test_features_on_flashinfer_and_graphs_bf16(qwen3, feature, record_property):
    """bf16 rounds by batch and path (a verify runs K+1 positions through the prefill kernel), so
    tokens are reported against plain decoding, not asserted; lengths, the pool and acceptance are."""
    plain, _ = generate(qwen3, loop="overlap")
    with LLM(qwen3, device="cuda", loop="overlap", **features(qwen3)[feature]) as llm:
        assert type(llm.engine.backend).__name__ == "FlashInferBackend" and llm.engine.graphs is not None
        outs = llm.generate(PROMPTS, PARAMS)
        assert [len(o.token_ids) for o in outs] == [p.max_new_tokens for p in PARAMS]
        assert_pool_whole(llm)
        llm.check_invariants()
        stats = vars(llm.stats)
    same = sum(o.token_ids == p for o, p in zip(outs, plain))
    print(f"bf16 {feature}, overlap, FlashInfer + graphs: {same}/{len(plain)} identical to plain decoding")
    record_property("bf16_identical_to_plain", f"{same}/{len(plain)}")
    if feature == "standalone":  # the draft is the target: all but a near-tie's drafts are accepted
        assert stats["spec_accepted_tokens"] / stats["spec_verify_rows"] > 0.75 * (K + 1)


@pytest.mark.parametrize("feature", ["ngram", "standalone", "mixed chunk"])
def test_features_deterministic_overlap_equals_normal_bf16(qwen3, feature):
    """deterministic=True makes each kernel batch-invariant; the two loops must then run the same
    verify chunks (the drafts and accept lengths relayed on the device, not read late on the host)
    and mixed batches, so their bf16 tokens are equal, although not equal to plain decoding's.

    The prompts share no prefix. The radix cache takes a finished chunk at the commit point, which
    the overlap loop reaches one step later: with mixed chunk's small chunks, a later prompt would
    reuse "request 1"'s cached prefix in the normal loop and recompute it in the overlap loop
    (the same tokens in float32, other bf16 roundings)."""
    normal, _ = generate(qwen3, DISTINCT_PROMPTS, loop="normal", deterministic=True, **features(qwen3)[feature])
    overlap, _ = generate(qwen3, DISTINCT_PROMPTS, loop="overlap", deterministic=True, **features(qwen3)[feature])
    assert overlap == normal


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_xgrammar_json_schema_on_cuda(qwen3, loop):
    from minisgl.features.xgrammar_backend import GrammarCompiler

    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    with LLM(qwen3, device="cuda", loop=loop) as llm:
        compiler = GrammarCompiler(llm.tokenizer, llm.engine.model.vocab_size, llm.eos_ids)
        grammar = compiler.compile("json_schema", json.dumps(schema))
        outs = llm.generate(PROMPTS[:6], [SamplingParams(max_new_tokens=64, grammar=grammar, temperature=t, seed=i)
                                          for i, t in enumerate([0.0, 0.0, 0.7, 1.0, 0.7, 1.0])])
        for out in outs:  # the schema, checked by hand (no jsonschema on the GPU machine)
            value = json.loads(out.text)
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99, out.text
        assert llm.stats.delayed_samples > 0
        assert_pool_whole(llm)
