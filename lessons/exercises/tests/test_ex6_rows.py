"""Exercise 6: with one request row, the next request may take it only after the old owner's
overshoot step (still in flight when the old owner finished) has been committed (readings §9,
lesson 7). The row rule is checked first, so that the first failure names it."""

from contextlib import contextmanager

import pytest

from minisgl import LLM, SamplingParams
from minisgl.tracer import SpanName

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@contextmanager
def the_engine_stopping_names_the_row_rule():
    """A row freed twice, or never, stops the engine (a double free; a request waiting for a row
    nothing will free): the failure then names the rule, with the engine's own error after it."""
    try:
        yield
    except RuntimeError as exc:
        raise AssertionError(
            "every parked row must be freed exactly once, at the first commit after its last batch (and taken "
            f"off the parked rows then); the engine stopped with {type(exc).__name__}: {exc}") from None


def one_row_run(model: str, *disabled: str):
    """A stops on a stop token (its overshoot step is in flight when it finishes); B waits for the row.
    Returns the engine, A, B, and whether B's first batch was launched after A's last batch committed."""
    (ref,) = LLM(model, loop="normal").generate(["abc"], GREEDY)
    k = next(i for i, t in enumerate(ref.token_ids) if i >= 2 and t not in ref.token_ids[:i])
    llm = LLM(model, loop="overlap", max_running_requests=1, disable=disabled, device_delay_ms=5)
    llm.scheduler.check_each_step = False  # the rule below is what this exercise is about
    batches: dict[int, list[int]] = {}  # batch id -> request ids in it, recorded at launch
    launch = llm.scheduler.launch

    def spy(planned):
        batches[planned.forward.batch_id] = [r.rid for r in planned.view.reqs]
        return launch(planned)

    llm.scheduler.launch = spy
    a_params = SamplingParams(max_new_tokens=12, stop_token_ids=(ref.token_ids[k],))
    with the_engine_stopping_names_the_row_rule():
        a, b = llm.generate(["abc", "hello there"], [a_params, GREEDY])
    a_last = max(bid for bid, rids in batches.items() if a.rid in rids)  # A's overshoot step
    b_first = min(bid for bid, rids in batches.items() if b.rid in rids)
    order = {event: i for i, event in enumerate(llm.stats.events)}
    return llm, a, b, order[(SpanName.COMMIT, a_last)] < order[(SpanName.LAUNCH, b_first)]


def test_row_is_reused_only_after_the_overshoot_step_commits(qwen3):
    llm, a, b, waited = one_row_run(qwen3)
    assert waited, ("a request row may be reused only after every batch that uses it has passed copy_done: B was "
                    "launched in A's row while A's overshoot step was still in flight (it writes that row)")
    assert a.finish_reason == "stop" and llm.stats.overshoot_tokens == 1
    assert llm.stats.stale_row_results == 0
    (b_ref,) = LLM(qwen3, loop="normal").generate(["hello there"], GREEDY)
    assert b.token_ids == b_ref.token_ids
    mem = llm.memory_report()
    assert mem["rows_free"] == mem["rows_total"], (
        f"every parked row must be freed once its last batch has committed: {mem['rows_free']} of "
        f"{mem['rows_total']} rows free after the workload")


def test_switched_off_the_row_is_reused_at_once_and_the_generation_check_sees_it(qwen3):
    llm, _, _, waited = one_row_run(qwen3, "deferred_row_free")
    assert not waited and llm.stats.stale_row_results == 1, (
        "keep the switch: with deferred_row_free off the row must be freed at once (the generation check then "
        f"sees the late result: stale_row_results {llm.stats.stale_row_results})")


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_rows_all_come_back(qwen3, loop):
    llm = LLM(qwen3, loop=loop, max_running_requests=2)
    with the_engine_stopping_names_the_row_rule():
        llm.generate([f"request {i}" for i in range(5)], SamplingParams(max_new_tokens=4, ignore_eos=True))
    mem = llm.memory_report()
    assert mem["rows_free"] == mem["rows_total"], f"rows not all free after the workload: {mem}"


