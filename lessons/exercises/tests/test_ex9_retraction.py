"""Exercise 9: the in-flight result of a request retracted since its batch launched is skipped at
the commit (readings §15, lesson 10). A workload that forces retractions (optimistic admission, a
small KV pool) must give the tokens of reserve admission in the normal loop. Each assertion names
its rule; the per-step ownership audit is off, so that a mistake is reported by the rule it breaks."""

import pytest

from minisgl import LLM, demo_model_path
from minisgl.demo.workloads import early_stop_workload
from minisgl.kv_pool import KVAccountingError

SKIP_RULE = ("a retracted request's in-flight result is no output: skip it at the commit (the request's (row, "
             "generation) is no longer the batch's), since its re-prefill samples that step again")


def run(loop: str, admission: str, *disabled: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(demo_model_path(), loop=loop, admission=admission, kv_tokens=200, disable=disabled)
    llm.scheduler.check_each_step = False
    prompts, params = early_stop_workload()
    try:
        return llm, [o.token_ids for o in llm.generate(prompts, params)]
    except (KVAccountingError, RuntimeError, KeyError) as exc:
        raise AssertionError(f"{SKIP_RULE} ({type(exc).__name__}: {exc})") from None


def test_the_batch_snapshot_freezes_the_rows_this_exercise_compares():
    """Exercise 3's part, not this one's: the skip compares the request's row with the one the batch
    view froze at launch, so it needs a real snapshot (the student edition's stub of exercise 3 reads
    the rows at the commit, and then nothing tells a retracted request's late result)."""
    from minisgl.batch import BatchView, RunningBatch

    live = RunningBatch()
    assert isinstance(live.snapshot(), BatchView), (
        "this check needs exercise 3 first: RunningBatch.snapshot() must return a BatchView frozen at launch, whose "
        "rows and generations the skip compares with the request's own")


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return run("normal", "reserve")[1]


def test_retracted_requests_resume_with_their_own_tokens(reference):
    llm, outs = run("overlap", "optimistic")
    assert llm.stats.retractions > 0, "the workload must retract (admission='optimistic', kv_tokens=200)"
    assert outs == reference, SKIP_RULE


def test_only_retracted_results_are_skipped_and_each_is_counted(reference):
    llm, _ = run("overlap", "optimistic")
    stats = llm.stats
    assert stats.retracted_late_results == stats.retractions, (
        "skip only the results of requests retracted since their batch launched, and count each one in "
        f"stats.retracted_late_results: {stats.retracted_late_results} counted for {stats.retractions} retractions "
        "(each retraction in the overlap loop leaves exactly one such result; a finished request's late result "
        "is overshoot, left to skip_finished)")
    assert stats.overshoot_tokens > 0, "a finished request's late result is overshoot: skip_finished counts it"


def test_switched_off_the_late_token_is_appended(reference):
    llm, outs = run("overlap", "optimistic", "retract_skip_inflight")
    assert llm.stats.retracted_late_results == 0 and outs != reference, (
        "keep the switch: with retract_skip_inflight off the late result must be committed like any other "
        "(and the re-prefill then samples the same step again: a repeated token)")


def test_a_skipped_result_leaves_the_request_as_the_retraction_left_it(reference):
    """The retraction already forgot the sample in flight (Req.reset_for_retract); the re-prefill
    counts its own. Touching the request while skipping its late result (its count of samples in
    flight, its KV length) puts it one sample off: the lookahead then misjudges its end."""
    llm = LLM(demo_model_path(), loop="overlap", admission="optimistic", kv_tokens=200)
    llm.scheduler.check_each_step = False
    negative = []
    commit_results = llm.scheduler._commit_results

    def spy(view, result):
        commit_results(view, result)
        negative.extend(r.rid for r in view.reqs if r.inflight_samples < 0)

    llm.scheduler._commit_results = spy
    prompts, params = early_stop_workload()
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.stats.retractions > 0, "the workload must retract (admission='optimistic', kv_tokens=200)"
    assert not negative and outs == reference, (
        "a skipped late result must leave the retracted request untouched: the retraction already set its samples in "
        f"flight to 0 and the re-prefill counts its own (requests {sorted(set(negative))} went below 0)")


def test_the_generation_tells_a_row_given_back_to_the_same_request(qwen3):
    """Retracted while its step is in flight, then admitted into the very row it had before: the row
    alone cannot tell the late result from a current one, the row's generation can. Staged here by
    moving the generation on while the request's decode step is in flight."""
    from minisgl import SamplingParams

    llm = LLM(qwen3, loop="overlap")
    llm.scheduler.check_each_step = False
    sched = llm.scheduler
    llm.add_request("hello there", SamplingParams(max_new_tokens=8, ignore_eos=True))
    while sched.last is None or sched.last.view.is_prefill:
        llm.step()
    req = sched.last.view.reqs[0]
    sched.req_to_token.generation[req.row] += 1  # the row was given back and taken again by the same request
    req.row_generation = sched.req_to_token.generation[req.row]
    llm.step()  # commits the step launched before that
    assert sched.stats.retracted_late_results == 1, (
        "compare the request's (row, generation) with the batch's, not the row alone: a retracted request may be "
        "admitted again into the very row it had, and only the generation says the late result is not its own "
        f"(retracted_late_results {sched.stats.retracted_late_results}, stale_row_results "
        f"{sched.stats.stale_row_results})")
