"""Edges found by a second attack on the API (after issue 11): each was accepted and then
answered wrongly, or failed with a message that did not say what was wrong. One test per
finding; the checkpoint findings are cases of test_robust.py's BREAKERS."""

from __future__ import annotations

import signal

import pytest

from minisgl import LLM, SamplingParams
from minisgl.request import FLOAT32_TINY
from minisgl.streams import DeviceError

from .conftest import assert_pool_whole, drain
from .test_robust import assert_one_line_exit_2

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


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
    assert len(llm.generate(["hello"], GREEDY)[0].token_ids) == 8  # and the engine goes on


# 'cpu:0' reached safetensors, which called the checkpoint "not a valid safetensors file".
def test_cpu_0_is_the_cpu_and_cpu_1_is_refused(qwen3, capsys):
    with LLM(qwen3, device="cpu:0") as llm:
        assert llm.device.type == "cpu" and len(llm.generate(["hi"], GREEDY)[0].token_ids) == 8
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


# From an on_step callback, close() closed the stream under the running generate() ("stream
# 'engine' is closed"), and a nested generate() or step() took the outer call's results (the
# outer one then raised "can no longer be scheduled").
@pytest.mark.parametrize("call", ["close", "generate", "step"])
def test_driving_the_engine_from_on_step_is_refused(qwen3, call):
    with LLM(qwen3) as llm:
        reference = [o.token_ids for o in llm.generate(["hi", "hello there"], GREEDY)]
        inner = {"close": llm.close, "generate": lambda: llm.generate(["count 1 to 5:"], GREEDY),
                 "step": llm.step}[call]
        with pytest.raises(RuntimeError, match="on_step"):
            llm.generate(["hi", "hello there"], GREEDY, on_step=lambda done: inner())
        drain(llm)  # the aborted requests give back their slots and rows
        assert_pool_whole(llm)
        llm.check_invariants()
        assert [o.token_ids for o in llm.generate(["hi", "hello there"], GREEDY)] == reference


def test_on_step_may_add_requests_and_read_memory(qwen3):
    with LLM(qwen3) as llm:
        added: list[int] = []

        def on_step(done: int) -> None:
            llm.memory_report()
            if not added:
                added.append(llm.add_request("count 1 to 5:", GREEDY))

        assert len(llm.generate(["hi"], GREEDY, on_step=on_step)) == 1
        assert [o.rid for o in drain(llm).values()] == added


def test_with_on_a_closed_llm_raises(qwen3):
    llm = LLM(qwen3)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        with llm:
            pass


# release_allocated off leaks a slot per request finished by a stop token; once the pool was
# short, a step() loop (or generate()) spun forever at 100% CPU with nothing in flight.
def test_requests_that_a_leak_starves_raise_instead_of_spinning(monkeypatch):
    from minisgl import demo_model_path, demo_prompts

    monkeypatch.delenv("MINISGL_CHECK_INVARIANTS")  # the leak is the point here
    with LLM(demo_model_path(), disable=("release_allocated",), kv_tokens=60) as llm:
        params = SamplingParams(max_new_tokens=16)
        for prompt, _ in demo_prompts(20, seed=5):  # each stop-finished request leaks its overshoot slot
            llm.generate([prompt], params)
        llm.flush_cache()
        leaked = 60 - llm.memory_report()["kv_free"]
        assert leaked >= 15
        big = [5] * (60 - 16 - 1 - leaked + 1)  # fits the pool (check_fits), not what is left of it
        rid = llm.add_request(big, params)
        with pytest.raises(RuntimeError, match="wait for KV slots"):
            for _ in range(50):
                llm.step()
        llm.abort(rid)
        assert [o.finish_reason for o in drain(llm).values()] == ["abort"]
        with pytest.raises(RuntimeError, match="wait for KV slots"):  # generate() gets the same answer
            llm.generate([big], params)


