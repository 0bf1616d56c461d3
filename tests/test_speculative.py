"""Speculative decoding (lesson 12): greedy verify steps give exactly the plain tokens in both loops,
whatever the drafter proposes; the accepted runs are cut at stops and lengths; aborts mid-verify
leave the pools whole; each speculation switch shows its symptom; sampling keeps the target's
distribution."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minisgl import LLM, SamplingParams, demo_model_path
from minisgl.demo.tiny import make_tiny
from minisgl.demo.workloads import early_stop_workload
from minisgl.features.speculative import verify

from .conftest import assert_pool_whole, drain

K = 3
PROMPTS = [[3, 4, 5 + i] * (2 + i) for i in range(5)] + [[9, 10, 11, 12, 13, 14, 15]]
LENGTHS = (1, 2, 5, 9, 17, 30)  # with a perfect draft most of them end inside an accepted run
GREEDY = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in LENGTHS]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A draft that disagrees with the target almost always: random weights of another seed."""
    return str(make_tiny(tmp_path_factory.mktemp("draft") / "qwen3", "qwen3", seed=8, init_std=0.1))


def generate(model: str, prompts=PROMPTS, params=GREEDY, **engine) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model, device="cpu", **engine)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    return llm, outs


@pytest.fixture(scope="module")
def plain(qwen3) -> list[list[int]]:
    llm, outs = generate(qwen3, loop="normal")
    llm.close()
    return outs


def drafts(qwen3: str, other_draft: str) -> dict[str, dict]:
    """ngram, the target as its own draft (every draft accepted), and a draft that is always wrong."""
    return {"ngram": dict(speculative_algorithm="ngram"),
            "perfect": dict(speculative_algorithm="standalone", speculative_draft_model_path=qwen3),
            "wrong": dict(speculative_algorithm="standalone", speculative_draft_model_path=other_draft)}


CASES = [(d, loop) for d in ("ngram", "perfect", "wrong") for loop in ("overlap", "normal")]
FAST = {("ngram", "overlap"), ("perfect", "overlap"), ("wrong", "normal")}


@pytest.mark.parametrize("drafter,loop", [pytest.param(*c, marks=() if c in FAST else pytest.mark.full) for c in CASES])
def test_greedy_speculation_gives_the_plain_tokens(qwen3, other_draft, plain, drafter, loop):
    llm, outs = generate(qwen3, loop=loop, speculative_num_steps=K, device_delay_ms=1,
                         **drafts(qwen3, other_draft)[drafter])
    assert outs == plain
    stats = llm.stats
    # every output token but a request's first (its prefill samples it) comes from a verify step,
    # and a verify may accept tokens past a request's last (max_new_tokens inside its run)
    assert stats.spec_accepted_tokens >= sum(map(len, outs)) - len(outs)
    per_verify = stats.spec_accepted_tokens / stats.spec_verify_rows
    if drafter == "perfect":
        assert per_verify > 3, "the target as its own draft: nearly every step accepts all K drafts"
    if drafter == "wrong":
        assert per_verify < 1.2, "a random draft: nearly every step keeps only the target's own token"
    llm.check_invariants()
    assert_pool_whole(llm)
    llm.close()


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(qwen3, plain):
    stop = plain[-1][7]  # a token the longest output reaches mid-run
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=(stop,)) for n in LENGTHS]
    ref_llm, ref = generate(qwen3, params=params, loop="normal")
    llm, outs = generate(qwen3, params=params, speculative_algorithm="standalone",
                         speculative_draft_model_path=qwen3, speculative_num_steps=K)
    assert ref[-1][-1] == stop and outs == ref
    assert llm.stats.overshoot_tokens > 0, "accepted tokens after the stop are dropped, counted in tokens"
    assert_pool_whole(llm)
    llm.close(), ref_llm.close()


