"""Exercise 5: at the commit point a finished request is reported, released once, and hands
exactly its committed KV to the radix cache (readings §9 and §7, lesson 7). Each assertion names
its rule; the per-step ownership audit is off, so that the rule is named rather than the audit."""

import re

import pytest

from minisgl import LLM, SamplingParams, demo_model_path, demo_prompts
from minisgl.invariants import InvariantError
from minisgl.kv_pool import KVAccountingError

FIVE = SamplingParams(max_new_tokens=5, ignore_eos=True)
ONLY_OUR_COPIES = ("free your own copies of the positions the tree already had, and only those: the slots of the "
                   "prefix this request borrowed from the tree at admission are the tree's, and freeing them frees "
                   "them twice")


def engine(model: str, *disabled: str, loop: str = "overlap") -> LLM:
    llm = LLM(model, loop=loop, disable=disabled)
    llm.scheduler.check_each_step = False
    return llm


def generate(llm: LLM, prompts, params):
    try:
        return llm.generate(prompts, params)
    except RuntimeError as exc:  # KVAccountingError from the radix cache is a RuntimeError too
        if "no longer be scheduled" in str(exc):
            raise AssertionError("a request that commit_token() finished must be reported: append it to "
                                 f"the scheduler's finished list (the caller never got it: {exc})") from None
        if "double free of KV slots" in str(exc):
            raise AssertionError(f"{ONLY_OUR_COPIES} ({exc})") from None
        if "tokens but" not in str(exc):
            raise
        raise AssertionError("checkpoint only the positions whose KV committed batches wrote: the ids you inserted reach "
                             "past the KV slots that exist "
                             f"(radix cache: {exc})") from None


def free_after_flush(llm: LLM) -> int:
    try:
        llm.flush_cache()
    except KVAccountingError as exc:  # the tree evicts slots the request freed already
        if "double free of KV slots" in str(exc):
            raise AssertionError(f"{ONLY_OUR_COPIES} ({exc})") from None
        raise
    mem = llm.memory_report()
    return mem["kv_total"] - mem["kv_free"]


def test_a_finished_request_comes_out(qwen3):
    outs = generate(engine(qwen3), ["hello there", "the lazy dog"], FIVE)
    assert [len(o.token_ids) for o in outs] == [5, 5]


def test_only_kv_that_committed_batches_wrote_is_cached(qwen3):
    llm = engine(qwen3)
    (out,) = generate(llm, ["hello there"], FIVE)
    cached, expected = llm.memory_report()["kv_cached"], len(out.prompt_token_ids) + 4
    assert cached > 0, ("the checkpoint: hand the KV that committed batches wrote to the radix cache (insert), so "
                        "that a later request with the same prefix reuses it; nothing was cached")
    assert cached == expected, (
        "checkpoint only the positions whose KV committed batches wrote: "
        "the last output token was sampled but never fed back, so its KV does not exist; "
        f"cached {cached} positions, expected prompt + 4 = {expected}")


def test_a_second_request_reuses_the_checkpoint_and_reads_the_right_kv(qwen3):
    llm = engine(qwen3)
    (out,) = generate(llm, ["hello there"], FIVE)
    longer = out.prompt_token_ids + out.token_ids
    (again,) = generate(llm, [longer], FIVE)
    assert llm.stats.cached_tokens == len(out.prompt_token_ids) + 4, (
        f"the second request should reuse the first one's checkpointed prefix; reused {llm.stats.cached_tokens}")
    (cold,) = generate(engine(qwen3, loop="normal"), [longer], FIVE)
    assert again.token_ids == cold.token_ids, "what a cache hit reads must be the KV the first request wrote"


def test_the_prefix_locked_at_admission_is_unlocked(qwen3):
    llm = engine(qwen3)
    generate(llm, ["hello there"], FIVE)
    generate(llm, ["hello there, again"], FIVE)  # admitted with a cached prefix, which it locks
    stuck = free_after_flush(llm)
    assert stuck == 0, ("unlock the prefix node the request locked at admission: "
                        f"locked paths cannot be evicted, and {stuck} KV slots stay held after flush_cache()")


def test_our_copies_of_what_the_tree_already_had_are_freed(qwen3):
    llm = engine(qwen3)
    generate(llm, ["same prompt", "same prompt"], FIVE)  # both compute the prefix, one inserts it first
    stuck = free_after_flush(llm)
    assert stuck == 0, (
        "free your own copies of the positions the tree already had: the tree says how many leading positions it "
        f"held before your insert, and those slots of yours are duplicates. {stuck} KV slots leaked")


def test_a_request_released_before_its_finish_is_not_released_again(qwen3):
    llm = engine(qwen3, "commit_point_cache")  # off: released when its last step is planned
    try:
        generate(llm, ["hello there", "the lazy dog"], [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                         for n in (4, 9)])
    except (KVAccountingError, InvariantError) as exc:
        raise AssertionError("release a finished request only if it was not released already: "
                             "with commit_point_cache off it was released at planning; a second _release is a "
                             f"double free ({exc})") from None


