"""Exercise 4: the three overshoot rules (readings §8, lesson 6), each checked on its own and with
its switch off. Each assertion names its rule. The per-step ownership audit is off here, so
that a leak is reported by the rule it breaks rather than by the audit."""

import pytest

from minisgl import LLM, SamplingParams
from minisgl.invariants import InvariantError
from minisgl.kv_pool import KVAccountingError

PROMPTS = ["hello there", "the lazy dog", "count 1 to 9:", "abc def", "one more", "and the last"]
# Caps shared by requests that decode side by side: several reach theirs in the same step.
CAPPED = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 5, 5, 9, 9, 14)]


def outputs(model: str, prompts, params, *disabled: str, loop: str = "overlap") -> tuple[LLM, list[list[int]]]:
    llm = LLM(model, loop=loop, disable=disabled)
    llm.scheduler.check_each_step = False
    try:
        outs = llm.generate(prompts, params)
    except (RuntimeError, InvariantError) as exc:
        if "can no longer be scheduled" in str(exc):
            raise AssertionError(
                "length lookahead: leave out of the decode batch only the requests whose LAUNCHED samples already "
                "reach max_new_tokens (Req.will_finish_by_length); one left out before its last token was launched "
                f"never finishes ({exc})") from None
        if not isinstance(exc, (KVAccountingError, InvariantError)):
            raise
        raise AssertionError(
            "a late result of a request that already finished is not an output: skip it at the commit (and count "
            f"it), or the request is finished and released a second time ({type(exc).__name__}: {exc})") from None
    return llm, [o.token_ids for o in outs]


def leaked(llm: LLM) -> int:
    mem = llm.memory_report()
    return mem["kv_total"] - mem["kv_free"] - mem["kv_cached"]


