"""Greedy tokens identical to Hugging Face transformers (float32, CPU) for all three families."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl import LLM, SamplingParams

from .conftest import assert_pool_whole, tiered

PROMPTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "count 3 to 9:",
    "In a small village by the sea there lived an old fisherman who every morning went out " * 3,
]
NEW_TOKENS = 40


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Reference: full-sequence forward each step, argmax of the last position."""
    seq = torch.tensor([ids])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(seq).logits[0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.fixture(scope="module")
def references(tiny_models):
    refs = {}
    for arch, path in tiny_models.items():
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs[arch] = [hf_greedy(model, tok.encode(p), NEW_TOKENS) for p in PROMPTS]
    return refs


# The fast tier: one family per loop (every family runs alone in test_greedy_parity_single); the full tier all.
@pytest.mark.parametrize("loop, arch", tiered([(loop, arch) for loop in ("normal", "overlap")
                                               for arch in ("llama", "qwen2", "qwen3")],
                                              [("normal", "qwen3"), ("overlap", "llama")]))
def test_greedy_parity_batch(tiny_models, references, arch, loop):
    llm = LLM(tiny_models[arch], loop=loop)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for out, ref in zip(outs, references[arch]):
        assert out.token_ids == ref
        assert out.finish_reason == "length"
    assert_pool_whole(llm)
    llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_parity_single(tiny_models, references, arch):
    llm = LLM(tiny_models[arch])
    for prompt, ref in zip(PROMPTS, references[arch]):
        (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert out.token_ids == ref
    assert_pool_whole(llm)
    llm.close()


def test_text_is_detokenized_output(qwen3):
    tok = AutoTokenizer.from_pretrained(qwen3)
    llm = LLM(qwen3)
    (out,) = llm.generate(["hello"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    llm.close()


def test_tied_config_with_a_different_stored_head_uses_the_head_like_transformers(qwen3, tmp_path):
    """tie_word_embeddings true, and a stored lm_head.weight that differs from the embedding: transformers
    warns and uses the stored head (modeling_utils.tie_weights). Tying anyway answered other tokens silently."""
    folder = tmp_path / "tied"
    shutil.copytree(qwen3, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # transformers kept the stored head
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LLM(folder) as llm:
            outs = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, tok.encode(p), 16) for p in PROMPTS[:2]]
    assert any("tie_word_embeddings" in str(w.message) for w in caught)  # and says so, as transformers does