@pytest.mark.parametrize("released_at_planning", [False, True], ids=["commit_point_cache", "no_commit_point_cache"])
def test_a_second_finish_is_reported_as_a_double_free(qwen3, released_at_planning):
    """Whether or not the request was released before: a stop token, so never at planning."""
    (ref,) = generate(engine(qwen3, loop="normal"), ["hello there"], SamplingParams(max_new_tokens=20,
                                                                                    ignore_eos=True))
    stop = ref.token_ids[5]
    # skip_finished off: the late result finishes the request a second time
    llm = engine(qwen3, "skip_finished", *(("commit_point_cache",) if released_at_planning else ()))
    raised = None
    try:
        llm.generate(["hello there"], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)))
    except KVAccountingError as exc:
        raised = exc
    # the ledger's own report (_release), not the front end's of a request that came out twice
    assert raised is not None and re.search(r"double free: request \d+ released twice", str(raised)), (
        "a second finish (finished_before: only possible with skip_finished off) must still call _release, "
        f"which reports the double free; got {raised!r}")


def test_overshoot_kv_is_not_checkpointed(qwen3):
    (ref,) = LLM(qwen3, loop="normal").generate(["abc"], SamplingParams(max_new_tokens=20, ignore_eos=True))
    k = next(i for i, t in enumerate(ref.token_ids) if i >= 2 and t not in ref.token_ids[:i])
    llm = engine(qwen3)
    (out,) = generate(llm, ["abc"], SamplingParams(max_new_tokens=20, stop_token_ids=(ref.token_ids[k],)))
    assert out.token_ids == ref.token_ids[:k + 1] and llm.stats.overshoot_tokens == 1
    assert llm.memory_report()["kv_cached"] == len(out.prompt_token_ids) + k, (
        "the overshoot step's KV was written by a batch whose result was dropped: it is not committed KV and "
        "must not be checkpointed")


def test_lesson_7_workload_overlap_equals_normal():
    """Requests end by length at different steps while others keep decoding (lesson 7, demo model)."""
    prompts = [p for p, _ in demo_prompts(16, seed=0)]
    params = [SamplingParams(max_new_tokens=2 + i % 5) for i in range(len(prompts))]
    outs = {loop: [o.token_ids for o in generate(LLM(demo_model_path(), loop=loop, kv_tokens=4096), prompts, params)]
            for loop in ("normal", "overlap")}
    assert outs["overlap"] == outs["normal"]


LONG = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"
TWELVE = SamplingParams(max_new_tokens=12, ignore_eos=True)
PHASES = {  # where the aborted request is when abort() is called
    "prefilling in chunks": lambda req: 0 < req.launched_len < req.prompt_len,
    "decoding": lambda req: len(req.output_ids) >= 2,
    "decoding, nothing committed after it": lambda req: len(req.output_ids) >= 2,
}


@pytest.mark.parametrize("phase", PHASES)
def test_an_abort_in_every_phase_is_released_once_and_leaves_the_pools_whole(qwen3, phase):
    expected_keep, expected_gone = (o.token_ids for o in LLM(qwen3, loop="normal").generate(["hello there", LONG],
                                                                                             TWELVE))
    llm = LLM(qwen3, loop="overlap", chunk_size=4, device_delay_ms=5)  # the ownership audit stays on
    keep = None if phase.endswith("after it") else llm.add_request("hello there", TWELVE)
    gone = llm.add_request(LONG, TWELVE)
    req = llm.scheduler.waiting[-1]
    outs = {}
    try:
        for _ in range(200):
            if PHASES[phase](req):
                break
            outs.update({o.rid: o for o in llm.step()})
        assert PHASES[phase](req), f"the workload never reached the phase '{phase}'"
        llm.abort(gone)
        while llm.has_unfinished():
            outs.update({o.rid: o for o in llm.step()})
    except (KVAccountingError, InvariantError) as exc:
        raise AssertionError(
            f"an aborted request (aborted while {phase}) must be released exactly once, at the commit point, and "
            f"hand to the cache only the KV that committed batches wrote ({type(exc).__name__}: {exc})") from None
    assert outs[gone].finish_reason == "abort" and outs[gone].token_ids == expected_gone[:len(outs[gone].token_ids)]
    if keep is not None:
        assert outs[keep].token_ids == expected_keep, "the abort changed another request's tokens"
    mem = llm.memory_report()
    assert mem["kv_free"] + mem["kv_cached"] == mem["kv_total"] and mem["rows_free"] == mem["rows_total"], (
        f"after an abort while {phase} every KV slot must be free or cached and every row free: {mem}")
    assert free_after_flush(llm) == 0, f"after an abort while {phase} the cache holds locked KV slots"
