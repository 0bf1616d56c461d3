"""API validation: every bad argument to LLM(), SamplingParams or a request gets one clear
error that names it (nothing accepted and answered wrongly later), and requests already in
flight still finish."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.sampling_params import FLOAT32_TINY

from .conftest import GREEDY, assert_one_line_exit_2, assert_pool_whole, drain


@pytest.mark.parametrize("params, message", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
])
def test_bad_sampling_params(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hello"], SamplingParams(**params))


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], GREEDY)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * (llm.max_seq_len + 3)], GREEDY)


def test_token_ids_out_of_vocabulary(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**9]], GREEDY)


def test_kv_pool_too_small_for_request(llm):
    with pytest.raises(ValueError, match="KV slots"):
        llm.generate([[5] * 300], SamplingParams(max_new_tokens=400))


def test_unknown_mechanism(qwen3):
    with pytest.raises(ValueError, match="unknown mechanism"):
        LLM(qwen3, disable=("future_map", "warp_drive"))


def test_bad_request_does_not_disturb_requests_in_flight(llm):
    prompts = ["hello there", "count 1 to 9:", "the lazy dog"]
    ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    rids = [llm.add_request(p, GREEDY) for p in prompts]
    llm.step()
    llm.step()  # now prefilled and decoding, one batch in flight
    with pytest.raises(ValueError):
        llm.add_request("", GREEDY)
    with pytest.raises(ValueError):
        llm.add_request("hello", SamplingParams(temperature=-1))
    with pytest.raises(ValueError):
        llm.add_request([5] * 300, SamplingParams(max_new_tokens=400))
    outs = {}
    while llm.has_unfinished():
        outs.update({o.rid: o for o in llm.step()})
    assert [outs[r].token_ids for r in rids] == ref
    assert_pool_whole(llm)


# Accepted, then broken for good: values the int64 staging buffers cannot hold ---------------
@pytest.mark.parametrize("kwargs", [dict(seed=2**63), dict(seed=-2**63 - 1), dict(seed="7"),
                                    dict(top_k=float("inf")), dict(top_k=float("nan")), dict(top_k=2**63)])
def test_overflowing_params_refused_and_requests_in_flight_finish(llm, reference, kwargs):
    rid = llm.add_request("hello there", GREEDY)
    llm.step()
    with pytest.raises((TypeError, ValueError), match="seed|top_k"):
        llm.add_request("hi", SamplingParams(**kwargs))
    assert drain(llm)[rid].token_ids == reference["hello there"]
    assert_pool_whole(llm)


def test_int64_seed_bounds_are_accepted_and_sample(llm):
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (2**63 - 1, -2**63)]
    outs = llm.generate(["hello", "hello"], params)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert llm.generate(["hello"], params[0])[0].token_ids == outs[0].token_ids  # seeded: reproducible


# Hangs -----------------------------------------------------------------------------------------
def test_negative_chunk_size_refused(qwen3, capsys):
    with pytest.raises(ValueError, match="chunk_size"):
        LLM(qwen3, chunk_size=-1)
    assert_one_line_exit_2(capsys, "generate", "--model", qwen3, "--prompt", "hi", "--chunk-size", "-1")


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1.0])
def test_device_delay_must_be_finite(qwen3, delay):
    with pytest.raises(ValueError, match="device_delay_ms"):
        LLM(qwen3, device_delay_ms=delay)


# Silently coerced ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["kv_tokens", "max_running_requests", "chunk_size"])
def test_zero_size_is_an_error_not_the_default(qwen3, name):
    with pytest.raises(ValueError, match=name):
        LLM(qwen3, **{name: 0})


@pytest.mark.parametrize("prompt", [[1.0, 2], [True, 3], ["1", "2"], b"ab", [b"a"]])
def test_token_ids_must_be_integers(llm, prompt):
    with pytest.raises(TypeError, match="token ids|prompts"):
        llm.generate([prompt], GREEDY)


@pytest.mark.parametrize("kwargs", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(top_k=2.5), dict(seed=1.5), dict(max_new_tokens=True),
                                    dict(stop_token_ids="ab"), dict(ignore_eos="no"), dict(top_p=float("nan"))])
def test_sampling_params_are_not_coerced(kwargs):
    with pytest.raises((TypeError, ValueError), match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_stop_token_ids_must_be_in_vocabulary(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=(10**6,)))


@pytest.mark.parametrize("params", [[None], {"max_new_tokens": 3}, "greedy"])
def test_sampling_params_of_wrong_type(llm, params):
    with pytest.raises(TypeError):
        llm.generate(["hi"], params)
    with pytest.raises(TypeError):
        llm.add_request("hi", params)


def test_context_check_agrees_with_kv_fit(qwen3):
    engine = LLM(qwen3, kv_tokens=100)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    # Every prompt shorter than max_seq_len fits with one new token ...
    (out,) = engine.generate([[5] * (engine.max_seq_len - 1)], one)
    assert len(out.token_ids) == 1
    # ... and the first that does not is refused by the context check, naming kv_tokens.
    with pytest.raises(ValueError, match="context holds 99.*kv_tokens"):
        engine.add_request([5] * 99, one)
    assert_pool_whole(engine)
    engine.close()


def test_sizes_larger_than_free_memory_refused_before_allocating(llm):
    """resolve_config runs check_memory on the config before LLM builds anything: sizes that need more
    than the free memory are one ValueError naming them."""
    from minisgl.config import check_memory

    need = (llm.config.kv_tokens + 1) * llm.config.kv_bytes_per_token  # the KV cache alone
    check_memory(llm.config, free=None)  # a host that does not say: nothing to refuse
    with pytest.raises(ValueError, match=f"kv_tokens={llm.config.kv_tokens}.*GiB"):
        check_memory(llm.config, free=need - 1)


# top_p below float32's range was staged as 0: no token kept, and token 0 sampled at every step.
def test_top_p_that_float32_rounds_to_zero_refused(llm):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1e-50)


def test_smallest_top_p_keeps_the_top_token(llm):
    greedy = llm.generate(["count 1 to 9:"], GREEDY)[0].token_ids
    nucleus = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, top_p=FLOAT32_TINY, seed=3)
    assert llm.generate(["count 1 to 9:"], nucleus)[0].token_ids == greedy


# A generator of stop ids was used up by validation: the request ran with no stop ids at all.
def test_stop_token_ids_from_a_generator_are_kept():
    assert SamplingParams(stop_token_ids=(t for t in (5, 9))).stop_token_ids == (5, 9)


# A lone surrogate gave the tokenizer's "TextEncodeInput must be Union[...]" TypeError.
def test_prompt_that_is_not_unicode_is_one_clear_value_error(llm):
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(["ok \ud800 text"], GREEDY)
    assert len(llm.generate(["hello"], GREEDY)[0].token_ids) == GREEDY.max_new_tokens  # and the engine goes on


# 'cpu:0' reached safetensors, which called the checkpoint "not a valid safetensors file".
def test_cpu_0_is_the_cpu_and_cpu_1_is_refused(qwen3, capsys):
    with LLM(qwen3, device="cpu:0") as llm:
        assert llm.device.type == "cpu" and len(llm.generate(["hi"], GREEDY)[0].token_ids) == GREEDY.max_new_tokens
    with pytest.raises(ValueError, match="device"):
        LLM(qwen3, device="cpu:1")
    assert_one_line_exit_2(capsys, "generate", "--model", qwen3, "--device", "cpu:1", "--prompt", "hi")


# disable=5 or None said "'int' object is not iterable"; disable=[1] was an unknown mechanism.
@pytest.mark.parametrize("disable", [5, None, [1], [["future_map"]], b"future_map"])
def test_disable_of_wrong_type_names_the_argument(qwen3, disable):
    with pytest.raises(TypeError, match="disable"):
        LLM(qwen3, disable=disable)


def test_model_path_that_is_a_file_says_so(qwen3):
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(f"{qwen3}/config.json")


# Issue 26 (robust at the API boundary)
def test_text_prompt_with_ids_beyond_the_vocabulary_is_refused_alone(qwen3):
    with LLM(qwen3) as llm:
        rid = llm.add_request("hello there", GREEDY)
        llm.step()
        vocab, encode = llm.engine.model.vocab_size, llm.tokenizer.encode
        llm.tokenizer.encode = lambda text, **kw: [*encode(text, **kw), vocab + 3]  # a tokenizer larger than the model
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            llm.add_request("hello", GREEDY)
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            llm.generate(["hello", "there"], GREEDY)
        llm.tokenizer.encode = encode
        outs = drain(llm)
        assert list(outs) == [rid] and len(outs[rid].token_ids) == GREEDY.max_new_tokens
        assert_pool_whole(llm)
