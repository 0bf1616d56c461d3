"""Chunked prefill, radix-cache reuse, token-id prompts, sampling, KV accounting."""

from __future__ import annotations

import warnings

import pytest

from minisgl import LLM, SamplingParams, demo_model_path

from .conftest import assert_pool_whole, tiered

LONG = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat " * 2
PROMPTS = [LONG, "hello there", LONG + " and then", "count 1 to 5:"]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def unchunked(qwen3):
    llm = LLM(qwen3, chunk_size=4096)
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.close()
    return outs


# The fast tier: two chunk sizes, one per loop; the full tier every pair.
@pytest.mark.parametrize("loop, chunk_size", tiered([(loop, c) for loop in ("normal", "overlap") for c in (3, 7, 16)],
                                                    [("normal", 7), ("overlap", 3)]))
def test_chunked_prefill_matches_unchunked(qwen3, unchunked, chunk_size, loop):
    llm = LLM(qwen3, chunk_size=chunk_size, loop=loop)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == unchunked
    assert llm.stats.prefill_batches > len(PROMPTS)  # the prompts really were split
    assert_pool_whole(llm)
    llm.close()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_radix_cache_hits_give_same_tokens(qwen3, unchunked, loop):
    llm = LLM(qwen3, loop=loop)
    first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.stats.cached_tokens == 0
    cached = llm.memory_report()["kv_cached"]
    assert cached > 0
    # The same prompts again: now served from the cache (longest prefix matched).
    free_before = llm.memory_report()["kv_free"]
    second = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert first == second == unchunked
    assert llm.stats.cached_tokens > 0  # the second round really hit the cache
    assert llm.memory_report()["kv_free"] >= free_before - 4 * GREEDY.max_new_tokens  # prompts reused, not re-stored
    assert_pool_whole(llm)
    llm.close()


def test_prompt_sharing_prefix_reads_cached_kv(qwen3):
    """A request whose prefix is cached computes only its suffix and still matches a cold run."""
    cold = LLM(qwen3)
    (ref,) = cold.generate([LONG + " and then"], GREEDY)
    cold.close()
    warm = LLM(qwen3)
    warm.generate([LONG], GREEDY)
    (out,) = warm.generate([LONG + " and then"], GREEDY)
    assert warm.stats.cached_tokens > 10
    assert out.token_ids == ref.token_ids
    assert_pool_whole(warm)
    warm.close()


def test_token_id_prompts(qwen3):
    llm = LLM(qwen3)
    ids = llm.tokenizer.encode("hello there")
    a, b = llm.generate([ids, "hello there"], GREEDY)
    assert a.token_ids == b.token_ids
    llm.close()


