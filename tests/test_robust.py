"""Robust at the edges: one test per finding of the reliability review (validation, errors,
lifecycle, checkpoints, limits). Interrupts have their own file (test_interrupts.py), and the
randomized differential run too (test_fuzz.py)."""

from __future__ import annotations

import gc
import json
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams
from minisgl.frontend.cli import main as cli
from minisgl.streams import DeviceError
from minisgl.tracer import SpanName

from .conftest import assert_pool_whole, drain, no_thread_left_behind

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    return {p: llm.generate([p], GREEDY)[0].token_ids for p in ("hello there", "count 1 to 9:")}


def run_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """The CLI in-process: its exit code and its stderr lines (SystemExit from argparse included)."""
    try:
        code = cli(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


def assert_one_line_exit_2(capsys, *argv: str) -> None:
    code, err = run_cli(capsys, *argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), (code, err)


# 1. Accepted, then broken for good: values the int64 staging buffers cannot hold ---------------
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


# 2. Hangs -----------------------------------------------------------------------------------------
def test_negative_chunk_size_refused(qwen3, capsys):
    with pytest.raises(ValueError, match="chunk_size"):
        LLM(qwen3, chunk_size=-1)
    assert_one_line_exit_2(capsys, "generate", "--model", qwen3, "--prompt", "hi", "--chunk-size", "-1")


def test_use_after_close_raises_at_once(qwen3):
    engine = LLM(qwen3)
    rid = engine.add_request("hello", GREEDY)
    engine.close()
    engine.close()  # idempotent
    calls = [lambda: engine.add_request("hi", GREEDY), engine.step, lambda: engine.generate(["hi"], GREEDY),
             lambda: engine.abort(rid), engine.has_unfinished, engine.memory_report, engine.flush_cache,
             engine.collect]
    for call in calls:
        with pytest.raises(RuntimeError, match="closed"):
            call()


# 4. An error on the worker thread ----------------------------------------------------------------
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_worker_error_reaches_caller_once_then_refusal_and_clean_close(qwen3, loop):
    with no_thread_left_behind():
        engine = LLM(qwen3, loop=loop)
        engine.generate(["warm up"], GREEDY)
        forward = engine.engine._forward_and_sample
        calls = []

        def failing(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected device fault")
            forward(*args)

        engine.engine._forward_and_sample = failing
        with pytest.raises(DeviceError) as info:
            engine.generate(["hello there", "count 1 to 9:"], GREEDY)
        assert "injected device fault" in str(info.value.__cause__)
        for call in (lambda: engine.generate(["hi"], GREEDY), engine.step, lambda: engine.add_request("hi")):
            with pytest.raises(RuntimeError, match="failed earlier"):
                call()
        engine.close()  # neither raises nor hangs
        engine.close()


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1.0])
def test_device_delay_must_be_finite(qwen3, delay):
    with pytest.raises(ValueError, match="device_delay_ms"):
        LLM(qwen3, device_delay_ms=delay)


# 5. generate() keeps other requests' results -----------------------------------------------------
def test_generate_leaves_add_request_results_collectable(llm, reference):
    short = llm.add_request("hello there", SamplingParams(max_new_tokens=2, ignore_eos=True))
    long = llm.add_request("count 1 to 9:", SamplingParams(max_new_tokens=60, ignore_eos=True))
    (out,) = llm.generate(["hello there"], GREEDY)
    assert out.token_ids == reference["hello there"]
    llm.abort(short)  # finished during generate(), not collected yet: nothing to abort, no error
    llm.abort(long)  # still running: aborted at the next step
    outs = drain(llm)
    assert outs[short].token_ids == reference["hello there"][:2] and outs[short].finish_reason == "length"
    assert outs[long].finish_reason == "abort"
    assert_pool_whole(llm)


