"""Exercise 9: the in-flight result of a request retracted since its batch launched is skipped at
the commit (readings §15, lesson 10). Most tests stop the overlap loop right after a decode batch
launched, retract a request as the next schedule() would, and commit that batch. The batch's view
(the rows and generations it launched with) is stated here, not taken from RunningBatch.snapshot:
that is exercise 3, and this check needs no other exercise written. Each assertion names its rule;
the per-step ownership audit is off, so that a mistake is reported by the rule it breaks."""

from typing import NamedTuple

from minisgl import LLM, SamplingParams, demo_model_path
from minisgl.batch import BatchView, InFlight
from minisgl.demo.tasks import demo_prompts
from minisgl.demo.workloads import early_stop_workload
from minisgl.request import Req

PROMPTS = [prompt for prompt, _ in demo_prompts(2)]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
SKIP_RULE = ("a retracted request's in-flight result is no output: skip it at the commit (the request's (row, "
             "generation) is no longer the batch's), since its re-prefill samples that step again")


def engine(*disabled: str) -> LLM:
    llm = LLM(demo_model_path(), loop="overlap", disable=disabled)
    llm.scheduler.check_each_step = False
    return llm


def decode_batch_in_flight(llm: LLM) -> tuple[InFlight, list[Req]]:
    """Run PROMPTS until a decode batch of both has just launched, two tokens of each committed.
    Returns that batch, with the view it launched with, for the caller to commit (the loop no
    longer holds it), and its requests."""
    sched = llm.scheduler
    for prompt in PROMPTS:
        llm.add_request(prompt, PARAMS)
    reqs = list(sched.waiting)
    while min(len(r.output_ids) for r in reqs) < 2:
        llm.step()
    assert sched.running.reqs == reqs, "the staging expects both requests in one decode batch, in their order"
    launched = BatchView(sched.last.result.batch_id, False, reqs, [r.row for r in reqs],
                         [r.row_generation for r in reqs], [True] * len(reqs), [1] * len(reqs))
    batch, sched.last = InFlight(launched, sched.last.result), None
    return batch, reqs


class Retraction(NamedTuple):
    llm: LLM
    kept: Req
    retracted: Req
    kept_outputs: int  # the kept request's outputs before the commit
    left: tuple[int, int, list[int]]  # the retracted request's samples in flight, KV length and outputs before it


def retract_while_in_flight(*disabled: str) -> Retraction:
    """Retract the second request while the decode batch of both is in flight, as schedule() does
    when the next decode step finds no KV for it (lesson 10), then commit that batch."""
    llm = engine(*disabled)
    batch, (kept, retracted) = decode_batch_in_flight(llm)
    llm.scheduler._retract(retracted)
    left = (retracted.inflight_samples, retracted.kv_committed_len, list(retracted.output_ids))
    kept_outputs = len(kept.output_ids)
    llm.scheduler.commit(batch)
    return Retraction(llm, kept, retracted, kept_outputs, left)


def test_the_late_result_is_skipped_and_counted():
    llm, kept, retracted, kept_outputs, left = retract_while_in_flight()
    assert retracted.output_ids == left[2], SKIP_RULE
    assert len(kept.output_ids) == kept_outputs + 1, (
        "skip only the retracted request's row: the other requests of the batch commit their tokens")
    assert llm.stats.retracted_late_results == 1, (
        "count each one in stats.retracted_late_results: one request was retracted while its decode step was in "
        f"flight, counted {llm.stats.retracted_late_results}")


def test_a_skipped_result_leaves_the_request_as_the_retraction_left_it():
    """The retraction already forgot the sample in flight (Req.reset_for_retract); the re-prefill
    counts its own. Touching the request while skipping its late result (its count of samples in
    flight, its KV length) puts it one sample off: the lookahead then misjudges its end."""
    _, _, retracted, _, left = retract_while_in_flight()
    now = (retracted.inflight_samples, retracted.kv_committed_len, retracted.output_ids)
    assert now == left, (
        "a skipped late result must leave the retracted request untouched: the retraction already set its samples "
        f"in flight to 0 and the re-prefill counts its own ((samples in flight, KV length, outputs) {left} became "
        f"{now})")


