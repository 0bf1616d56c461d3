"""Each overlap mechanism switched off shows its documented symptom (README's mechanism table).

Races are made deterministic with `device_delay_ms` (the device is slow, so the host always
wins the race) and with the KV pool's LIFO reuse (a freed slot or row is handed out next).
Every test also runs the same workload with the mechanism on, which must match `normal`.
"""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, MECHANISMS, SamplingParams
from minisgl.invariants import InvariantError
from minisgl.kv_pool import KVAccountingError
from minisgl.staging import StagingBuffer, TokenColumns
from minisgl.tracer import SpanName

from .conftest import assert_pool_whole
from .workloads import random_workload, run, with_stops

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
PROMPTS = ["hello there", "the lazy dog", "count 1 to 9:", "abc def"]


def reference(model: str, prompts, params) -> list[list[int]]:
    llm = LLM(model, loop="normal")
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    llm.close()
    return outs


def overlap(model: str, *disabled: str, audit: bool = True, **kwargs) -> LLM:
    """An overlap-loop engine. `audit=False` stops the per-step ownership audit, for a switch
    whose symptom is corrupted ownership: the test then looks at the symptom itself."""
    llm = LLM(model, loop="overlap", disable=disabled, **kwargs)
    llm.scheduler.check_each_step = audit
    return llm


@pytest.fixture(scope="module")
def stop_workload(qwen3):
    """A mixed workload in which several requests stop on a stop token (EOS-like) mid-batch."""
    llm = LLM(qwen3, loop="normal", chunk_size=16)
    base = random_workload(0, llm.engine.model.vocab_size)
    workload = with_stops(base, [t for t, _ in run(llm, base)], 0)
    expected = run(llm, workload)
    llm.close()
    return workload, expected


def test_mechanism_names_are_the_contract():
    assert set(MECHANISMS) >= {"future_map", "batch_snapshot", "skip_finished", "release_allocated",
                               "commit_point_cache", "deferred_row_free", "staging_double_buffer",
                               "length_lookahead", "prefill_sync", "cuda_graph", "pinned_copy",
                               "staging_war_wait", "row_generation_check"}


def test_future_map_off_brings_the_bubble_back(qwen3):
    expected = reference(qwen3, PROMPTS, GREEDY)
    on, off = overlap(qwen3), overlap(qwen3, "future_map")
    for llm in (on, off):
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    # Off: every batch is committed before the next one is launched, exactly like normal_loop.
    pos = {e: i for i, e in enumerate(off.stats.events)}
    assert all(pos[(SpanName.COMMIT, n - 1)] < pos[(SpanName.LAUNCH, n)] for n in range(1, off.stats.batches))
    assert off.stats.early_commits == off.stats.batches
    pos = {e: i for i, e in enumerate(on.stats.events)}
    assert all(pos[(SpanName.LAUNCH, n)] < pos[(SpanName.COMMIT, n - 1)] for n in range(1, on.stats.batches))


def test_batch_snapshot_off_results_land_on_wrong_requests(qwen3):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 20, 20, 20)]
    expected = reference(qwen3, PROMPTS, params)
    llm = overlap(qwen3, "batch_snapshot", audit=False)
    reqs = [llm.scheduler.waiting[-1] for p, sp in zip(PROMPTS, params) if llm.add_request(p, sp) >= 0]
    for _ in range(40):  # bounded: with misrouted results some requests never reach their length
        llm.step()
    committed = [r.output_ids for r in reqs]
    assert any(out != ref[:len(out)] for out, ref in zip(committed, expected))
    good = overlap(qwen3)
    assert [o.token_ids for o in good.generate(PROMPTS, params)] == expected
    # generate() does not hang on the misrouted requests: it says they are lost.
    with pytest.raises(RuntimeError, match="no longer be scheduled"):
        overlap(qwen3, "batch_snapshot", audit=False).generate(PROMPTS, params)


def test_skip_finished_off_leaks_token_after_stop_and_double_frees(qwen3):
    (ref,) = reference(qwen3, ["hello there"], GREEDY)
    stop = ref[5]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(stop,))
    llm = overlap(qwen3, "skip_finished")
    llm.add_request("hello there", params)
    req = llm.scheduler.waiting[-1]
    with pytest.raises(KVAccountingError, match="double free"):
        while llm.has_unfinished():
            llm.step()
    stop_at = req.output_ids.index(stop)
    assert len(req.output_ids) == stop_at + 2  # the overshoot token leaked in after the stop token
    good = overlap(qwen3)
    (out,) = good.generate(["hello there"], params)
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    assert good.stats.overshoot_tokens == 1


