"""The shipped demo model: loads offline, is small, and answers held-out prompts."""

import json
import random

import pytest
import torch

from minisgl.demo import paths
from minisgl.demo import tasks as demo_tasks
from minisgl.demo.paths import demo_model_path
from minisgl.demo.tasks import demo_prompts, is_held_out, iter_examples, make_example

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo_dir():
    return demo_model_path()


@pytest.fixture(scope="module")
def tok(demo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(demo_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(demo_dir, local_files_only=True)
    m.eval()
    return m


def test_directory_is_complete_and_small(demo_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "TRAINING.md"):
        assert (demo_dir / name).is_file(), name
    size = sum(f.stat().st_size for f in demo_dir.rglob("*") if f.is_file())
    assert size <= 10 * 1024 * 1024, size


def test_config_and_tokenizer_agree(demo_dir, tok, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = AutoConfig.from_pretrained(demo_dir, local_files_only=True)
    assert cfg.model_type in ("qwen3", "llama")
    assert cfg.vocab_size == len(tok)
    assert tok.eos_token == "<|eos|>" and tok.pad_token == "<|pad|>" and tok.bos_token == "<|bos|>"
    assert cfg.eos_token_id == tok.eos_token_id
    assert cfg.pad_token_id == tok.pad_token_id
    assert cfg.bos_token_id == tok.bos_token_id
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id


def test_missing_demo_model_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-demo"):
        paths.demo_model_path(tmp_path)


def test_prompt_answer_boundary_is_clean(tok):
    """Inference tokenizes the prompt alone and detokenizes the answer alone."""
    rng = random.Random(123)
    pairs = [make_example(rng) for _ in range(500)] + demo_prompts(50, seed=3)
    for prompt, answer in pairs:
        assert prompt.endswith(":") and answer.startswith(" ")
        p, a = tok.encode(prompt), tok.encode(answer)
        assert p + a == tok.encode(prompt + answer), (prompt, answer)
        assert tok.decode(a) == answer
        assert tok.eos_token_id not in p + a


def test_held_out_split_never_trained_on():
    held = demo_prompts(200, seed=0)
    assert len({p for p, _ in held}) == 200
    assert all(is_held_out(p) for p, _ in held)
    assert {p.split()[0] for p, _ in held} == set(demo_tasks.TASKS)
    held_prompts = {p for p, _ in held} | {p for p, _ in demo_prompts(100, seed=7)}
    for seed in (0, 1):
        stream = iter_examples(seed, "train")
        for _ in range(20_000):
            prompt, _ = next(stream)
            assert not is_held_out(prompt)
            assert prompt not in held_prompts


def test_demo_prompts_deterministic_and_varied():
    a = demo_prompts(40, seed=0)
    assert a == demo_prompts(40, seed=0)
    assert a[:10] == demo_prompts(10, seed=0)
    assert a != demo_prompts(40, seed=1)
    lengths = {len(ans.split()) for _, ans in a}
    assert min(lengths) == 1 and max(lengths) >= 5  # answers of clearly different lengths


def test_greedy_generation_matches_expected_answers(model, tok):
    from minisgl.demo.train_demo import evaluate

    torch.manual_seed(0)
    result = evaluate(model, tok, demo_prompts(20, seed=0))
    assert result["accuracy"] >= 0.95, result["failures"]