@pytest.mark.parametrize("loop", ["overlap", pytest.param("normal", marks=pytest.mark.full)])
def test_aborts_mid_verify_leave_the_pools_whole(qwen3, plain, loop):
    llm = LLM(qwen3, device="cpu", loop=loop, device_delay_ms=2, speculative_algorithm="standalone",
              speculative_draft_model_path=qwen3, speculative_num_steps=K)
    rids = [llm.add_request(p, s) for p, s in zip(PROMPTS, GREEDY)]
    outs = {}
    for _ in range(3):  # prefill, then verify steps in flight
        outs.update({o.rid: o for o in llm.step()})
    aborted = [rid for rid in rids[3:] if rid not in outs]  # the longer ones, still running
    assert aborted
    for rid in aborted:
        llm.abort(rid)
    outs.update(drain(llm))
    for i, rid in enumerate(rids):
        tokens = outs[rid].token_ids
        if rid in aborted:
            assert outs[rid].finish_reason == "abort" and tokens == plain[i][:len(tokens)]
        else:
            assert tokens == plain[i]
    llm.check_invariants()
    assert_pool_whole(llm)
    llm.close()


@pytest.mark.full
def test_speculation_with_retraction_gives_the_reserve_outputs():
    """Retraction under speculation: the same tokens as reserve admission (sampled ones too: the
    coins are seeded by output index), and the greedy ones are plain decoding's."""
    prompts, params = early_stop_workload()
    ref_llm = LLM(demo_model_path(), loop="normal")
    plain = [o.token_ids for o in ref_llm.generate(prompts, params)]
    ref_llm.close()
    outs = {}
    for admission in ("reserve", "optimistic"):
        llm = LLM(demo_model_path(), admission=admission, kv_tokens=120, speculative_algorithm="standalone")
        outs[admission] = [o.token_ids for o in llm.generate(prompts, params)]
        assert (llm.stats.retractions > 0) == (admission == "optimistic")
        assert_pool_whole(llm)
        llm.close()
    assert outs["optimistic"] == outs["reserve"]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert greedy and [outs["optimistic"][i] for i in greedy] == [plain[i] for i in greedy]


@pytest.mark.parametrize("algorithm", ["standalone", pytest.param("ngram", marks=pytest.mark.full)])
def test_demo_model_speculates_with_its_default_draft(algorithm):
    from minisgl.demo.tasks import demo_prompts

    prompts = [p for p, *_ in demo_prompts(8, seed=0)]
    params = SamplingParams(max_new_tokens=24)
    ref_llm, ref = generate(str(demo_model_path()), prompts, params, loop="normal")
    llm, outs = generate(str(demo_model_path()), prompts, params, speculative_algorithm=algorithm)
    assert outs == ref
    if algorithm == "standalone":  # a trained draft: most drafts are the target's own tokens
        assert llm.stats.spec_accepted_tokens / llm.stats.spec_verify_rows > 2
    llm.close(), ref_llm.close()


# ---------------------------------------------------------------------------------- the switches


def perfect(qwen3: str, loop: str, *disabled: str) -> tuple[LLM, list[list[int]]]:
    return generate(qwen3, loop=loop, device_delay_ms=3, disable=disabled, speculative_algorithm="standalone",
                    speculative_draft_model_path=qwen3, speculative_num_steps=K)


def test_publish_wait_off_reads_stale_lengths_in_the_overlap_loop(qwen3, plain):
    llm, outs = perfect(qwen3, "overlap", "spec_publish_wait")
    assert outs != plain, "the host read last step's lengths: attention over the wrong positions"
    llm.close()
    llm, outs = perfect(qwen3, "normal", "spec_publish_wait")
    assert outs == plain, "serially the batch is committed before the next plan: the mirror is fresh"
    llm.close()


def test_alloc_reserve_off_writes_past_the_slots_in_the_overlap_loop(qwen3, plain):
    llm, outs = perfect(qwen3, "overlap", "spec_alloc_reserve")
    assert llm.scheduler.features.speculation.unallocated_writes > 0 and outs != plain
    llm.close()
    llm, outs = perfect(qwen3, "normal", "spec_alloc_reserve")
    assert llm.scheduler.features.speculation.unallocated_writes == 0 and outs == plain
    llm.close()