def test_rows_parked_together_all_come_back(qwen3):
    """Four requests stop on the same step, so four rows are parked at once and their last batch
    (the overshoot step) is the last commit of the run: every one must be freed at that commit."""
    (ref,) = LLM(qwen3, loop="normal").generate(["abc"], GREEDY)
    k = next(i for i, t in enumerate(ref.token_ids) if i >= 2 and t not in ref.token_ids[:i])
    llm = LLM(qwen3, loop="overlap", max_running_requests=4)
    with the_engine_stopping_names_the_row_rule():
        outs = llm.generate(["abc"] * 4, SamplingParams(max_new_tokens=12, stop_token_ids=(ref.token_ids[k],)))
    assert all(o.finish_reason == "stop" for o in outs) and llm.stats.overshoot_tokens == 4
    mem = llm.memory_report()
    assert mem["rows_free"] == mem["rows_total"], (
        "every parked row must be freed at the first commit after its last batch, also when several rows "
        f"become free at the same commit (removing from a list while looping over it skips one): {mem}")


def test_a_row_no_batch_in_flight_uses_is_free_at_once():
    """A row is released outside a commit too (an abort at planning, a retraction): if it is
    parked then, only a later commit frees it, and with one row no later batch can run. A row
    whose last batch has been committed must be free the moment it is released."""
    import torch

    from minisgl.kv_pool import ReqToTokenPool
    from minisgl.mechanisms import Mechanisms
    from minisgl.request import Req
    from minisgl.rows import RowTracker

    rows = RowTracker(ReqToTokenPool(1, 8, torch.device("cpu")), Mechanisms())
    req = Req.__new__(Req)
    rows.assign(req)
    rows.planned([req.row], 0)
    rows.committed(0)  # its last batch is done: nothing in flight uses the row
    rows.free(req.row)
    assert rows.req_to_token.free_count == 1 and not rows.deferred_rows, (
        "a row that no batch in flight uses must be freed at once: parked, it waits for a later commit that never "
        "comes when the next request needs that very row to run (a one-row pool)")



def test_each_row_is_freed_as_soon_as_its_own_last_batch_has_passed():
    """Rows c, d, a, b were last launched in batches 2, 2, 3, 4. While 3 and 4 are in flight, row c is
    free the moment it is released; a and b are parked; row d, released while they are parked, is free
    at once too; and the commit of batch 3 frees a, not b. Waiting for other rows' batches would make a
    new request wait for batches that have nothing to do with its row (the bubble, at every row reuse)."""
    import torch

    from minisgl.kv_pool import ReqToTokenPool
    from minisgl.mechanisms import Mechanisms
    from minisgl.request import Req
    from minisgl.rows import RowTracker

    rows = RowTracker(ReqToTokenPool(4, 8, torch.device("cpu")), Mechanisms())
    c, d, a, b = (Req.__new__(Req) for _ in range(4))
    for req, batch in ((c, 2), (d, 2), (a, 3), (b, 4)):
        rows.assign(req)
        rows.planned([req.row], batch)
    rows.committed(2)
    rows.free(c.row)
    assert rows.req_to_token.free_count == 1 and not rows.deferred_rows, (
        "a row whose own last batch has passed is free at once, also while OTHER batches are in flight "
        f"(in_flight(row)): batch 2 was row c's last and is committed, yet it was parked {rows.deferred_rows}")
    rows.free(a.row)
    rows.free(b.row)  # both still used by a batch in flight: parked
    rows.free(d.row)
    assert rows.req_to_token.free_count == 2 and sorted(rows.deferred_rows) == sorted([a.row, b.row]), (
        "a row whose own last batch has passed is free at once, also while other rows are parked: row d's last "
        f"batch (2) is committed, yet it was parked with them, to be freed one commit late ({rows.deferred_rows})")
    rows.committed(3)
    rows.free_deferred()
    assert rows.req_to_token.free_count == 3 and rows.deferred_rows == [b.row], (
        "free each parked row at the first commit after ITS OWN last batch (in_flight(row)), not once every parked "
        "row's batch has passed: the commit of batch 3 frees row a, row b waits for batch 4 "
        f"(free rows {rows.req_to_token.free_count}, still parked {rows.deferred_rows})")