def test_release_allocated_off_leaks_kv_slots(qwen3, stop_workload):
    workload, expected = stop_workload
    llm = overlap(qwen3, "release_allocated", audit=False, chunk_size=16)
    assert run(llm, workload) == expected  # tokens are right ...
    mem = llm.memory_report()
    leaked = mem["kv_total"] - mem["kv_free"] - mem["kv_cached"]
    assert leaked == llm.stats.overshoot_tokens > 0  # ... but one slot per overshoot is lost
    with pytest.raises(InvariantError, match=f"{leaked} owned by nobody"):
        llm.check_invariants()  # and the ownership audit names them
    good = overlap(qwen3, chunk_size=16)
    assert run(good, workload) == expected
    assert_pool_whole(good)


def test_commit_point_cache_off_gives_wrong_tokens(qwen3):
    # Request 0 finishes by length while the others keep decoding in the same batch.
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 20, 20, 20)]
    expected = reference(qwen3, PROMPTS, params)
    bad = overlap(qwen3, "commit_point_cache", audit=False)
    assert [o.token_ids for o in bad.generate(PROMPTS, params)] != expected
    good = overlap(qwen3)
    assert [o.token_ids for o in good.generate(PROMPTS, params)] == expected


def deferred_row_scenario(model: str, *disabled: str, audit: bool = True):
    """One row only. E leaves a long prompt in the cache. A stops on a stop token (so its
    overshoot step is in flight when it is committed); D, waiting for A's row, reuses that
    row and a cached prefix longer than A. A's late write lands in D's row."""
    prefix = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"
    (a_ref,) = reference(model, ["abc"], GREEDY)
    a_params = SamplingParams(max_new_tokens=20, stop_token_ids=(a_ref[3],))
    (d_ref,) = reference(model, [prefix + " and then"], GREEDY)
    llm = overlap(model, *disabled, audit=audit, max_running_requests=1, device_delay_ms=30)
    llm.generate([prefix], SamplingParams(max_new_tokens=2))  # E: prefix now cached
    a_out, d_out = llm.generate(["abc", prefix + " and then"], [a_params, GREEDY])
    return llm, d_out.token_ids, d_ref, a_out


def test_deferred_row_free_off_row_reuse_clobbers_new_request(qwen3):
    llm, d_tokens, d_ref, _ = deferred_row_scenario(qwen3, "deferred_row_free", audit=False)
    assert llm.stats.stale_row_results == 1  # the generation check saw the late reader
    assert d_tokens != d_ref
    good, d_tokens, d_ref, a_out = deferred_row_scenario(qwen3)
    assert good.stats.stale_row_results == 0
    assert d_tokens == d_ref and a_out.finish_reason == "stop"
    assert_pool_whole(good)


def test_row_generation_check_off_late_token_lands_on_new_request(qwen3):
    llm, d_tokens, d_ref, _ = deferred_row_scenario(qwen3, "deferred_row_free", "row_generation_check",
                                                    audit=False)
    assert llm.stats.stale_row_results == 0  # nobody noticed the recycled row ...
    assert d_tokens != d_ref  # ... and the new owner of the row got the old request's late token


@pytest.mark.parametrize("delay_ms", [0.0, 5.0])
def test_staging_both_protections_off_gives_wrong_tokens(qwen3, delay_ms):
    expected = reference(qwen3, PROMPTS, GREEDY)
    # Without an emulated delay the overwrite is a race between the host thread and the stream
    # thread: one run showed the wrong tokens in about half the tries (2026-12-01, 2-core
    # machine), so that case gets up to 8 fresh engines; with 5 ms the window is wide and one
    # run suffices.
    for _attempt in range(8 if delay_ms == 0 else 1):
        bad = overlap(qwen3, "staging_double_buffer", "staging_war_wait", device_delay_ms=delay_ms, audit=False)
        outs = [o.token_ids for o in bad.generate(PROMPTS, GREEDY)]
        wrong, overwrites = sum(o != e for o, e in zip(outs, expected)), bad.scheduler.batch_builder.staging.unread_overwrites
        bad.close()
        if wrong >= 2:
            break
    assert wrong >= 2, f"only {wrong} sequences wrong with both staging protections off"
    assert overwrites > 0
    good = overlap(qwen3, device_delay_ms=delay_ms)
    assert [o.token_ids for o in good.generate(PROMPTS, GREEDY)] == expected


def test_staging_one_buffer_with_the_wait_is_correct_but_waits(qwen3):
    expected = reference(qwen3, PROMPTS, GREEDY)
    llm = overlap(qwen3, "staging_double_buffer", device_delay_ms=30)  # a wide window: no flake under load
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.scheduler.batch_builder.staging.unread_overwrites == 0
    assert llm.scheduler.batch_builder.staging.waits > 0  # the host stalled on the device's read: idle it adds