# 6. A wrong model, silently ----------------------------------------------------------------------
def copy_model(src: str, dst) -> "object":
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_tensors(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_model_type_contradicting_architecture_refused(qwen3, tmp_path):
    folder = copy_model(qwen3, tmp_path / "m")
    edit_config(folder, model_type="llama")  # Qwen3ForCausalLM weights, llama type: q/k norms left out
    with pytest.raises(ValueError, match="contradicts"):
        LLM(folder)


def test_unused_checkpoint_tensor_refused_by_name(qwen3, tmp_path):
    folder = copy_model(qwen3, tmp_path / "m")
    edit_tensors(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match="extra_proj"):
        LLM(folder)


# 7. Bad checkpoints: one ValueError from the API, one line and exit 2 from the CLI ---------------
def _truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])


def _corrupt_header(folder):
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:40] = b"#" * 32
    (folder / "model.safetensors").write_bytes(bytes(data))


def _shard_index_without_weight_map(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _unreadable_weights(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()  # exists, cannot be read as a file (even by root)


def _wrong_shape(folder):
    edit_tensors(folder, lambda t: t.update({"model.norm.weight": torch.ones(3)}))


def _stale_second_copy(folder):
    """A stale shard next to model.safetensors: which copy loads would depend on file order."""
    norm = load_file(folder / "model.safetensors")["model.norm.weight"]
    save_file({"model.norm.weight": norm * 0}, folder / "stale.safetensors")
    (folder / "model.safetensors").rename(folder / "fresh.safetensors")


def _rope_theta(value):
    # A transformers 4.x config: rope_theta at the top level, no rope_parameters.
    return lambda f: edit_config(f, rope_parameters=None, rope_theta=value)


# case -> (how to break the copied checkpoint, what the one error message must name)
BREAKERS = {
    "truncated": (_truncate, "model.safetensors"),
    "empty": (lambda f: (f / "model.safetensors").write_bytes(b""), "model.safetensors"),
    "corrupt header": (_corrupt_header, "model.safetensors"),
    "wrong shape": (_wrong_shape, "model.norm.weight"),
    "no vocab_size": (lambda f: edit_config(f, vocab_size=None), "vocab_size"),
    "no hidden_size": (lambda f: edit_config(f, hidden_size=None), "hidden_size"),
    "no head_dim": (lambda f: edit_config(f, head_dim=None), "config implies"),  # Qwen3's default is 128
    "string hidden_size": (lambda f: edit_config(f, hidden_size="64"), "hidden_size"),
    "float vocab_size": (lambda f: edit_config(f, vocab_size=300.5), "vocab_size"),
    "index without weight_map": (_shard_index_without_weight_map, "weight_map"),
    "list generation_config": (lambda f: (f / "generation_config.json").write_text("[1, 2]"), "generation_config"),
    "negative max_position_embeddings": (lambda f: edit_config(f, max_position_embeddings=-5),
                                         "max_position_embeddings"),
    "unreadable weights": (_unreadable_weights, "model.safetensors"),
    # Each of these loaded, and answered token 0 forever (nan) or another model's tokens:
    "nan weight": (lambda f: edit_tensors(f, lambda t: t["model.norm.weight"].fill_(float("nan"))), "nan or inf"),
    "integer weight": (lambda f: edit_tensors(f, lambda t: t.update(
        {"model.norm.weight": t["model.norm.weight"].to(torch.int64)})), "not floating point"),
    "tensor in two files": (_stale_second_copy, "stored twice"),
    "rope_theta 0": (_rope_theta(0), "rope_theta"),
    "rope_theta -1": (_rope_theta(-1), "rope_theta"),
    "rope_theta string": (_rope_theta("big"), "rope_theta"),  # was a TypeError from inside torch
    "linear rope factor 0": (lambda f: edit_config(f, rope_parameters={"rope_type": "linear", "factor": 0,
                                                                       "rope_theta": 10000.0}), "factor"),
}


@pytest.mark.parametrize("case", list(BREAKERS))
def test_malformed_checkpoint_one_error(qwen3, tmp_path, capsys, case):
    folder = copy_model(qwen3, tmp_path / "m")
    breaker, names = BREAKERS[case]
    breaker(folder)
    with no_thread_left_behind():
        with pytest.raises(ValueError, match=names):
            LLM(folder)
    assert_one_line_exit_2(capsys, "generate", "--model", str(folder), "--prompt", "hi")


# 8. A failed LLM() stops what it started ---------------------------------------------------------
def _corrupt_tokenizer(folder):
    (folder / "tokenizer.json").write_text("{ this is not a tokenizer")


@pytest.mark.parametrize("case", ["attention_backend", "flashinfer on cpu", "kv_tokens", "max_running_requests",
                                  "tokenizer"])
def test_failed_constructor_leaves_no_thread(qwen3, tmp_path, case):
    model, kwargs = qwen3, {case: "many"}
    if case == "tokenizer":
        model, kwargs = copy_model(qwen3, tmp_path / "m"), {}
        _corrupt_tokenizer(model)
    elif case == "flashinfer on cpu":
        kwargs = dict(device="cpu", attention_backend="flashinfer")
    with no_thread_left_behind():
        with pytest.raises((TypeError, ValueError)):
            LLM(model, **kwargs)


def test_five_engines_leave_no_thread_behind(qwen3):
    with no_thread_left_behind():
        for i in range(5):
            with LLM(qwen3, loop=("normal", "overlap")[i % 2]) as engine:
                assert len(engine.generate(["hello"], GREEDY)[0].token_ids) == 12


def test_dropped_engine_stops_its_thread(qwen3):
    with no_thread_left_behind():
        engine = LLM(qwen3, loop="overlap")
        engine.add_request("hello", GREEDY)
        engine.step()  # a batch in flight, never committed: the caller just drops the engine
        del engine
        gc.collect()


# 9. Silently coerced ----------------------------------------------------------------------------
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


@pytest.mark.parametrize("argv", [["generate", "--device", "bogus", "--prompt", "hi"],
                                  ["bench", "--num-requests", "-1"], ["bench", "--num-requests", "0"],
                                  ["trace", "--num-requests", "0"]])
def test_cli_bad_device_and_counts_exit_2(qwen3, capsys, argv):
    assert_one_line_exit_2(capsys, *argv, "--model", qwen3)


# 10. No limits -----------------------------------------------------------------------------------
def test_event_log_is_bounded(llm):
    llm.generate(["hello"], GREEDY)
    events = llm.stats.events
    assert getattr(events, "maxlen", None) is not None and len(events) <= events.maxlen
    assert (SpanName.COMMIT, 0) not in events or list(events).index((SpanName.COMMIT, 0)) > list(events).index((SpanName.LAUNCH, 0))


def test_concurrent_generate_from_two_threads_refused(qwen3):
    engine = LLM(qwen3, device_delay_ms=5)
    expected = LLM(qwen3).generate(["hello there"], GREEDY)[0].token_ids
    inside, release = threading.Event(), threading.Event()
    result = []

    def on_step(done: int) -> None:
        inside.set()
        release.wait(5)

    worker = threading.Thread(target=lambda: result.append(engine.generate(["hello there"], GREEDY, on_step=on_step)))
    worker.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match="another thread"):
            engine.generate(["count 1 to 9:"], GREEDY)
        with pytest.raises(RuntimeError, match="another thread"):
            engine.add_request("hi")
    finally:
        release.set()
        worker.join(30)
    assert result[0][0].token_ids == expected
    assert_pool_whole(engine)
    engine.close()


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


def test_sizes_larger_than_free_memory_refused_before_allocating(qwen3, monkeypatch):
    monkeypatch.setattr("minisgl.config.free_memory_bytes", lambda device: 1 << 20)  # a 1 MiB machine
    with no_thread_left_behind():
        with pytest.raises(ValueError, match="kv_tokens=50000.*GiB"):
            LLM(qwen3, kv_tokens=50000)
