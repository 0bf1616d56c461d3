"""Staging buffers (minisgl/staging.py): what the scheduler writes is what the forward reads,
the device reads a copy, and the engine never hands out a buffer the device has not copied."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.staging import StagingBuffer, TokenColumns

CPU = torch.device("cpu")


def staged_batch() -> tuple[StagingBuffer, dict[str, list]]:
    """Two requests (rows 2 and 0) of 3 and 1 tokens, written into a buffer sized for more."""
    tokens = TokenColumns()
    tokens.add(2, [5, 6, 7], 4, [10, 11, 12])
    tokens.add(0, [-3], 9, [13])
    columns = dict(rows=[2, 0], kv_lens=[7, 10], qo_indptr=[0, 3, 4], kv_indptr=[0, 7, 17], temperature=[0.5, 0.0],
                   top_p=[0.75, 1.0], top_k=[4, -1], seeds=[1, 2], sample_steps=[0, 3])
    buf = StagingBuffer(max_tokens=8, max_running_requests=4, device=CPU)
    buf.write(tokens, **columns)
    return buf, {**vars(tokens), **columns}


def test_every_column_reaches_the_device_inputs_with_its_values_and_length():
    buf, written = staged_batch()
    inputs = buf.to_device(num_tokens=4, num_reqs=2)
    assert {name: getattr(inputs, name).tolist() for name in written} == written
    assert inputs.temperature.dtype == torch.float32 and inputs.input_ids.dtype == torch.int64


def test_the_device_reads_a_copy_that_a_later_write_does_not_change():
    """Once the copy is made the host may rewrite the buffer: this is the read the WAR wait protects."""
    buf, written = staged_batch()
    inputs = buf.to_device(num_tokens=4, num_reqs=2)
    tokens = TokenColumns()
    tokens.add(1, [99, 98, 97, 96], 0, [0, 1, 2, 3])
    buf.write(tokens, rows=[1, 1], kv_lens=[4, 4], qo_indptr=[0, 2, 4], kv_indptr=[0, 4, 8], temperature=[0.0, 0.0],
              top_p=[1.0, 1.0], top_k=[-1, -1], seeds=[0, 0], sample_steps=[0, 0])
    assert inputs.input_ids.tolist() == written["input_ids"] and inputs.rows.tolist() == written["rows"]


@pytest.mark.parametrize("disable", [(), ("staging_double_buffer",)])  # two buffers, or one reused each batch
def test_engine_never_rewrites_a_buffer_the_device_has_not_copied(qwen3, disable):
    llm = LLM(qwen3, loop="overlap", device_delay_ms=2, disable=disable)
    ring = llm.scheduler.batch_builder.staging
    handed_out = []  # for each acquire: had the device copied what the buffer held?
    acquire = ring.acquire

    def checked_acquire():
        buf = acquire()
        handed_out.append(buf.consumed is None or buf.consumed.query())
        return buf

    ring.acquire = checked_acquire
    llm.generate(["hello there", "count 1 to 9:", "the lazy dog"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    batches = llm.stats.batches
    llm.close()
    assert len(handed_out) == batches > 2  # one buffer per batch
    assert all(handed_out) and ring.unread_overwrites == 0