def stop_case(model: str) -> tuple[list[int], SamplingParams]:
    """One request that stops on a stop token while its next step is already in flight."""
    (ref,) = outputs(model, ["abc"], SamplingParams(max_new_tokens=20, ignore_eos=True), loop="normal")[1]
    k = next(i for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    return ref[:k + 1], SamplingParams(max_new_tokens=20, stop_token_ids=(ref[k],))


def test_length_lookahead_leaves_out_requests_whose_last_token_is_in_flight(qwen3):
    _, expected = outputs(qwen3, PROMPTS, CAPPED, loop="normal")
    llm, got = outputs(qwen3, PROMPTS, CAPPED)
    assert got == expected
    assert llm.stats.overshoot_steps == 0, (
        "length lookahead: a request whose LAUNCHED samples already reach max_new_tokens (its last token is still "
        "in flight, so not committed yet) must be left out of the next decode batch; "
        f"{llm.stats.overshoot_steps} steps were planned past max_new_tokens (Req.will_finish_by_length)")
    off, _ = outputs(qwen3, PROMPTS, CAPPED, "length_lookahead")
    assert off.stats.overshoot_steps == len(PROMPTS), (
        "keep the switch: with length_lookahead off every capped request is planned one step too far "
        f"({len(PROMPTS)} overshoot steps expected, got {off.stats.overshoot_steps})")


def test_a_late_result_after_a_stop_is_dropped_and_counted(qwen3):
    expected, params = stop_case(qwen3)
    llm, (got,) = outputs(qwen3, ["abc"], params)
    assert got == expected, (
        "a late result of a request that already finished is not an output: skip it at the commit; "
        f"got {got}, expected {expected} (ends at the stop token)")
    assert llm.stats.overshoot_tokens == 1, (
        "count each dropped late result in stats.overshoot_tokens (one per position of the skipped row): "
        f"one step was in flight past the stop token, counted {llm.stats.overshoot_tokens}")


def test_release_frees_up_to_the_allocated_length(qwen3):
    _, params = stop_case(qwen3)
    llm, _ = outputs(qwen3, ["abc", "hello there"], [params, params])
    assert leaked(llm) == 0, (
        "release by allocated length: the overshoot step wrote the KV of the stop token into one more slot, "
        "which no committed batch wrote; free the tail from the KV-committed length up to req.allocated_len. "
        f"{leaked(llm)} KV slots leaked")
    off, _ = outputs(qwen3, ["abc", "hello there"], [params, params], "release_allocated")
    assert leaked(off) == off.stats.overshoot_tokens > 0, (
        "keep the switch: with release_allocated off the tail is freed only up to the KV-committed length, "
        f"so one slot per late result leaks (leaked {leaked(off)}, late results {off.stats.overshoot_tokens})")


def test_release_frees_what_a_verify_step_allocated_past_the_launched_length(qwen3):
    """Speculation (lesson 12) allocates KV for the most a verify step can accept: more than it launches."""
    llm = LLM(qwen3, loop="overlap", speculative_algorithm="ngram", speculative_num_steps=3)
    llm.scheduler.check_each_step = False
    llm.generate(PROMPTS, CAPPED)
    assert leaked(llm) == 0, (
        "release by allocated length: free the tail up to req.allocated_len, every slot the request was given, "
        "not only up to what it launched (a speculative verify step allocates KV for all it may accept). "
        f"{leaked(llm)} KV slots leaked")


def test_skip_finished_off_shows_its_symptom(qwen3):
    _, params = stop_case(qwen3)
    llm = LLM(qwen3, loop="overlap", disable=("skip_finished",))
    llm.scheduler.check_each_step = False
    raised = None
    try:
        llm.generate(["abc"], params)
    except (KVAccountingError, InvariantError) as exc:
        raised = exc
    assert isinstance(raised, KVAccountingError), (
        "keep the switch: with skip_finished off the late result must be committed like any other (a token "
        "after the stop token, then a second finish, which _release reports as a double free); "
        f"got {raised!r}")


def test_an_abort_while_the_last_token_is_in_flight_comes_out_once(qwen3):
    """Aborted once its last token is launched: the abort finishes it at the next commit, and the
    result still in flight is a late result like any other."""
    twelve = SamplingParams(max_new_tokens=12, ignore_eos=True)
    llm = LLM(qwen3, loop="overlap", device_delay_ms=5)
    llm.scheduler.check_each_step = False
    keep, gone = llm.add_request("hello there", twelve), llm.add_request("the lazy dog", twelve)
    req = llm.scheduler.waiting[-1]
    outs = {}
    try:
        while not req.will_finish_by_length():  # its last token launched, not committed
            outs.update({o.rid: o for o in llm.step()})
        llm.abort(gone)
        while llm.has_unfinished():
            outs.update({o.rid: o for o in llm.step()})
    except (KVAccountingError, InvariantError) as exc:
        raise AssertionError(
            "a request aborted while its last token is in flight is finished by the abort; the late result is then "
            f"not an output: skip it at the commit and count it ({type(exc).__name__}: {exc})") from None
    assert gone in outs and outs[gone].finish_reason == "abort", (
        "a request aborted while its last token is in flight must come out once, with finish_reason 'abort': "
        f"got {outs.get(gone)!r}")
    assert keep in outs and llm.stats.overshoot_tokens >= 1 and leaked(llm) == 0, (
        "the aborted request's late result must be skipped and counted in overshoot_tokens, and its slots freed "
        f"up to the allocated length (overshoot_tokens {llm.stats.overshoot_tokens}, leaked {leaked(llm)})")


@pytest.mark.parametrize("phase", ["a prefill chunk", "a decode step"])
def test_the_late_result_of_an_aborted_request_counts_all_its_positions(qwen3, phase):
    """Aborted while `phase` of it is in flight (release_allocated off: each dropped position's slot
    stays allocated, so the leak measures what was dropped)."""
    llm = LLM(qwen3, loop="overlap", chunk_size=4, device_delay_ms=5, disable=("release_allocated",))
    llm.scheduler.check_each_step = False  # the leak is the measurement
    gone = llm.add_request("the quick brown fox jumps over the lazy dog while the cat sleeps",
                           SamplingParams(max_new_tokens=12, ignore_eos=True))
    req = llm.scheduler.waiting[-1]
    while (req.launched_len == 0) if phase == "a prefill chunk" else (len(req.output_ids) < 2):
        llm.step()
    in_flight = req.launched_len - req.kv_committed_len  # positions of the batch still in flight
    llm.abort(gone)
    while llm.has_unfinished():
        llm.step()
    assert llm.stats.overshoot_tokens == in_flight == leaked(llm) > 0, (
        "count each dropped late result by its positions (qo_len), not once per result: the late result of "
        f"{phase} of an aborted request had {in_flight} positions in flight (and {leaked(llm)} slots stayed "
        f"allocated), counted {llm.stats.overshoot_tokens}")
