"""Lifecycle: close, use after close, errors on the worker thread, failed constructors, dropped
engines, re-entrant calls from on_step and concurrent callers: each ends cleanly, with no
thread left behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.streams import DeviceError
from minisgl.tracer import SpanName

from .conftest import GREEDY, assert_pool_whole, copy_model, drain, no_thread_left_behind


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


def test_with_on_a_closed_llm_raises(qwen3):
    llm = LLM(qwen3)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        with llm:
            pass


# An error on the worker thread ----------------------------------------------------------------
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


# Before the first test that asks for the module's shared engine (`llm`): settings are given back
# when the last engine of the process closes, and that one lives until the module's end.
def test_close_gives_back_torch_threads_and_the_switch_interval(qwen3):
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(2)
    sys.setswitchinterval(0.004)
    try:
        first, second = LLM(qwen3), LLM(qwen3)
        first.close()
        assert torch.get_num_threads() == 1  # the second engine still runs
        second.close()
        assert (torch.get_num_threads(), sys.getswitchinterval()) == (2, pytest.approx(0.004))
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)


# generate() keeps other requests' results -----------------------------------------------------
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


# A failed LLM() stops what it started ---------------------------------------------------------
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
                assert len(engine.generate(["hello"], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


def test_dropped_engine_stops_its_thread(qwen3):
    with no_thread_left_behind():
        engine = LLM(qwen3, loop="overlap")
        engine.add_request("hello", GREEDY)
        engine.step()  # a batch in flight, never committed: the caller just drops the engine
        del engine
        gc.collect()



# A daemon thread still inside generate() when the interpreter exits: the exit-time finalizer
# stops the engine under it, and the thread printed the stopped stream's error (a traceback
# under exit code 0). It now ends with the interpreter, silently, as daemon threads do.
DAEMON_SCRIPT = """
import sys, threading
from minisgl import LLM, SamplingParams
llm = LLM(sys.argv[1])
inside = threading.Event()
def work():
    llm.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=1500, ignore_eos=True), on_step=lambda n: inside.set())
threading.Thread(target=work, daemon=True).start()
assert inside.wait(60)
print("main returns")
"""


@pytest.mark.parametrize("loop", ["overlap", pytest.param("normal", marks=pytest.mark.full)])
def test_a_daemon_thread_inside_generate_at_exit_ends_quietly(qwen3, loop):
    script = DAEMON_SCRIPT.replace("LLM(sys.argv[1])", f"LLM(sys.argv[1], loop={loop!r})")
    done = subprocess.run([sys.executable, "-c", script, qwen3], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["main", "returns"], done.stderr
    assert done.stderr == "", done.stderr

# No limits -----------------------------------------------------------------------------------
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


# Issue 26 (robust at the API boundary)
def test_llm_in_a_forked_child_refuses_instead_of_hanging(qwen3):
    with LLM(qwen3) as llm:
        llm.generate(["hello"], GREEDY)
        pid = os.fork()
        if pid == 0:  # the child: every call refuses at once, close() returns
            code = 3
            try:
                llm.generate(["hello"], GREEDY)
            except RuntimeError as exc:
                code = 0 if "fork()" in str(exc) else 4
            llm.close()
            os._exit(code)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert len(llm.generate(["hello"], GREEDY)[0].token_ids) == GREEDY.max_new_tokens  # the parent still works