def test_seeded_sampling_is_batch_invariant(qwen3):
    llm = LLM(qwen3)
    p = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    (alone,) = llm.generate(["hello there"], p)
    crowd = llm.generate(["a b c", "hello there", LONG], [GREEDY, p, SamplingParams(max_new_tokens=5, seed=1, temperature=1.0)])
    assert crowd[1].token_ids == alone.token_ids
    other_seed = llm.generate(["hello there"], SamplingParams(max_new_tokens=16, temperature=0.9, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone.token_ids
    llm.close()


def test_top_k_one_is_greedy(qwen3):
    llm = LLM(qwen3)
    (g,) = llm.generate(["hello there"], GREEDY)
    (s,) = llm.generate(["hello there"], SamplingParams(max_new_tokens=24, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    assert g.token_ids == s.token_ids
    llm.close()


def test_tight_kv_pool_waits_instead_of_deadlocking(qwen3):
    """Room for about two requests at a time: the rest wait for slots and all finish correctly."""
    ref_llm = LLM(qwen3)
    prompts = [f"request number {i} says hello" for i in range(6)]
    ref = [o.token_ids for o in ref_llm.generate(prompts, GREEDY)]
    ref_llm.close()
    llm = LLM(qwen3, kv_tokens=80)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert_pool_whole(llm)
    llm.close()


def test_cuda_graph_replay_plans_with_its_batch_parity():
    """A CPU check of the GPU-only replay path: FlashInfer plans keep their pinned inputs in one
    set per batch parity (gpu/flashinfer_backend.py), so a replay must plan with its own batch's
    parity. Planned always with parity 0, batch n+1 rewrote batch n's indptr before its queued
    copy ran. The graphs and the backend are stand-ins that record what they were given."""
    import torch

    from minisgl.gpu.cuda_graph import CudaGraphRunner
    from minisgl.models.attention import AttentionMetadata

    class Graph:
        def replay(self) -> None:
            pass

    planned: list[tuple[int, str, list[int]]] = []

    class Backend:
        def plan(self, meta, parity: int = 0, decode_wrapper=None) -> None:
            planned.append((parity, decode_wrapper, meta.kv_lens))

    runner = object.__new__(CudaGraphRunner)
    runner.batch_sizes, runner.backend = [4, 8], Backend()
    runner.input_ids, runner.positions, runner.out_slots = (torch.zeros(8, dtype=torch.int64) for _ in range(3))
    runner.qo_indptr, runner.kv_indptr_buf = torch.arange(9, dtype=torch.int32), torch.zeros(9, dtype=torch.int32)
    runner.wrappers = [{bs: f"wrapper {p}/{bs}" for bs in (4, 8)} for p in range(2)]
    runner.graphs = [{bs: Graph() for bs in (4, 8)} for _ in range(2)]
    runner.logits = [{bs: torch.zeros(bs, 5) for bs in (4, 8)} for _ in range(2)]
    meta = AttentionMetadata(positions=torch.tensor([4, 6, 2]), out_slots=torch.tensor([5, 12, 15]),
                             qo_indptr=torch.arange(4, dtype=torch.int32),
                             kv_indptr=torch.tensor([0, 5, 12, 15], dtype=torch.int32),
                             kv_indices=torch.arange(1, 16), qo_lens=[1, 1, 1], kv_lens=[5, 7, 3])
    for batch_id in range(3):
        assert runner.run(torch.tensor([7, 8, 9]), meta, batch_id % 2).shape == (3, 5)
    assert planned == [(0, "wrapper 0/4", [5, 7, 3, 1]), (1, "wrapper 1/4", [5, 7, 3, 1]),
                       (0, "wrapper 0/4", [5, 7, 3, 1])]


def test_cuda_graph_sizes_pad_a_batch_by_at_most_seven_rows():
    """Every decode batch up to the largest runs at a captured size at most 7 rows above it (a
    padded row costs an 8B shape's FLOP-bound GEMMs what a real one does), and the largest
    batch has a graph of its own size."""
    from minisgl.gpu.cuda_graph import CudaGraphRunner, graph_batch_sizes

    for max_batch in (1, 3, 8, 100, 256, 512):
        sizes = graph_batch_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
        runner = object.__new__(CudaGraphRunner)
        runner.batch_sizes = sizes
        pads = [runner.padded_size(b) - b for b in range(1, max_batch + 1)]
        assert min(pads) == 0 and max(pads) <= 7, (max_batch, max(pads))


def test_flashinfer_plan_inputs_alternate_by_parity():
    """A CPU check of the GPU-only planning: batch n's indptr and KV lengths stay untouched while
    batch n+1 (the other parity) is planned, since FlashInfer's queued upload of them may not have
    run yet; decode and prefill plans both get the lengths (`seq_lens`) from those buffers."""
    import weakref

    import torch

    from minisgl.gpu.flashinfer_backend import FlashInferBackend
    from minisgl.models.attention import AttentionMetadata

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (kv_indptr, seq_lens): what FlashInfer reads later

    class Decode:
        def plan(self, kv_indptr, *args, seq_lens, **kwargs) -> None:
            seen.append((kv_indptr, seq_lens))

    class Prefill:
        def plan(self, qo_indptr, kv_indptr, *args, seq_lens, **kwargs) -> None:
            seen.append((kv_indptr, seq_lens))

    backend = object.__new__(FlashInferBackend)
    backend.shape, backend.dtype = (4, 2, 8), torch.bfloat16
    backend.deterministic, backend.prefill_reference, backend.grouped = False, None, True
    backend.tensor_core_min_batch, backend.fast_decode_plan, backend._planned = 3, False, weakref.WeakSet()
    backend.decode, backend.prefill = {False: [Decode(), Decode()]}, [Prefill(), Prefill()]
    backend._kv_indptr = [torch.zeros(5, dtype=torch.int32) for _ in range(2)]
    backend._qo_indptr = [torch.zeros(5, dtype=torch.int32) for _ in range(2)]
    backend._kv_lens = [torch.zeros(4, dtype=torch.int32) for _ in range(2)]
    backend._last_page_len = torch.ones(4, dtype=torch.int32)

    def batch(kv_lens: list[int], prefill: bool = False) -> AttentionMetadata:
        qo_lens = [2] * len(kv_lens) if prefill else [1] * len(kv_lens)
        return AttentionMetadata(positions=torch.zeros(sum(qo_lens)), out_slots=torch.zeros(sum(qo_lens)),
                                 qo_indptr=torch.zeros(len(kv_lens) + 1), kv_indptr=torch.zeros(len(kv_lens) + 1),
                                 kv_indices=torch.arange(sum(kv_lens)), qo_lens=qo_lens, kv_lens=kv_lens,
                                 prefill=prefill)

    def planned() -> list[tuple[list[int], list[int]]]:
        return [(indptr.tolist(), lens.tolist()) for indptr, lens in seen]

    backend.plan(batch([3, 5]), parity=0)
    backend.plan(batch([9, 1, 2], prefill=True), parity=1)
    assert planned() == [([0, 3, 8], [3, 5]), ([0, 9, 10, 12], [9, 1, 2])], "planning n+1 rewrote batch n's inputs"
    backend.plan(batch([4]), parity=0)  # batch n+2: n was committed, its buffers may be reused
    assert planned()[1:] == [([0, 9, 10, 12], [9, 1, 2]), ([0, 4], [4])]


def test_decode_kernel_follows_the_measured_rule():
    """The tensor-core decode kernel runs from tensor_core_decode_min_batch up, for grouped heads;
    always in the deterministic mode; never while the threshold is None (plan picks the wrapper)."""
    import weakref

    import torch

    from minisgl.gpu.flashinfer_backend import FlashInferBackend, decode_on_tensor_cores
    from minisgl.models.attention import AttentionMetadata

    assert not any(decode_on_tensor_cores(b, grouped=True, deterministic=False, min_batch=None) for b in (1, 256))
    assert decode_on_tensor_cores(1, grouped=False, deterministic=True, min_batch=None)
    assert [decode_on_tensor_cores(b, grouped=True, deterministic=False, min_batch=3) for b in (2, 3, 4)] == [
        False, True, True]
    assert not decode_on_tensor_cores(4, grouped=False, deterministic=False, min_batch=3)  # one query head per KV head

    class Wrapper:
        def __init__(self, tensor_cores: bool) -> None:
            self.tensor_cores = tensor_cores

        def plan(self, *args, **kwargs) -> None:
            pass

    backend = object.__new__(FlashInferBackend)
    backend.shape, backend.dtype = (4, 2, 8), torch.bfloat16
    backend.deterministic, backend.prefill_reference, backend.grouped = False, None, True
    backend.tensor_core_min_batch, backend.fast_decode_plan, backend._planned = 3, False, weakref.WeakSet()
    backend.decode = {tc: [Wrapper(tc), Wrapper(tc)] for tc in (False, True)}
    backend._kv_indptr = [torch.zeros(5, dtype=torch.int32) for _ in range(2)]
    backend._kv_lens = [torch.zeros(4, dtype=torch.int32) for _ in range(2)]
    backend._last_page_len = torch.ones(4, dtype=torch.int32)
    for n, expected in ((2, False), (3, True)):
        backend.plan(AttentionMetadata(positions=torch.zeros(n), out_slots=torch.zeros(n), qo_indptr=torch.arange(n + 1),
                                       kv_indptr=torch.zeros(n + 1), kv_indices=torch.arange(2 * n), qo_lens=[1] * n,
                                       kv_lens=[2] * n))
        assert backend._active.tensor_cores is expected


def test_fast_decode_plan_only_after_a_wrappers_first_plan():
    """With `fast_decode_plan` on, a decode wrapper's first plan goes through FlashInfer's own
    plan() (which sets up its kernel module) and every later one through the fast path; off, every
    plan goes through plan()."""
    import weakref

    import torch

    from minisgl.gpu.flashinfer_backend import FlashInferBackend
    from minisgl.models.attention import AttentionMetadata

    calls: list[tuple[str, int]] = []

    class Wrapper:
        def __init__(self, name: int) -> None:
            self.name = name

        def plan(self, *args, **kwargs) -> None:
            calls.append(("plan", self.name))

    for fast in (True, False):
        calls.clear()
        backend = object.__new__(FlashInferBackend)
        backend.shape, backend.dtype = (4, 2, 8), torch.bfloat16
        backend.deterministic, backend.prefill_reference, backend.grouped = False, None, True
        backend.tensor_core_min_batch, backend.fast_decode_plan, backend._planned = None, fast, weakref.WeakSet()
        backend.decode = {False: [Wrapper(0), Wrapper(1)]}
        backend._kv_indptr = [torch.zeros(3, dtype=torch.int32) for _ in range(2)]
        backend._kv_lens = [torch.zeros(2, dtype=torch.int32) for _ in range(2)]
        backend._last_page_len = torch.ones(2, dtype=torch.int32)
        backend._fast_plan = lambda wrapper, indptr, indices: calls.append(("fast", wrapper.name))
        for batch_id in range(4):
            backend.plan(AttentionMetadata(positions=torch.zeros(2), out_slots=torch.zeros(2), qo_indptr=torch.arange(3),
                                           kv_indptr=torch.zeros(3), kv_indices=torch.arange(5), qo_lens=[1, 1],
                                           kv_lens=[2, 3]), parity=batch_id % 2)
        expected = ["plan", "plan", "fast", "fast"] if fast else ["plan"] * 4
        assert calls == list(zip(expected, [0, 1, 0, 1]))


def test_piecewise_prefill_graphs_say_why_they_are_not_built():
    """piecewise_cuda_graph (on by default) where they cannot run (here: the CPU, no decode graphs):
    no warning, the reason in Engine.prefill_graphs_off, and the eager prefill."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm = LLM(demo_model_path(), device="cpu")
    assert llm.engine.prefill_graphs is None
    assert llm.engine.prefill_graphs_off.startswith("the decode graphs are off")
    assert llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=2))[0].token_ids
    llm.close()
    off = LLM(demo_model_path(), device="cpu", piecewise_cuda_graph=False)
    assert off.engine.prefill_graphs_off == "piecewise_cuda_graph=False"
    off.close()
