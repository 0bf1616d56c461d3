"""EngineConfig: what resolve_config derives from config.json before any weight is loaded
must agree with what the engine then allocates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minisgl import LLM
from minisgl.config import DEFAULTS


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # llama: tied embeddings; qwen3: explicit head_dim
def test_sizes_read_before_loading_match_the_loaded_engine(tiny_models, arch):
    with LLM(tiny_models[arch], device="cpu", kv_tokens=100, max_running_requests=3) as llm:
        config, engine = llm.config, llm.engine
        kv = engine.kv
        allocated_kv = sum(t.numel() * t.element_size() for t in kv.k + kv.v)
        assert allocated_kv == (config.kv_tokens + 1) * config.kv_bytes_per_token  # slot 0 is reserved
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        assert 0.98 * weights <= config.weight_bytes <= weights  # norms (and biases) left out
        assert engine.req_to_token.table.shape == (3, config.table_width)
        assert config.model_window == engine.model.config.max_position_embeddings


def test_default_sizes_come_from_the_defaults(qwen3):
    with LLM(qwen3, device="cpu") as llm:
        config = llm.config
        assert config.max_running_requests == DEFAULTS.max_running_requests_cpu
        assert config.chunk_size == DEFAULTS.chunk_size_cpu
        assert config.kv_tokens == max(DEFAULTS.kv_tokens_min, min(DEFAULTS.kv_host_bytes // config.kv_bytes_per_token,
                                                                    DEFAULTS.kv_tokens_max_cpu))
        assert config.dtype == torch.float32 and config.attention_backend == "torch"
        assert llm.mechanisms is config.mechanisms is llm.scheduler.mechanisms


def test_config_is_frozen(llm):
    with pytest.raises(dataclasses.FrozenInstanceError):
        llm.config.kv_tokens = 5  # type: ignore[misc]


@pytest.mark.parametrize("kv_tokens", [100, 10_000])
def test_max_seq_len_and_table_width(qwen3, kv_tokens):
    # The pool or the model's window, whichever is smaller, bounds a request: max_seq_len for
    # prompt + new tokens, and one more position (the overshoot step) for the table.
    with LLM(qwen3, kv_tokens=kv_tokens) as llm:
        window = llm.config.model_window
        assert window < 10_000  # the tiny checkpoint: the second case is bounded by the window
        assert llm.max_seq_len == min(window, kv_tokens - 1)
        assert llm.config.table_width == min(window + 1, kv_tokens)


# Issue 26 (robust at the API boundary)
@pytest.mark.parametrize("kv_tokens", [1, 2])
def test_kv_pool_too_small_for_any_prompt_is_refused(qwen3, kv_tokens):
    with pytest.raises(ValueError, match="kv_tokens"):
        LLM(qwen3, kv_tokens=kv_tokens)


def test_small_heads_never_resolve_to_flashinfer():
    """FlashInfer 0.6.6 has no kernels for head_dim 32 (the demo model's; measured on the H200):
    "auto" takes the torch backend there, and asking for flashinfer is one ValueError."""
    import torch

    from minisgl.config import resolve_attention_backend

    cuda = torch.device("cuda")  # a device object only: no GPU is needed to resolve the choice
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 32) == "torch"
    with pytest.raises(ValueError, match="head_dim >= 64"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 32)
