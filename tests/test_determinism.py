"""Deterministic mode and engine shutdown, on the CPU (the CUDA side is in test_cuda.py).

`deterministic=True` computes every GEMM in slabs of a fixed number of rows, so a row's
numbers cannot depend on the size of its batch; `close()` stops the stream's worker thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.models.attention import KV_TILE, causal_attention, invariant_attention
from minisgl.models.decoder import CPU_INVARIANT_ROWS, DETERMINISTIC_ROWS, Linear, fixed_rows_linear

from .conftest import assert_pool_whole
from .workloads import random_workload, run, with_stops


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_fixed_rows_linear_matches_plain_linear(rows, bias):
    torch.manual_seed(rows)
    x = torch.randn(13, 24, dtype=torch.float64)
    weight, b = torch.randn(10, 24, dtype=torch.float64), torch.randn(10, dtype=torch.float64) if bias else None
    torch.testing.assert_close(fixed_rows_linear(x, weight, b, rows), F.linear(x, weight, b))


def test_fixed_rows_linear_is_batch_invariant():
    """The first k rows come out bit for bit the same whatever rows follow them."""
    torch.manual_seed(0)
    x = torch.randn(300, 64)
    weight = torch.randn(96, 64)
    full = fixed_rows_linear(x, weight, None, DETERMINISTIC_ROWS)
    for k in (1, 7, 64, 255, 256, 257):
        assert torch.equal(fixed_rows_linear(x[:k], weight, None, DETERMINISTIC_ROWS), full[:k])


def test_invariant_attention_matches_causal_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(300, 4, 16), torch.randn(700, 2, 16), torch.randn(700, 2, 16)
    torch.testing.assert_close(invariant_attention(q, k, v), causal_attention(q, k, v), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_does_not_depend_on_the_chunking(dtype):
    """A prompt prefilled in one chunk or in several (as the two loops may do): the same bits
    for every query."""
    torch.manual_seed(1)
    n = KV_TILE + 90
    q, k, v = (torch.randn(n, 4, 16).to(dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    whole = invariant_attention(q, k, v)
    for cuts in ([5, 70, n], [1, 2, 3, KV_TILE, KV_TILE + 1, n], [200, n]):
        start = 0
        for end in cuts:
            chunk = invariant_attention(q[start:end], k[:end], v[:end])
            assert torch.equal(chunk, whole[start:end]), f"queries {start}..{end - 1} differ when chunked at {cuts}"
            start = end


def test_a_one_token_prompt_takes_the_prefill_path(qwen3, monkeypatch):
    """A prefill batch whose chunks are all one token long is still a prefill batch: if it took
    the decode kernel, a prompt position's numbers would depend on how the loop chunked it."""
    llm = LLM(qwen3, loop="normal", deterministic=True)
    seen: list[tuple[bool, list[int]]] = []
    forward = llm.engine.backend.forward

    def spy(q, k, v, layer_id, meta, kv):
        if layer_id == 0:
            seen.append((meta.is_decode, list(meta.qo_lens)))
        return forward(q, k, v, layer_id, meta, kv)

    monkeypatch.setattr(llm.engine.backend, "forward", spy)
    llm.generate([[7]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert seen[0] == (False, [1]), "the 1-token prompt was run as a decode step"
    assert [is_decode for is_decode, _ in seen[1:]] == [True, True]
    llm.close()


def test_linear_switches_between_plain_and_fixed_rows():
    layer = Linear(8, 4)
    x = torch.randn(3, 8)
    plain = layer(x)
    layer.fixed_rows = 2
    torch.testing.assert_close(layer(x), plain)


@pytest.mark.full  # the longest workload here; overlap == normal itself runs in both tiers (test_overlap.py)
def test_deterministic_overlap_equals_normal_on_cpu(qwen3):
    ref = LLM(qwen3, loop="normal", chunk_size=16, deterministic=True)
    base = random_workload(3, ref.engine.model.vocab_size)
    workload = with_stops(base, [t for t, _ in run(ref, base)], 3)
    expected = run(ref, workload)
    ref.close()
    llm = LLM(qwen3, loop="overlap", chunk_size=16, deterministic=True)
    assert all(m.fixed_rows == CPU_INVARIANT_ROWS for m in llm.engine.model.modules() if isinstance(m, Linear))
    assert run(llm, workload) == expected
    assert_pool_whole(llm)
    llm.close()


def test_close_stops_the_stream_thread_and_is_idempotent(qwen3):
    before = set(threading.enumerate())
    llm = LLM(qwen3)
    llm.generate([[5, 6, 7]])
    assert len(set(threading.enumerate()) - before) >= 1  # the CPU stream's worker
    llm.close()
    llm.close()
    assert set(threading.enumerate()) - before == set()
    assert llm.engine.closed and llm.engine.kv is None and llm.engine.graphs is None
