"""minisgl.demo.tiny: random checkpoints that transformers loads offline."""

import json

import pytest
import torch

from minisgl.demo.tiny import ARCHS, make_tiny, train_bpe_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(root / arch, arch, seed=0) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_make_tiny_loads_with_transformers(tiny_dirs, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_dirs[arch]
    assert (path / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 2
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert cfg.intermediate_size == 128 and cfg.max_position_embeddings == 2048
    assert cfg.vocab_size == len(tok)
    assert 256 < len(tok) <= 512
    for name in ("eos", "bos", "pad"):
        tid = getattr(tok, f"{name}_token_id")
        assert tid is not None
        assert getattr(cfg, f"{name}_token_id") == tid
        assert getattr(model.generation_config, f"{name}_token_id") == tid
    assert tok.eos_token == "<|eos|>" and tok.bos_token == "<|bos|>" and tok.pad_token == "<|pad|>"
    assert next(model.parameters()).dtype == torch.float32

    ids = tok("The overlap scheduler hides the gap.", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "The overlap scheduler hides the gap."
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def _state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_same_seed_same_weights(tiny_dirs, tmp_path):
    again = make_tiny(tmp_path / "again", "qwen3", seed=0)
    a, b = _state(tiny_dirs["qwen3"]), _state(again)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = _state(make_tiny(tmp_path / "other", "qwen3", seed=1))
    assert any(not torch.equal(a[k], other[k]) for k in a)


def test_unknown_arch_raises(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_tiny(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="preset"):
        make_tiny(tmp_path / "y", "qwen3", preset="huge")


def test_qwen3_06b_config_only(tmp_path):
    """The 0.6B preset's config, written without allocating any weights."""
    from transformers import AutoConfig

    path = make_tiny(tmp_path / "q06", "qwen3", preset="qwen3-0.6b", config_only=True)
    assert not (path / "model.safetensors").exists()
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (1024, 28)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 8, 128)
    assert cfg.intermediate_size == 3072
    assert cfg.vocab_size == 151936
    assert cfg.tie_word_embeddings is True
    assert cfg.max_position_embeddings == 40960
    assert cfg.initializer_range == 0.02
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_theta"] == 1e6
    assert raw.get("dtype", raw.get("torch_dtype")) == "bfloat16"
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id


def test_train_bpe_tokenizer_roundtrip(tmp_path):
    from transformers import AutoTokenizer

    texts = ["count 3 to 9: 3 4 5 6 7 8 9", "reverse cat dog: dog cat", "hello world, 12 + 30 = 42"] * 20
    train_bpe_tokenizer(texts, 300, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|eos|>" and cfg["bos_token"] == "<|bos|>" and cfg["pad_token"] == "<|pad|>"
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for s in ["count 3 to 9: 3 4 5", "unseen words: Zürich ✓", " 1234"]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
    # digits are split one by one
    assert len(tok.encode("1234")) == 4
    # nothing is added automatically
    assert tok.encode("cat") == tok.encode("cat", add_special_tokens=False)
