"""Optimistic admission and retraction (lesson 10, readings §15): identical outputs to reserve and to
the normal loop on a workload that forces retractions, KV back to full, and the switch's symptom."""

import pytest

from minisgl import LLM, demo_model_path
from minisgl.demo.workloads import early_stop_workload

from .conftest import assert_pool_whole

KV_TOKENS = 200  # a request needs up to ~80 slots: reserve runs two at once, optimistic more


def run(loop: str, admission: str, *disabled: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(demo_model_path(), loop=loop, admission=admission, kv_tokens=KV_TOKENS, disable=disabled)
    prompts, params = early_stop_workload()
    return llm, [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm, outs = run("normal", "reserve")
    assert llm.stats.retractions == 0, "reserve admission promises every slot: it never retracts"
    return outs


@pytest.mark.parametrize("loop", ["overlap", pytest.param("normal", marks=pytest.mark.full)])
def test_optimistic_retracts_and_gives_the_reserve_outputs(reference, loop):
    llm, outs = run(loop, "optimistic")
    stats = llm.stats
    assert stats.retractions > 0, "the workload must force retractions"
    assert outs == reference, "a retracted request must resume with the tokens it would have produced"
    if loop == "overlap":  # every retraction there happens while the request's last step is in flight
        assert stats.retracted_late_results == stats.retractions
    llm.check_invariants()
    assert_pool_whole(llm)


@pytest.mark.full
def test_optimistic_runs_more_requests_at_once(reference):
    reserve, _ = run("overlap", "reserve")
    optimistic, _ = run("overlap", "optimistic")
    def concurrency(llm):
        return llm.stats.decode_rows / llm.stats.decode_batches
    assert reserve.stats.retractions == 0
    assert concurrency(optimistic) > concurrency(reserve) and optimistic.stats.decode_batches < reserve.stats.decode_batches


def test_retract_skip_inflight_off_appends_a_late_token(reference):
    llm, outs = run("overlap", "optimistic", "retract_skip_inflight")
    assert llm.stats.retractions > 0 and llm.stats.retracted_late_results == 0
    assert outs != reference, "the late token plus the re-prefill's sample of the same step: a repeated token"


def test_admission_is_checked(qwen3):
    with pytest.raises(ValueError, match="admission must be one of reserve, optimistic"):
        LLM(qwen3, admission="greedy")
