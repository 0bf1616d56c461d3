"""Scheduler (minisgl/scheduler.py; its planning in planning.py): admission promises only KV slots
the pool can give, the number of running requests stays within its bound, and a long prompt is
prefilled in chunks."""

from __future__ import annotations

from collections import deque

import pytest

from minisgl import LLM, SamplingParams

from .conftest import assert_pool_whole

PROMPTS = ["hello there", "count 1 to 9:", "the quick brown fox", "a b c d e f", "one more", "last of six"]
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(qwen3) -> list[list[int]]:
    with LLM(qwen3, loop="normal") as llm:  # ample pool and rows: every request admitted at once
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def step_until_done(llm: LLM, check) -> list[list[int]]:
    """Submit PROMPTS, call check(scheduler) after every step; the outputs in prompt order."""
    rids = [llm.add_request(p, PARAMS) for p in PROMPTS]
    outs = {}
    while llm.has_unfinished():
        outs.update({o.rid: o for o in llm.step()})
        check(llm.scheduler)
    return [outs[r].token_ids for r in rids]


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_admission_promises_only_what_the_pool_can_give(qwen3, expected, loop):
    """A tight pool: requests wait rather than run out of KV slots mid-decode, and the slots still
    promised to admitted requests are always covered by free or evictable ones."""
    llm = LLM(qwen3, loop=loop, kv_tokens=64)
    waited = []

    def check(sched):
        live = [r for r in (*sched.prefilling, *sched.running.reqs) if not r.released]
        promised = sum(r.reserved_tokens for r in live)
        assert promised <= sched.kv_pool.free_count + sched.cache.evictable_size, (promised, llm.memory_report())
        waited.append(bool(sched.waiting) and bool(live))

    assert step_until_done(llm, check) == expected
    assert any(waited)  # the pool was tight enough that some request had to wait
    assert_pool_whole(llm)
    llm.close()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_running_requests_stay_within_max_running_requests(qwen3, expected, loop):
    llm = LLM(qwen3, loop=loop, max_running_requests=2)
    most = []
    step_until_done(llm, lambda sched: most.append(len(sched.prefilling) + len(
        [r for r in sched.running.reqs if not r.finished])))
    assert max(most) == 2
    assert llm.memory_report()["rows_total"] == 2
    assert_pool_whole(llm)
    llm.close()


def test_a_long_prompt_is_prefilled_in_chunks_of_chunk_size(qwen3):
    llm = LLM(qwen3, chunk_size=8)
    llm.generate([list(range(3, 24))], SamplingParams(max_new_tokens=2, ignore_eos=True))  # 21 prompt tokens
    assert llm.stats.prefill_batches == 3  # 8 + 8 + 5
    llm.close()


class CountingDeque(deque):
    """The waiting queue, counting the times something walks through all of it."""

    walks = 0

    def __iter__(self):
        CountingDeque.walks += 1
        return super().__iter__()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_step_never_walks_the_waiting_queue(qwen3, loop):
    """Host work per step must not grow with the queue (issue 27): with 2 rows and 40 requests
    waiting, a step looks at the queue's head only; an abort() makes one step scan it once."""
    llm = LLM(qwen3, loop=loop, max_running_requests=2)
    llm.scheduler.waiting = CountingDeque()
    llm.scheduler.check_each_step = False  # the test suite's invariant check walks everything, by design
    CountingDeque.walks = 0
    rids = [llm.add_request([3 + i % 50, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(40)]
    for _ in range(10):
        llm.step()
    assert CountingDeque.walks == 0 and len(llm.scheduler.waiting) > 30
    llm.abort(rids[-1])
    aborted = [o for o in llm.step() if o.rid == rids[-1]]
    assert CountingDeque.walks == 1 and aborted[0].finish_reason == "abort"
    while llm.has_unfinished():
        llm.step()
    assert CountingDeque.walks == 1
    assert_pool_whole(llm)
    llm.close()
