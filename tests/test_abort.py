"""Abort works in every state of a request and frees everything exactly once.

The KV pool and the row pool raise on a double free, so finishing the run and finding the
pools whole proves "exactly once"."""

from __future__ import annotations

import os

import pytest

from minisgl import LLM, SamplingParams
from minisgl.kv_pool import KVAccountingError

from .conftest import assert_pool_whole, drain

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
LONG = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"


@pytest.fixture(scope="module")
def expected(qwen3):
    llm = LLM(qwen3, loop="normal")
    outs = llm.generate(["hello there", LONG], GREEDY)
    llm.close()
    return [o.token_ids for o in outs]


def start_two(llm: LLM):
    """A request to keep and one to abort; returns their ids and the scheduler's Req of the latter."""
    keep = llm.add_request("hello there", GREEDY)
    gone = llm.add_request(LONG, GREEDY)
    return keep, gone, llm.scheduler.waiting[-1]


def abort_and_drain(llm: LLM, keep: int, gone: int, expected) -> object:
    """Abort `gone`, run to the end; the other request is untouched and the pools are whole."""
    llm.abort(gone)
    outs = drain(llm)
    assert outs[gone].finish_reason == "abort"
    assert outs[gone].token_ids == expected[1][:len(outs[gone].token_ids)]  # what was committed was right
    assert outs[keep].token_ids == expected[0]
    assert_pool_whole(llm)
    return outs[gone]


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_abort_queued(qwen3, expected, loop):
    llm = LLM(qwen3, loop=loop, max_running_requests=1)
    keep, gone, _ = start_two(llm)
    llm.step()
    assert llm.scheduler.waiting  # still queued: the only row is taken
    assert abort_and_drain(llm, keep, gone, expected).token_ids == []


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_abort_while_prefilling_in_chunks(qwen3, expected, loop):
    llm = LLM(qwen3, loop=loop, chunk_size=4, device_delay_ms=5)
    keep, gone, req = start_two(llm)
    while req.launched_len == 0:
        llm.step()
    assert 0 < req.launched_len < req.prompt_len  # part of the prompt is in flight
    assert abort_and_drain(llm, keep, gone, expected).token_ids == []


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_abort_while_decoding(qwen3, expected, loop):
    llm = LLM(qwen3, loop=loop, device_delay_ms=5)
    keep, gone, _ = start_two(llm)
    for _ in range(5):
        llm.step()
    out = abort_and_drain(llm, keep, gone, expected)
    assert 0 < len(out.token_ids) < GREEDY.max_new_tokens


def test_abort_while_final_token_in_flight(qwen3, expected):
    llm = LLM(qwen3, loop="overlap", device_delay_ms=5)
    keep, gone, req = start_two(llm)
    while not req.will_finish_by_length():  # step until its last token is launched, not committed
        llm.step()
    assert req.inflight_samples >= 1 and not req.finished
    abort_and_drain(llm, keep, gone, expected)
    assert llm.stats.overshoot_tokens >= 1  # the in-flight result was dropped, not committed


def test_abort_unknown_request(qwen3):
    llm = LLM(qwen3)
    with pytest.raises(ValueError, match="unknown"):
        llm.abort(12345)


@pytest.mark.parametrize("stage", ["prefill chunk", "decode step"])
def test_abort_releases_at_the_commit_point_with_exact_accounting(qwen3, stage):
    # release_allocated off: every slot of a dropped in-flight result leaks, and each one is
    # counted in overshoot_tokens (a prefill chunk counts all of its positions, not 1).
    llm = LLM(qwen3, loop="overlap", chunk_size=4, device_delay_ms=5, disable=["release_allocated"])
    llm.scheduler.check_each_step = False  # the leak is the point
    keep, gone, req = start_two(llm)
    if stage == "prefill chunk":
        while req.launched_len == 0:
            llm.step()
    else:
        while len(req.output_ids) < 2:
            llm.step()
    sched = llm.scheduler
    assert sched.rows.in_flight(req.row)  # a batch of it is in flight
    released_after_its_batch = []
    release = sched._release
    sched._release = lambda r: (r is req and released_after_its_batch.append(
        not sched.rows.in_flight(r.row)), release(r))
    llm.abort(gone)
    llm.step()  # the abort takes effect at schedule(): out of the batches at once ...
    assert req not in sched.running.reqs and req not in sched.prefilling
    drain(llm)
    assert req.released and released_after_its_batch == [True]  # ... released after its batch committed
    mem = llm.memory_report()
    leaked = mem["kv_total"] - mem["kv_free"] - mem["kv_cached"]
    assert leaked == llm.stats.overshoot_tokens > 0


# Issue 26 (robust at the API boundary)
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