# train-demo had its own parser outside the CLI's error handling: --steps 0 trained nothing and
# wrote the untrained model (by default over the shipped demo checkpoint), --steps -1 never
# ended, and --batch-size 0, --lr nan or --threads 0 were tracebacks (exit 1).
@pytest.mark.parametrize("bad", [["--steps", "0"], ["--steps", "-1"], ["--batch-size", "0"], ["--lr", "nan"],
                                 ["--threads", "0"], ["--eval", "-1"]])
def test_train_demo_bad_flags_exit_2_and_write_nothing(tmp_path, capsys, bad):
    out = tmp_path / "demo"
    assert_one_line_exit_2(capsys, "train-demo", "--out", str(out), "--steps", "1", "--eval", "0", *bad)
    assert not out.exists()


# A device error said only "work on stream 'engine' failed", whatever had failed.
def test_device_error_says_what_failed(qwen3):
    with LLM(qwen3) as llm:
        def broken(*args):
            raise IndexError("index 6 is out of bounds")

        llm.engine._forward_and_sample = broken
        with pytest.raises(DeviceError, match="failed: IndexError: index 6 is out of bounds"):
            llm.generate(["hello there"], GREEDY)
        with pytest.raises(RuntimeError, match="failed earlier"):
            llm.generate(["hello there"], GREEDY)


# Ctrl-C while finished requests were turned into outputs (detokenizing): the scheduler had
# handed them over, the KeyboardInterrupt dropped them, and step() never returned them.
def test_ctrl_c_while_outputs_are_made_loses_no_result(qwen3):
    with LLM(qwen3) as llm:
        rids = [llm.add_request("hello there", GREEDY), llm.add_request("count 1 to 5:", GREEDY)]
        decode, fired = llm.tokenizer.decode, []

        def interrupting_decode(*args, **kwargs):
            if not fired:
                fired.append(1)
                signal.raise_signal(signal.SIGINT)
            return decode(*args, **kwargs)

        llm.tokenizer.decode = interrupting_decode
        got = {}
        with pytest.raises(KeyboardInterrupt):
            while llm.has_unfinished():
                got.update({o.rid: o for o in llm.step()})
        got.update(drain(llm))
        assert sorted(got) == rids and all(len(o.token_ids) == 8 for o in got.values())
        assert_pool_whole(llm)


# Ctrl-C between queueing two of generate()'s requests: the unqueued ones were marked
# abandoned, their ids were handed out again, and the next generate() dropped its own
# results ("can no longer be scheduled").
def test_ctrl_c_while_queueing_leaves_later_requests_alone(qwen3):
    with LLM(qwen3) as llm:
        add, calls = llm.scheduler.add, []

        def interrupting_add(req):
            calls.append(1)
            if len(calls) == 2:
                signal.raise_signal(signal.SIGINT)
            return add(req)

        llm.scheduler.add = interrupting_add
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a b", "c d", "e f", "g h"], GREEDY)
        llm.scheduler.add = add
        outs = llm.generate(["hello", "count 1 to 5:", "x y"], GREEDY)
        assert [len(o.token_ids) for o in outs] == [8, 8, 8]
        drain(llm)
        assert_pool_whole(llm)


# A second Ctrl-C that cut a step's context exit short left the (generator) context suspended;
# closing it later latched GeneratorExit as the scheduler's error: "the engine failed earlier
# (GeneratorExit: )". Seen with interrupts every few milliseconds on the step() interface.
def test_a_step_context_never_exited_latches_nothing_and_restores_the_handler():
    import gc
    from types import SimpleNamespace

    from minisgl.interrupts import atomic_step

    handler = signal.getsignal(signal.SIGINT)
    owner = SimpleNamespace(error=None)
    context = atomic_step(owner)
    context.__enter__()
    del context  # its __exit__ never runs
    gc.collect()
    assert owner.error is None
    assert signal.getsignal(signal.SIGINT) is handler


# `python -m minisgl` imported torch and transformers from minisgl/__init__ before the command
# line's Ctrl-C handling began: a Ctrl-C in those seconds was a traceback, not "interrupted".
def test_the_command_line_module_starts_without_torch():
    import subprocess
    import sys

    code = "import sys, minisgl.__main__; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