def test_release_allocated_off_leaks_the_rejected_slots(qwen3, other_draft, plain):
    llm = LLM(qwen3, device="cpu", disable=["release_allocated"], speculative_algorithm="standalone",
              speculative_draft_model_path=other_draft, speculative_num_steps=K)
    llm.scheduler.check_each_step = False  # the leak is the symptom
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert outs == plain
    llm.flush_cache()
    mem = llm.memory_report()
    # each request keeps the slots past its committed KV: rejected drafts and the reserve, K+1 and more
    assert mem["kv_total"] - mem["kv_free"] >= len(PROMPTS) * (K + 1), mem
    llm.close()


# ---------------------------------------------------------------------------------- refusals


def test_what_speculation_refuses(qwen3):
    from minisgl.features.grammar import Grammar

    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        LLM(qwen3, device="cpu", speculative_algorithm="standalone")
    with pytest.raises(ValueError, match="does not combine with speculative_algorithm"):
        LLM(qwen3, device="cpu", speculative_algorithm="ngram", enable_mixed_chunk=True)
    with LLM(qwen3, device="cpu", speculative_algorithm="ngram") as llm:
        for params in (SamplingParams(logprobs=2), SamplingParams(grammar=Grammar({0: {7: 1}, 1: {}}))):
            with pytest.raises(ValueError, match="takes no grammar and no logprobs"):
                llm.add_request([3, 4, 5], params)
        assert llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3))[0].finish_reason == "length"


# ---------------------------------------------------------------------------------- sampling


def sampled_pairs(model: str, n: int, temperature: float = 1.3, **engine) -> list[tuple[int, ...]]:
    """The first three tokens of `n` seeded samples of one prompt."""
    llm = LLM(model, device="cpu", max_running_requests=64, **engine)
    params = [SamplingParams(max_new_tokens=3, temperature=temperature, seed=seed, ignore_eos=True)
              for seed in range(n)]
    outs = [tuple(o.token_ids) for o in llm.generate([[3, 4, 5, 6]] * n, params)]
    llm.close()
    return outs


def total_variation(a: list, b: list) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.count(k) / len(a) - b.count(k) / len(b)) for k in keys)


def permutation_threshold(a: list, b: list, quantile: float, rounds: int = 200) -> float:
    """The TV distance two samples of these sizes exceed with probability 1 - quantile when they
    come from one distribution: the pooled samples split at random, `rounds` times."""
    rng, pooled = random.Random(0), a + b
    distances = []
    for _ in range(rounds):
        rng.shuffle(pooled)
        distances.append(total_variation(pooled[:len(a)], pooled[len(a):]))
    return sorted(distances)[int(quantile * (rounds - 1))]


def marginals(samples: list[tuple[int, ...]], index: int) -> list[int]:
    return [s[index] for s in samples]


@pytest.mark.full
def test_rejection_sampling_keeps_the_targets_distribution(qwen3, other_draft):
    n = 400
    plain_samples = sampled_pairs(qwen3, n)
    spec = sampled_pairs(qwen3, n, speculative_algorithm="standalone", speculative_draft_model_path=qwen3,
                         speculative_num_steps=K)
    wrong = sampled_pairs(qwen3, n, speculative_algorithm="standalone", speculative_draft_model_path=other_draft,
                          speculative_num_steps=K)
    for index in (1, 2):  # tokens from verify steps (index 0 is the prefill's sample)
        a, b, c = marginals(plain_samples, index), marginals(spec, index), marginals(wrong, index)
        assert total_variation(a, b) <= permutation_threshold(a, b, 0.99)
        assert total_variation(a, c) <= permutation_threshold(a, c, 0.99)
    # The test can fail: a verify that took the target's argmax where it should sample gives plain greedy tokens.
    greedy = sampled_pairs(qwen3, n, temperature=0.0)
    a, d = marginals(plain_samples, 1), marginals(greedy, 1)
    assert total_variation(a, d) > permutation_threshold(a, d, 0.999)