def test_the_retracted_request_resumes_with_its_own_tokens():
    llm = retract_while_in_flight().llm
    done = []
    while llm.has_unfinished():
        done += llm.step()
    got = [o.token_ids for o in sorted(done, key=lambda o: o.rid)]
    expected = [o.token_ids for o in LLM(demo_model_path(), loop="normal").generate(PROMPTS, PARAMS)]
    assert got == expected, f"{SKIP_RULE}; then the re-prefill resumes the request with the tokens it would have given"


def test_switched_off_the_late_token_is_appended():
    llm, _, retracted, _, left = retract_while_in_flight("retract_skip_inflight")
    assert llm.stats.retracted_late_results == 0 and retracted.output_ids[:-1] == left[2], (
        "keep the switch: with retract_skip_inflight off the late result must be committed like any other "
        "(and the re-prefill then samples the same step again: a repeated token)")


def test_a_finished_requests_late_result_is_overshoot_not_a_retraction():
    llm = engine()
    prompts, params = early_stop_workload(2, max_new_tokens=8)  # the second stops at EOS, a step in flight
    llm.generate(prompts, params)
    stats = llm.stats
    assert stats.retracted_late_results == 0, (
        "skip only the results of requests retracted since their batch launched: nothing was retracted here, and "
        f"a finished request's late result is overshoot, left to skip_finished (counted {stats.retracted_late_results} "
        "retracted)")
    assert stats.overshoot_tokens > 0, "the workload must leave a finished request's step in flight"


def test_the_generation_tells_a_row_given_back_to_the_same_request():
    """Retracted while its step is in flight, then admitted into the very row it had before: the row
    alone cannot tell the late result from a current one, the row's generation can. Staged here by
    moving the generation on while the request's decode step is in flight."""
    llm = engine()
    sched = llm.scheduler
    batch, (_, req) = decode_batch_in_flight(llm)
    sched.req_to_token.generation[req.row] += 1  # the row was given back and taken again by the same request
    req.row_generation = sched.req_to_token.generation[req.row]
    sched.commit(batch)
    assert sched.stats.retracted_late_results == 1, (
        "compare the request's (row, generation) with the batch's, not the row alone: a retracted request may be "
        "admitted again into the very row it had, and only the generation says the late result is not its own "
        f"(retracted_late_results {sched.stats.retracted_late_results}, stale_row_results "
        f"{sched.stats.stale_row_results})")


def test_the_row_tells_a_request_admitted_into_another_row():
    """Retracted while its step is in flight, then admitted into another row whose generation
    happens to equal the one it launched with (generations count per row): the generation alone
    cannot tell the late result from a current one, the row can. Staged here by moving the request
    to a free row while its decode step is in flight."""
    llm = engine()
    sched = llm.scheduler
    batch, (_, req) = decode_batch_in_flight(llm)
    other = sched.req_to_token.free_rows()[0]
    sched.req_to_token.generation[other] = req.row_generation
    req.row = other
    sched.commit(batch)
    assert sched.stats.retracted_late_results == 1, (
        "compare the request's (row, generation) with the batch's, not the generation alone: generations count "
        "per row, so a retracted request admitted again into another row may have the generation it launched "
        f"with, and only the row says the late result is not its own (retracted_late_results "
        f"{sched.stats.retracted_late_results})")


def test_a_row_recycled_under_a_request_that_kept_it_is_no_retraction():
    """With deferred_row_free off a finished request's row goes to the next request while its
    overshoot step is in flight: the row table's generation moves, the request's own (row,
    generation) does not. Staged here by moving only the table's generation. That late result is
    the generation check's (stale_row_results), not a retraction: the test is the request's own
    pair against the batch's, never the table's generation."""
    llm = engine()
    sched = llm.scheduler
    batch, (_, req) = decode_batch_in_flight(llm)
    sched.req_to_token.generation[req.row] += 1  # the row went to another request; this one was not retracted
    sched.commit(batch)
    assert (sched.stats.retracted_late_results, sched.stats.stale_row_results) == (0, 1), (
        "compare the request's own (row, row_generation) with the batch's, not the row table's generation: the "
        "table's moves when the row goes to another request (deferred_row_free off), which retracts nothing; that "
        f"late result is left to the generation check (retracted_late_results {sched.stats.retracted_late_results}, "
        f"stale_row_results {sched.stats.stale_row_results})")
