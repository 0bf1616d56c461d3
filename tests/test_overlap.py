"""overlap == normal, token for token and finish reason for finish reason, on mixed workloads."""

from __future__ import annotations

import pytest

from minisgl import LLM
from minisgl.tracer import SpanName

from .conftest import assert_pool_whole, tiered
from .workloads import random_workload, run, with_stops


def reference_and_workload(model: str, seed: int, chunk_size: int):
    """Run once without stops to learn the outputs, then pick stop tokens from them."""
    llm = LLM(model, loop="normal", chunk_size=chunk_size)
    base = random_workload(seed, llm.engine.model.vocab_size)
    first = run(llm, base)
    workload = with_stops(base, [t for t, _ in first], seed)
    expected = run(llm, workload)
    llm.close()
    return workload, expected


# The fast tier: the three cases the exercises select (minisgl/course/catalog.py); the full tier all six.
@pytest.mark.parametrize("delay_ms, seed", tiered([(d, s) for d in (0.0, 3.0) for s in (0, 1, 2)],
                                                  [(3.0, 0), (0.0, 0), (3.0, 1)]))
def test_overlap_equals_normal(qwen3, seed, delay_ms):
    chunk_size = [8, 16, 512][seed]
    workload, expected = reference_and_workload(qwen3, seed, chunk_size)
    assert {reason for _, reason in expected} == {"stop", "length"}  # both kinds of finish occur
    llm = LLM(qwen3, loop="overlap", chunk_size=chunk_size, device_delay_ms=delay_ms)
    assert run(llm, workload) == expected
    assert llm.stats.overshoot_tokens > 0  # stops were hit with a step already in flight
    assert_pool_whole(llm)
    llm.close()


@pytest.mark.parametrize("arch", tiered([("llama",), ("qwen2",)], [("qwen2",)]))  # parity covers both families
def test_overlap_equals_normal_other_families(tiny_models, arch):
    workload, expected = reference_and_workload(tiny_models[arch], 5, 16)
    llm = LLM(tiny_models[arch], loop="overlap", chunk_size=16, kv_tokens=400)
    assert run(llm, workload) == expected
    assert_pool_whole(llm)
    llm.close()


def test_overlap_pipelines_launches_ahead_of_commits(qwen3):
    """The defining property: batch n+1 is launched before batch n is committed."""
    llm = LLM(qwen3, loop="overlap")
    llm.generate(["hello there", "the lazy dog"], None)
    pos = {event: i for i, event in enumerate(llm.stats.events)}
    batches = llm.stats.batches
    ahead = sum(pos[(SpanName.LAUNCH, n)] < pos[(SpanName.COMMIT, n - 1)] for n in range(1, batches))
    assert batches >= 16 and ahead == batches - 1
    normal = LLM(qwen3, loop="normal")
    normal.generate(["hello there", "the lazy dog"], None)
    ev = normal.stats.events
    assert all(ev[i] == (SpanName.LAUNCH, ev[i][1]) and ev[i + 1] == (SpanName.COMMIT, ev[i][1])
               for i in range(0, len(ev), 2))
    llm.close()
    normal.close()