@pytest.mark.parametrize("delay_ms", [0.0, 5.0])
def test_staging_two_buffers_without_the_wait_hold_while_n_commits_before_n_plus_2(qwen3, delay_ms):
    # The claim: batch n is committed (so its metadata was read) before batch n+2 is planned
    # into n's buffer. Then no rewrite ever finds its buffer unread, and the tokens are right.
    expected = reference(qwen3, PROMPTS, GREEDY)
    llm = overlap(qwen3, "staging_war_wait", device_delay_ms=delay_ms)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.scheduler.batch_builder.staging.unread_overwrites == 0
    events = llm.stats.events
    pos = {e: i for i, e in enumerate(events)}
    assert all(pos[(SpanName.COMMIT, n)] < pos[(SpanName.LAUNCH, n + 2)] for n in range(llm.stats.batches - 2))


def test_staging_write_refuses_a_missing_or_short_column():
    # A column the scheduler forgot (or wrote short) would be read with the previous batch's
    # values: write() must refuse the batch instead.
    buf = StagingBuffer(max_tokens=8, max_running_requests=4, device=torch.device("cpu"))
    tokens = TokenColumns()
    tokens.add(row=0, input_ids=[5, 6], start=0, out_slots=[1, 2])
    requests = {"rows": [0], "kv_lens": [2], "top_k": [-1], "seeds": [0], "sample_steps": [0], "qo_indptr": [0, 2],
                "kv_indptr": [0, 2], "temperature": [0.0], "top_p": [1.0]}
    buf.write(tokens, **requests)
    inputs = buf.to_device(num_tokens=2, num_reqs=1)
    assert inputs.input_ids.tolist() == [5, 6] and inputs.kv_indptr.tolist() == [0, 2]
    assert inputs.top_p.dtype == torch.float32 and inputs.top_p.tolist() == [1.0]
    for name in requests:
        with pytest.raises(AssertionError, match=name):
            buf.write(tokens, **{k: v for k, v in requests.items() if k != name})
    with pytest.raises(AssertionError, match="kv_indptr"):
        buf.write(tokens, **{**requests, "kv_indptr": [0]})
    tokens.positions.pop()
    with pytest.raises(AssertionError, match="positions"):
        buf.write(tokens, **requests)


def test_length_lookahead_off_wastes_overshoot_steps(qwen3):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 5, 9, 20)]
    expected = reference(qwen3, PROMPTS, params)
    off, on = overlap(qwen3, "length_lookahead"), overlap(qwen3)
    for llm in (off, on):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
        assert_pool_whole(llm)
    assert off.stats.overshoot_steps == 4 and off.stats.overshoot_tokens == 4  # one wasted step each
    assert on.stats.overshoot_steps == 0 and on.stats.overshoot_tokens == 0


def test_prefill_sync_commits_consecutive_prefills(qwen3):
    prompts = [f"prompt number {i} is a little longer than the chunk" for i in range(4)]
    expected = reference(qwen3, prompts, GREEDY)
    on, off = overlap(qwen3, chunk_size=8), overlap(qwen3, "prefill_sync", chunk_size=8)
    for llm in (on, off):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert on.stats.prefill_batches > 4
    # On: a prefill batch is committed before the next prefill batch is launched.
    assert on.stats.early_commits == on.stats.prefill_batches - 1
    assert off.stats.early_commits == 0


def test_prefill_sync_leaves_a_prefill_after_a_decode_overlapped(qwen3):
    """prefill_sync applies only to two prefills in a row: a prefill launched right after a decode
    batch still runs ahead of that decode's commit."""
    llm = overlap(qwen3)
    kinds, launch = [], llm.scheduler.launch

    def recorded_launch(planned):
        kinds.append("P" if planned.forward.is_prefill else "D")
        return launch(planned)

    llm.scheduler.launch = recorded_launch
    llm.add_request("hello there", SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(4):
        llm.step()
    llm.add_request("the lazy dog", GREEDY)
    while llm.has_unfinished():
        llm.step()
    pos = {e: i for i, e in enumerate(llm.stats.events)}
    after_decode = [n for n in range(1, len(kinds)) if kinds[n - 1] == "D" and kinds[n] == "P"]
    assert after_decode and llm.stats.early_commits == 0
    assert all(pos[(SpanName.LAUNCH, n)] < pos[(SpanName.COMMIT, n - 1)] for n in after_decode)
