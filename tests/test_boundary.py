"""The API boundary (issue 26): tokenizer ids beyond the vocabulary, fork()ed children, a
switched-off skip_finished with an abort, Ctrl-C during flush_cache(), host settings after
close(), a KV pool too small for any prompt."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.kv_pool import KVAccountingError

from .conftest import GREEDY, assert_pool_whole, drain


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


def test_skip_finished_off_with_an_abort_is_a_latched_double_free(qwen3):
    os.environ["MINISGL_CHECK_INVARIANTS"] = "0"
    try:
        llm = LLM(qwen3, loop="overlap", disable=("skip_finished",), device_delay_ms=20)
    finally:
        os.environ["MINISGL_CHECK_INVARIANTS"] = "1"
    short = llm.add_request("count 1 to", SamplingParams(max_new_tokens=2, ignore_eos=True))
    long = llm.add_request("hello there", SamplingParams(max_new_tokens=40, ignore_eos=True))
    got = {}
    for _ in range(4):
        got.update({o.rid: o for o in llm.step()})
    llm.abort(long)
    with pytest.raises(KVAccountingError, match="double free"):
        for _ in range(10):
            got.update({o.rid: o for o in llm.step()})
    with pytest.raises(RuntimeError, match="failed earlier"):
        llm.step()  # latched
    got.update({o.rid: o for o in llm.collect()})  # what finished is still handed out
    assert short in got and long in got
    llm.close()


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


@pytest.mark.parametrize("kv_tokens", [1, 2])
def test_kv_pool_too_small_for_any_prompt_is_refused(qwen3, kv_tokens):
    with pytest.raises(ValueError, match="kv_tokens"):
        LLM(qwen3, kv_tokens=kv_tokens)
