"""Exercise 3: RunningBatch.snapshot must freeze who was in batch n, whatever happens to the live batch."""

from minisgl.request import Req, SamplingParams
from minisgl.batch import BatchView, RunningBatch


def make_req(rid: int, row: int, generation: int) -> Req:
    req = Req(rid, [3, 4, 5], SamplingParams(), eos_ids=frozenset(), max_context=64, sample_seed=0)
    req.row, req.row_generation = row, generation
    return req


def test_snapshot_is_a_frozen_copy_of_the_live_batch():
    a, b, c, d = (make_req(i, row=10 + i, generation=i) for i in range(4))
    live = RunningBatch()
    live.batch_id = 7
    live.reqs[:] = [a, b, c]
    snap = live.snapshot()
    # The next schedule() filters and merges the live batch in place...
    live.reqs[:] = [c, d]
    live.batch_id = 8
    b.row = None
    # ...but the snapshot still describes batch 7, row for row.
    assert isinstance(snap, BatchView)
    assert snap.batch_id == 7 and snap.is_prefill is False
    assert snap.reqs == [a, b, c]
    assert snap.rows == [10, 11, 12]
    assert snap.generations == [0, 1, 2]
    assert snap.samples == [True] * 3 and snap.qo_lens == [1] * 3
