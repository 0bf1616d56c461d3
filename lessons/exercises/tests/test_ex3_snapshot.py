"""Exercise 3: RunningBatch.snapshot must freeze who was in batch n, whatever happens to the live
batch before batch n is committed (readings §5, lesson 5). Each assertion names its rule."""

from minisgl.batch import BatchView, RunningBatch
from minisgl.request import Req
from minisgl.sampling_params import SamplingParams


def make_req(rid: int, row: int, generation: int) -> Req:
    req = Req(rid, [3, 4, 5], SamplingParams(), eos_ids=frozenset(), model_window=64, sample_seed=0)
    req.row, req.row_generation = row, generation
    return req


def live_batch_and_snapshot():
    a, b, c, d = (make_req(i, row=10 + i, generation=i) for i in range(4))
    live = RunningBatch()
    live.batch_id = 7
    live.reqs[:] = [a, b, c]
    snap = live.snapshot()
    # The next schedule() filters and merges the live batch in place, and plans batch 8...
    live.reqs[:] = [c, d]
    live.batch_id = 8
    b.row, b.row_generation = 13, 5  # ...and b's row may be released and reused
    return snap, (a, b, c)


def test_the_snapshot_is_a_batch_view_not_the_live_batch_or_a_copy_of_it():
    live = RunningBatch()
    live.reqs[:] = [make_req(0, row=10, generation=0)]
    snap = live.snapshot()
    assert snap is not live, "snapshot() must return a BatchView frozen at launch, not the live batch itself"
    assert isinstance(snap, BatchView) and not isinstance(snap, RunningBatch), (
        "snapshot() must build a BatchView of the values at launch; a copy of the RunningBatch (copy.copy) shares "
        f"the live request list and its fields are computed when read, not at launch (got {type(snap).__name__})")


def test_the_request_list_is_copied():
    snap, (a, b, c) = live_batch_and_snapshot()
    assert [r.rid for r in snap.reqs] == [0, 1, 2], (
        "the snapshot must hold its own copy of the request list: schedule() filters and merges the live "
        f"list in place, and the snapshot then lists requests {[r.rid for r in snap.reqs]} instead of [0, 1, 2]")


def test_the_request_list_is_copied_for_a_batch_of_one():
    """One request decoding alone: its last step in flight, the length lookahead takes it off the
    live list before that step's commit. A snapshot sharing the list then holds no request, the
    token is never committed, and the request never finishes."""
    live = RunningBatch()
    live.batch_id = 7
    live.reqs[:] = [make_req(0, row=10, generation=0)]
    snap = live.snapshot()
    live.reqs[:] = []  # the next schedule(): the request leaves the live batch
    assert [r.rid for r in snap.reqs] == [0], (
        "the snapshot must hold its own copy of the request list whatever the batch's size, one request included: "
        f"schedule() emptied the live list in place, and the snapshot then lists {[r.rid for r in snap.reqs]} "
        "instead of [0] (its last token would never be committed)")


def test_the_requests_themselves_are_shared():
    snap, (a, b, c) = live_batch_and_snapshot()
    launched = {r.rid: r for r in (a, b, c)}
    # Only the requests of the launched batch: a list that was not copied holds others (the test above).
    assert all(s is launched[s.rid] for s in snap.reqs if s.rid in launched), (
        "copy the list, not the Req objects: the commit writes each token into the request itself, so the "
        "snapshot must hold the very same Req objects")


def test_per_row_fields_are_frozen_at_launch():
    snap, _ = live_batch_and_snapshot()
    got = dict(batch_id=snap.batch_id, is_prefill=snap.is_prefill, rows=snap.rows, generations=snap.generations,
               samples=snap.samples, qo_lens=snap.qo_lens)
    expected = dict(batch_id=7, is_prefill=False, rows=[10, 11, 12], generations=[0, 1, 2], samples=[True] * 3,
                    qo_lens=[1] * 3)
    wrong = [name for name in expected if got[name] != expected[name]]
    assert not wrong, (f"wrong fields in the snapshot: {', '.join(wrong)}. Each field the commit reads must be the value "
                       "at launch, taken from the batch when snapshot() is called, and given to BatchView in its order "
                       f"(batch_id, is_prefill, reqs, rows, generations, samples, qo_lens); got {got}, expected "
                       f"{expected}")