def test_the_drafts_cache_and_weights_count_in_the_memory_check(qwen3):
    """The standalone draft's cache has a row for every slot of the target's pool: the automatic pool
    size and the memory check count both models (on a GPU the draft's cache did not fit otherwise)."""
    from minisgl.config import check_memory

    with LLM(qwen3, device="cpu", kv_tokens=2048, speculative_algorithm="standalone",
             speculative_draft_model_path=qwen3) as llm:
        config = llm.config
        assert config.draft_kv_bytes_per_token == config.kv_bytes_per_token  # the target as its own draft
        assert config.draft_weight_bytes == config.weight_bytes
        drafts_share = config.draft_weight_bytes + (config.kv_tokens + 1) * config.draft_kv_bytes_per_token
        alone = config.weight_bytes + (config.kv_tokens + 1) * config.kv_bytes_per_token
        table_and_staging = 2 * 8 * 8 * max(config.chunk_size, config.max_running_requests) + \
            config.max_running_requests * config.table_width * 8
        check_memory(config, free=alone + drafts_share + table_and_staging)  # fits exactly
        with pytest.raises(ValueError, match="kv_tokens=2048"):
            check_memory(config, free=alone + table_and_staging + drafts_share // 2)
    with LLM(qwen3, device="cpu", kv_tokens=2048) as llm:
        assert llm.config.draft_kv_bytes_per_token == llm.config.draft_weight_bytes == 0


class HostReads(TorchDispatchMode):
    """Records the ops that on CUDA make the host wait for the device: a value read back (`.item()`,
    `bool()`), a nonzero() (a boolean-mask index runs one to size its result)."""

    READS = {torch.ops.aten.nonzero, torch.ops.aten._local_scalar_dense, torch.ops.aten.masked_select}

    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put_, torch.ops.aten.index_put) \
            and any(i is not None and i.dtype == torch.bool for i in args[1])
        if func.overloadpacket in self.READS or masked:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("drafter", ["ngram", "perfect"])
def test_a_speculative_step_reads_nothing_back_from_the_device(qwen3, other_draft, drafter, monkeypatch):
    """A prefill or verify step only queues device work: on CUDA a host read inside it (above), or a
    tensor built on the device from a host list (a copy from pageable memory, which waits for the
    stream), would stall the host in the middle of launching the K + 1 draft forwards."""
    found: list[str] = []
    real_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None and "speculative" in sys._getframe(1).f_code.co_filename:
            found.append("torch.tensor(host list, device=...)")  # engine._to_device goes through pinned memory
        return real_tensor(*args, **kwargs)

    for step in (verify.PrefillStep, verify.VerifyStep):
        def watched(self, *args, _run=step._forward_and_sample):
            with HostReads(found):  # entered on the stream's worker thread: the mode is thread-local
                _run(self, *args)
        monkeypatch.setattr(step, "_forward_and_sample", watched)
    monkeypatch.setattr(torch, "tensor", tensor)
    llm, outs = generate(qwen3, speculative_num_steps=K, **drafts(qwen3, other_draft)[drafter])
    llm.close()
    assert llm.stats.spec_verify_rows > 0 and found == []


def test_a_publish_event_keeps_its_first_record():
    """A step records its publish event at the publish and again at its end (its `finally`); on CUDA a
    second record would move the event to the end, and the next plan would wait for the whole step."""
    from unittest.mock import Mock

    from minisgl.features.speculative.relay import PublishEvent

    event = PublishEvent(torch.device("cpu"))
    event.cuda = Mock()  # what the CUDA event is asked to do
    event.record()
    event.record()
    assert event.cuda.record.call_count == 1 and event.done.is_set()
