"""FutureMap (minisgl/future_map.py): placeholders resolve to the token published for their row,
and the scheduler stages a placeholder exactly where a decode input is still in flight."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.future_map import FutureMap, placeholder

CPU = torch.device("cpu")


def test_a_row_nobody_published_resolves_to_token_zero():
    """A valid id, so that a missing publish shows up as wrong tokens rather than a crash."""
    fm = FutureMap(max_running_requests=4, device=CPU)
    assert fm.resolve(torch.tensor([placeholder(3), 5])).tolist() == [0, 5]


def test_each_placeholder_resolves_to_its_rows_latest_token_in_a_shuffled_batch():
    gen = torch.Generator().manual_seed(0)
    fm = FutureMap(max_running_requests=64, device=CPU)
    latest = {}
    for _ in range(3):  # three steps: each publishes a random subset of rows, in a random order
        rows = torch.randperm(64, generator=gen)[:40]
        tokens = torch.randint(0, 1000, (40,), generator=gen)
        fm.publish(rows, tokens)
        latest.update(zip(rows.tolist(), tokens.tolist()))
    asked = list(latest)[::-1]
    real = torch.randint(0, 1000, (len(asked),), generator=gen).tolist()
    ids = [x for row, token in zip(asked, real) for x in (placeholder(row), token)]  # placeholders and real ids
    expected = [x for row, token in zip(asked, real) for x in (latest[row], token)]
    assert fm.resolve(torch.tensor(ids)).tolist() == expected


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_scheduler_stages_a_placeholder_only_for_a_token_in_flight(qwen3, loop):
    """overlap: a decode input is the placeholder of the request's own row while the previous token
    is in flight; normal: every input was committed before the next batch is planned."""
    llm = LLM(qwen3, loop=loop)
    staged = []  # (request row, input id the scheduler staged for its decode step)
    decode_input = llm.scheduler._decode_input
    llm.scheduler._decode_input = lambda req: staged.append((req.row, decode_input(req))) or staged[-1][1]
    outs = llm.generate(["hello there", "count 1 to 9:"], SamplingParams(max_new_tokens=6, ignore_eos=True))
    llm.close()
    placeholders = [(row, ident) for row, ident in staged if ident < 0]
    assert all(ident == placeholder(row) for row, ident in placeholders), placeholders
    if loop == "overlap":
        assert len(placeholders) == len(staged) > 0  # every decode input was in flight: no host wait
    else:
        assert staged and not placeholders
    assert all(len(o.token_ids) == 6 for o in outs)
