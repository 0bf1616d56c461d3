"""The prefill gate (admission.PrefillGate, issue 27): while requests decode, new ones are admitted
only when the prefill they form is worth a launch. Off by default on the CPU (min_prefill_tokens
0); forced on here, on the demo model, whose prompts are about 5-10 tokens long."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams, demo_model_path
from minisgl.features.prefill_gate import GATE_DRAIN_FRACTION, PrefillGate
from minisgl.settings import SETTING
from minisgl.demo.tasks import demo_prompts
from minisgl.demo.workloads import early_stop_workload
from minisgl.request import Req

from .conftest import assert_pool_whole
from .workloads import Arrival, run

ROWS = 32  # the gate can close only while more than 7/8 of the rows decode
TARGET = 48  # prompt tokens: about nine demo prompts


# ---------------------------------------------------------------------------- the rule alone


def req(prompt_len: int, max_new_tokens: int = 10) -> Req:
    return Req(0, [5] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens), frozenset(), 4096, 0)


def is_open(waiting: list[Req], target: int = 100, running: int = 90, prefilling: int = 0,
            free_rows: int = 8, kv_headroom: int = 10_000) -> bool:
    gate = PrefillGate(target, max_running_requests=100)
    return gate.is_open(waiting, running=running, prefilling=prefilling, free_rows=free_rows,
                        kv_headroom=lambda: kv_headroom)


def test_gate_opens_when_the_requests_that_fit_reach_the_target():
    queue = [req(30) for _ in range(10)]  # 300 tokens queued
    assert is_open(queue, free_rows=4)  # 4 x 30 >= 100
    assert not is_open(queue, free_rows=3)  # 90 tokens fit: wait for a fourth row
    assert not is_open(queue, kv_headroom=3 * 41)  # 3 promises of 30 + 10 + 1 slots fit, not 4
    assert is_open(queue, kv_headroom=4 * 41)


def test_gate_opens_for_a_small_queue_nothing_running_a_continuing_chunk_or_a_drained_batch():
    queue = [req(30) for _ in range(10)]
    assert is_open(queue[:3], free_rows=1)  # 90 tokens in all: more waiting would only add latency
    assert is_open(queue, free_rows=1, running=0)  # nothing decodes: never stall
    assert is_open(queue, free_rows=1, prefilling=1)  # a chunk continues: the batch launches anyway
    assert is_open(queue, free_rows=1, running=int(GATE_DRAIN_FRACTION * 100))  # decode would no longer be full
    assert not is_open(queue, free_rows=1, running=int(GATE_DRAIN_FRACTION * 100) + 1)
    assert not is_open(queue, running=98)  # 8 free rows in the table, but 2 left under max_running_requests


def test_a_gate_of_zero_is_not_plugged_in():
    """min_prefill_tokens=0 (the CPU's default): the seam stays empty and _admit alone decides."""
    for target in (0, 64):
        llm = LLM(demo_model_path(), min_prefill_tokens=target)
        gate = llm.scheduler.features.prefill_gate
        assert (gate is None) == (target == 0) and (gate is None or gate.target == target)
        llm.close()


def test_gate_takes_requests_in_queue_order():
    # The head does not fit the KV headroom: _admit would stop there, so the short ones behind it
    # do not count, however many tokens they hold.
    queue = [req(30, max_new_tokens=1000)] + [req(30) for _ in range(10)]
    assert not is_open(queue, kv_headroom=500)
    assert is_open(queue, kv_headroom=2000)


# ---------------------------------------------------------------------------- on an engine


def offline(loop: str, target: int) -> tuple[LLM, list[list[int]]]:
    """64 prompts at once, lengths staggered so that requests finish a few at a time."""
    llm = LLM(demo_model_path(), loop=loop, max_running_requests=ROWS, min_prefill_tokens=target)
    prompts = [prompt for prompt, _ in demo_prompts(64, seed=0)]
    params = [SamplingParams(max_new_tokens=8 + (i * 7) % 33, ignore_eos=True) for i in range(len(prompts))]
    return llm, [o.token_ids for o in llm.generate(prompts, params)]


def tokens_per_prefill(llm: LLM) -> float:
    return llm.stats.prefill_tokens / llm.stats.prefill_batches


@pytest.fixture(scope="module")
def gate_off() -> tuple[LLM, list[list[int]]]:
    llm, outs = offline("overlap", 0)
    llm.close()
    return llm, outs


@pytest.mark.parametrize("loop", ["overlap", pytest.param("normal", marks=pytest.mark.full)])
def test_gate_makes_fewer_larger_prefill_batches_with_the_same_tokens(gate_off, loop):
    off, reference = gate_off
    llm, outs = offline(loop, TARGET)
    # Against the overlap loop without the gate: so overlap == normal with the gate on, too.
    assert outs == reference, "the gate changes when requests are admitted, never their tokens"
    assert llm.stats.prefill_batches < off.stats.prefill_batches
    assert tokens_per_prefill(llm) > tokens_per_prefill(off)
    llm.check_invariants()
    assert_pool_whole(llm)
    llm.close()


def test_a_trickle_of_arrivals_is_admitted_at_once():
    """Online: 15 long requests keep the batch (16 rows) above the drain fraction while short ones
    arrive one at a time. Each arrival is a queue below the target, so the gate lets it in as soon as it
    fits: the schedule is the one without the gate, batch for batch."""
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, 512) for _ in range(rng.randint(4, 12))]

    long = [Arrival(0, prompt(), SamplingParams(max_new_tokens=60, ignore_eos=True)) for _ in range(15)]
    trickle = [Arrival(4 + 5 * i, prompt(), SamplingParams(max_new_tokens=6, ignore_eos=True)) for i in range(10)]
    results = {}
    for target in (0, TARGET):
        llm = LLM(demo_model_path(), max_running_requests=16, min_prefill_tokens=target)
        results[target] = run(llm, long + trickle), llm.stats.prefill_batches, llm.stats.decode_batches
        assert_pool_whole(llm)
        llm.close()
    assert results[TARGET] == results[0]


@pytest.mark.full
def test_gate_with_optimistic_admission_and_retraction():
    prompts, params = early_stop_workload(n=80)
    runs = {}
    for target in (0, 40):
        llm = LLM(demo_model_path(), admission="optimistic", kv_tokens=900, max_running_requests=16,
                  min_prefill_tokens=target)
        runs[target] = llm, [o.token_ids for o in llm.generate(prompts, params)]
        llm.check_invariants()
        assert_pool_whole(llm)
        llm.close()
    (off, reference), (on, outs) = runs[0], runs[40]
    assert on.stats.retractions > 0, "the workload must force retractions with the gate on"
    assert on.stats.prefill_batches < off.stats.prefill_batches, "the gate must have held admissions back"
    assert outs == reference


# ---------------------------------------------------------------------------- the setting


def test_min_prefill_tokens_default_and_checks(qwen3):
    gate, chunk = SETTING["min_prefill_tokens"], SETTING["chunk_size"]
    with LLM(qwen3, device="cpu", chunk_size=64) as llm:
        assert llm.config.min_prefill_tokens == gate.default_for(torch.device("cpu")) == 0
    # The CUDA default must be reachable: no prefill batch holds more than a chunk.
    assert 0 < gate.default_for(torch.device("cuda")) <= chunk.default_for(torch.device("cuda"))
    with pytest.raises(ValueError, match="min_prefill_tokens must be at most chunk_size"):
        LLM(qwen3, device="cpu", chunk_size=64, min_prefill_tokens=65)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        LLM(qwen3, device="cpu", min_prefill_tokens=-1)
