"""EngineConfig: what resolve_config derives from config.json before any weight is loaded
must agree with what the engine then allocates."""

from __future__ import annotations

import dataclasses
from pathlib import Path
import inspect

import pytest
import torch

from minisgl import LLM
from minisgl.config import KV_BUDGET, EngineConfig
from minisgl.settings import SETTING, SETTINGS


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


def test_default_sizes_come_from_the_settings(qwen3):
    cpu = torch.device("cpu")
    with LLM(qwen3, device="cpu") as llm:
        config = llm.config
        assert config.max_running_requests == SETTING["max_running_requests"].default_for(cpu)
        assert config.chunk_size == SETTING["chunk_size"].default_for(cpu)
        assert config.kv_tokens == max(KV_BUDGET.min_tokens, min(KV_BUDGET.host_bytes // config.kv_bytes_per_token,
                                                                 KV_BUDGET.max_tokens_cpu))
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


# ---------------------------------------------------------------------------- one settings surface


def test_llm_keywords_are_the_settings_in_order_with_their_defaults():
    """LLM.__init__ writes its keywords out for the reader; they must be exactly the settings table."""
    params = list(inspect.signature(LLM.__init__).parameters.values())[2:]  # after self, model_path
    assert [(p.name, p.default) for p in params] == [(s.name, s.default) for s in SETTINGS]


def test_every_setting_is_an_engine_config_field():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    from_checkpoint = {"model_path", "model_window", "kv_bytes_per_token", "weight_bytes", "draft_kv_bytes_per_token",
                       "draft_weight_bytes"}
    assert {s.field or s.name for s in SETTINGS} == fields - from_checkpoint


@pytest.mark.parametrize("features", [
    dict(speculative_algorithm="standalone", speculative_num_steps=5, speculative_draft_model_path="draft"),
    dict(enable_mixed_chunk=True)])
def test_settings_reach_the_config(qwen3, features):
    if "speculative_draft_model_path" in features:  # the target drafts for itself
        features = {**features, "speculative_draft_model_path": qwen3}
    given = dict(loop="normal", admission="optimistic", chunk_size=64, min_prefill_tokens=32, kv_tokens=300,
                 fused_kernels=False, tensor_core_decode_min_batch=None, host_delay_ms=0.5, fast_decode_plan=False,
                 **features)
    with LLM(qwen3, device="cpu", **given) as llm:
        got = {name: getattr(llm.config, name) for name in given}
    expected = {**given, **({"speculative_draft_model_path": Path(qwen3)} if "speculative_algorithm" in given else {})}
    assert got == expected


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(speculative_algorithm="eagle"), ValueError, "speculative_algorithm must be one of ngram, standalone"),
    (dict(speculative_num_steps=0), ValueError, r"speculative_num_steps must be in \[1, "),
    (dict(speculative_num_steps=2.0), TypeError, "speculative_num_steps must be an integer"),
    (dict(speculative_algorithm="ngram", speculative_draft_model_path="."), ValueError, "read only by .*standalone"),
    (dict(speculative_algorithm="standalone", speculative_draft_model_path="/no/such/dir"), ValueError,
     "not a directory"),
    (dict(speculative_draft_model_path=3), TypeError, "speculative_draft_model_path must be a path"),
    (dict(enable_mixed_chunk="yes"), TypeError, "enable_mixed_chunk must be True or False"),
    (dict(speculative_algorithm="ngram", enable_mixed_chunk=True), ValueError, "does not combine"),
    (dict(speculative_algorithm="standalone"), ValueError, "needs speculative_draft_model_path"),
    (dict(fused_kernels=None), TypeError, "fused_kernels must be True or False"),
    (dict(tensor_core_decode_min_batch=0), ValueError, "tensor_core_decode_min_batch must be in"),
    (dict(kv_tokens=2), ValueError, r"kv_tokens must be in \[3, "),
    (dict(kv_toknes=100), TypeError, "unexpected keyword argument 'kv_toknes'"),
])
def test_bad_settings_are_one_error_naming_them(qwen3, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(qwen3, device="cpu", **kwargs)


def test_cli_flags_are_the_settings(qwen3):
    """Every setting but `trace` (the trace command's own) is a flag of every engine command, with the
    setting's range; build_llm hands the parsed flags to LLM unchanged."""
    from minisgl.frontend.cli import parser
    from minisgl.frontend.options import Number, build_llm

    args = parser().parse_args([
        "generate", "--model", qwen3, "--device", "cpu", "--loop", "normal", "--disable", "future_map,prefill_sync",
        "--kv-tokens", "300", "--chunk-size", "64", "--speculative-algorithm", "standalone",
        "--speculative-num-steps", "5", "--speculative-draft-model-path", qwen3,
        "--no-fused-kernels", "--tensor-core-decode-min-batch", "none"])
    with build_llm(args) as llm:
        config = llm.config
    assert (config.loop, config.kv_tokens, config.chunk_size) == ("normal", 300, 64)
    assert config.mechanisms.disabled == {"future_map", "prefill_sync"}
    assert (config.speculative_algorithm, config.speculative_num_steps) == ("standalone", 5)
    assert (config.speculative_draft_model_path, config.enable_mixed_chunk) == (Path(qwen3), False)
    assert parser().parse_args(["generate", "--model", qwen3, "--enable-mixed-chunk"]).enable_mixed_chunk is True
    assert (config.fused_kernels, config.tensor_core_decode_min_batch) == (False, None)
    flags = {a.dest: a for a in parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert {s.name for s in SETTINGS if s.cli} == {s.name for s in SETTINGS} - {"trace"}
    for s in SETTINGS:
        if s.cli and s.kind in (int, float):
            number = flags[s.name].type
            assert isinstance(number, Number) and (number.kind, number.low, number.high) == (s.kind, s.low, s.high)
        if s.cli:
            assert flags[s.name].option_strings[0] == "--" + s.name.replace("_", "-")
            assert flags[s.name].default == ([] if s.kind is tuple else s.default)
