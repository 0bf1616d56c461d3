"""Interrupts and faults at every scheduler phase, in both loops: nothing is lost.

A Ctrl-C (SIGINT) is raised from inside one phase of a step (planning, admission, launch,
the wait for copy_done, the commit, a release...). The step finishes whole and the
KeyboardInterrupt arrives when it ends; then the run resumes or drains, and every token,
KV slot and row is accounted for. A second Ctrl-C inside the same step is the way out of a
hung device: the engine then refuses work, and close() still stops every thread.
"""

from __future__ import annotations

import _thread
import signal
import threading

import pytest

from minisgl import LLM, SamplingParams
from minisgl.demo.paths import demo_model_path

from .conftest import GREEDY, assert_pool_whole, drain, no_thread_left_behind, tiered

PROMPTS = ["hello there", "count 1 to 9:", "the quick brown fox jumps over the lazy dog"]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 14, 10)]
# Scheduler phases (methods), and the engine's launch, where a Ctrl-C may land.
PHASES = ["schedule", "_release_committed_aborts", "_admit", "batch_builder.build", "launch", "commit", "_commit_results",
          "_release", "engine.launch"]
LOOPS = ["normal", "overlap"]
# The fast tier interrupts every phase once, the loops and call counts taken in turn; the full tier all.
IN_STEP = [(loop, phase, at_call) for loop in LOOPS for phase in PHASES for at_call in (1, 3)]
IN_STEP_FAST = {(LOOPS[i % 2], phase, (1, 3)[i // 2 % 2]) for i, phase in enumerate(PHASES)}
IN_GENERATE = [(loop, phase) for loop in LOOPS for phase in PHASES]
IN_GENERATE_FAST = {(LOOPS[(i + 1) % 2], phase) for i, phase in enumerate(PHASES) if i % 3 == 0}


@pytest.fixture(scope="module")
def reference(qwen3):
    with LLM(qwen3, loop="normal") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def interrupt_in(llm: LLM, phase: str, at_call: int, times: int = 1) -> list[int]:
    """Make the `at_call`-th call of `phase` send SIGINT to this process `times` times, then
    carry on. Returns a list that counts the calls."""
    part, _, name = phase.rpartition(".")
    owner = {"": llm.scheduler, "engine": llm.engine, "batch_builder": llm.scheduler.batch_builder}[part]
    original = getattr(owner, name)
    calls: list[int] = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    return calls


def assert_whole(llm: LLM) -> None:
    llm.check_invariants()
    assert_pool_whole(llm)


@pytest.mark.parametrize("loop, phase, at_call", tiered(IN_STEP, IN_STEP_FAST))
def test_interrupt_in_step_loses_no_token(qwen3, reference, loop, phase, at_call):
    llm = LLM(qwen3, loop=loop, chunk_size=8)
    calls = interrupt_in(llm, phase, at_call)
    rids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    outs, interrupts = {}, 0
    while llm.has_unfinished():
        try:
            outs.update({o.rid: o for o in llm.step()})
        except KeyboardInterrupt:
            interrupts += 1  # delivered when the step ended: resume as if nothing happened
        llm.check_invariants()
    assert len(calls) >= at_call and interrupts == 1
    assert [outs[r].token_ids for r in rids] == reference  # no token dropped or repeated
    assert_whole(llm)
    llm.close()


@pytest.mark.parametrize("loop, phase", tiered(IN_GENERATE, IN_GENERATE_FAST))
def test_interrupted_generate_gives_back_its_requests(qwen3, reference, loop, phase):
    llm = LLM(qwen3, loop=loop, chunk_size=8)
    other = llm.add_request(PROMPTS[1], PARAMS[1])  # not generate()'s: must finish untouched
    calls = interrupt_in(llm, phase, at_call=2)
    try:
        llm.generate([PROMPTS[0], PROMPTS[2]], [PARAMS[0], PARAMS[2]])
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    assert len(calls) >= 2 and interrupted
    outs = drain(llm)
    assert outs[other].token_ids == reference[1]
    assert set(outs) == {other}  # generate()'s own requests were aborted, their results dropped
    assert_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference  # usable again
    llm.close()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_second_interrupt_stops_the_engine_cleanly(qwen3, loop):
    with no_thread_left_behind():
        llm = LLM(qwen3, loop=loop)
        interrupt_in(llm, "commit", at_call=2, times=2)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, PARAMS)
        with pytest.raises(RuntimeError, match="failed earlier"):
            llm.generate(PROMPTS, PARAMS)
        llm.close()


@pytest.mark.parametrize("loop", tiered([("normal",), ("overlap",)], [("overlap",)]))
def test_timer_interrupts_from_the_issue(loop):
    """The reproduction of the review: three generate() calls on the demo model, each
    interrupted after 30 ms by another thread. Before the fix rows_free went 62, 60, 58."""
    llm = LLM(demo_model_path(), loop=loop, device_delay_ms=5)
    prompts = [f"add {i} {i + 1}:" for i in range(8)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)  # ~40 steps of >= 5 ms: longer than 30 ms
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    for _ in range(3):
        timer = threading.Timer(0.03, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params)
        timer.join()
        drain(llm)
        assert_whole(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    llm.close()


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
        assert sorted(got) == rids and all(len(o.token_ids) == GREEDY.max_new_tokens for o in got.values())
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


# Issue 26 (robust at the API boundary)
def test_ctrl_c_during_flush_cache_leaks_no_slot(qwen3):
    with LLM(qwen3) as llm:
        llm.generate(["one two three", "four five six", "seven eight"], GREEDY)
        free, calls = llm.scheduler.cache.free_slots, []

        def interrupting_free(slots):
            calls.append(1)
            if len(calls) == 1:
                signal.raise_signal(signal.SIGINT)
            return free(slots)

        llm.scheduler.cache.free_slots = interrupting_free
        with pytest.raises(KeyboardInterrupt):
            llm.flush_cache()
        llm.check_invariants()
        mem = llm.memory_report()
        assert mem["kv_free"] + mem["kv_cached"] == mem["kv_total"], mem
        llm.scheduler.cache.free_slots = free
        llm.flush_cache()
        assert llm.memory_report()["kv_free"] == mem["kv_total"]


# Issue 26, finding 12: a second Ctrl-C is the way out of a hung device. After it, close() and the
# interpreter's exit must not wait for the device work in progress (here a forward that sleeps an
# hour: device_delay_ms at its maximum). In a fresh interpreter, so that its exit is part of the test.
HUNG_DEVICE_SCRIPT = """
import os, signal, sys, threading, time
from minisgl import LLM, SamplingParams

llm = LLM(sys.argv[1], device_delay_ms=3_600_000)  # every forward sleeps an hour on the device's thread
def press_ctrl_c_twice():
    time.sleep(2.0)  # generate() is now waiting for its first forward
    for _ in range(2):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
threading.Thread(target=press_ctrl_c_twice, daemon=True).start()
try:
    llm.generate(["hello"], SamplingParams(max_new_tokens=4))
except KeyboardInterrupt:
    print("interrupted", flush=True)
llm.close()
print("closed", flush=True)
"""


@pytest.mark.full  # a fresh interpreter (~10-30 s)
def test_second_ctrl_c_gets_out_of_a_hung_device_close_and_exit_do_not_wait(qwen3):
    import subprocess
    import sys

    try:  # the hour-long forward would keep a process that waits for it alive far past this bound
        done = subprocess.run([sys.executable, "-c", HUNG_DEVICE_SCRIPT, qwen3], capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("close() or the interpreter's exit waited for the hung device")
    assert done.returncode == 0 and done.stdout.split() == ["interrupted", "closed"], (done.stdout, done.stderr)



def sigint_at(moment: str):
    """A hook that sends one real SIGINT (the OS signal: the interpreter's own pending-signal
    check decides where the KeyboardInterrupt lands) at `moment`, and how to install it:
    - "as the handler goes back": as `_signal.signal` returns inside Lib/signal.py's wrapper,
      called by guard.Held.let_go(): the handler is back, the wrapper still runs Python code;
    - "after the guard returned": as let_go() returns into the call's frame, the call complete."""
    import _signal
    import os
    import sys

    from minisgl.frontend.guard import Held

    let_go = Held.let_go

    armed = [True]

    def fire() -> None:
        armed[0] = False
        os.kill(os.getpid(), signal.SIGINT)

    if moment == "as the handler goes back":
        def hook(frame, event, arg):
            if (armed[0] and event == "c_return" and arg is _signal.signal and frame.f_back is not None
                    and frame.f_back.f_code is let_go.__code__):
                fire()
        return hook, sys.setprofile, armed

    def trace(frame, event, arg):
        if armed[0] and event == "return" and frame.f_code is let_go.__code__:
            fire()
        return trace if event == "call" else None
    return trace, sys.settrace, armed


@pytest.mark.parametrize("moment", ["as the handler goes back", "after the guard returned"])
def test_ctrl_c_after_a_completed_call_undoes_it(qwen3, moment):
    """The last instants of a public call, after its guard has put the handler back. A
    KeyboardInterrupt there once left a request queued under an id the caller never got, and a
    step's outputs taken and dropped. The call must come out whole or undone: the id is handed
    out again, the outputs come with the next step."""
    def interrupted(fn) -> bool:
        hook, install, armed = sigint_at(moment)
        install(hook)
        try:
            fn()
        except KeyboardInterrupt:
            return True
        finally:
            install(None)
        assert not armed[0], "the SIGINT was never sent: the test does not reach its moment"
        return False

    with LLM(qwen3, loop="overlap", kv_tokens=256) as llm:
        assert interrupted(lambda: llm.add_request("hello there", PARAMS[0]))
        assert not llm.has_unfinished()  # not queued: the call was undone
        rid = llm.add_request("hello there", PARAMS[0])
        assert rid == 0  # the undone call's id is handed out again
        while llm.scheduler.has_work():
            llm._step()  # finish it without handing the output out
        assert interrupted(llm.step)  # step() took the finished output, then the Ctrl-C came
        assert [o.rid for o in llm.step()] == [rid]  # the output comes with the next call
        llm.flush_cache()
        assert_pool_whole(llm)


@pytest.mark.parametrize("handler", ["ignored (SIG_IGN)", "a handler of the user's that does not raise"])
def test_ctrl_c_taken_by_the_users_handler_lets_every_call_complete(qwen3, handler):
    """Ctrl-C is the user's to handle: with SIG_IGN, or a handler that takes it without raising,
    a call that a Ctrl-C lands in completes with its value, exactly once. It used to be undone
    and still return its value: add_request handed out id 0 twice with one request queued, and
    step() handed out the same output again and again."""
    import os
    import sys

    hits: list[int] = []
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if handler.startswith("ignored") else
                           lambda signum, frame: hits.append(signum))
    users = signal.getsignal(signal.SIGINT)
    target = [None]

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == target[0]:
            target[0] = None
            os.kill(os.getpid(), signal.SIGINT)

    try:
        with LLM(qwen3, loop="overlap", kv_tokens=256) as llm:
            sys.setprofile(hook)
            target[0] = "_queue"  # inside add_request, after the request is made
            rids = [llm.add_request("hello there", PARAMS[0]), llm.add_request("count 1 to", PARAMS[1])]
            outs = []
            while llm.has_unfinished():
                target[0] = "_take_results"  # inside step(), as it hands the outputs out
                outs += [o.rid for o in llm.step()]
            target[0] = "_step"  # inside generate(), between two steps
            generated = llm.generate(["hello there"], PARAMS[0])
            sys.setprofile(None)
            assert rids == [0, 1] and sorted(outs) == rids  # each id once, each output once
            assert len(generated) == 1 and len(generated[0].token_ids) == PARAMS[0].max_new_tokens
            assert signal.getsignal(signal.SIGINT) is users  # the user's handler is back after each call
            assert hits == ([] if handler.startswith("ignored") else [signal.SIGINT] * len(hits)) and (
                handler.startswith("ignored") or len(hits) >= 3)  # the handler got every Ctrl-C
            llm.flush_cache()
            assert_pool_whole(llm)
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGINT, before)


def test_a_thread_turned_away_gets_in_use_not_the_main_threads_ctrl_c(qwen3):
    """A Ctrl-C held back for the main thread's call is the main thread's: another thread refused
    with "in use" meanwhile gets that RuntimeError (it got KeyboardInterrupt, and the main
    thread's Ctrl-C was delivered twice)."""
    import os

    got: list[BaseException] = []

    def other() -> None:
        try:
            llm.memory_report()
        except BaseException as exc:  # noqa: BLE001 - what it raises is the point
            got.append(exc)

    def on_step(_done: int) -> None:
        if not got:
            os.kill(os.getpid(), signal.SIGINT)  # held back by generate()'s guard
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()

    with LLM(qwen3, kv_tokens=256) as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["hello there"], PARAMS[0], on_step=on_step)
        assert len(got) == 1 and isinstance(got[0], RuntimeError) and "in use" in str(got[0]), got
        while llm.has_unfinished():  # the interrupted generate()'s requests were aborted: drain them
            llm.step()
        llm.flush_cache()
        assert_pool_whole(llm)
