"""Exercise 2: FutureMap.publish / FutureMap.resolve, checked directly (no model needed)."""

import torch

from minisgl.future_map import FutureMap, placeholder

CPU = torch.device("cpu")


def test_resolve_reads_what_publish_wrote_for_each_row():
    fm = FutureMap(num_rows=8, device=CPU)
    fm.publish(torch.tensor([5, 2]), torch.tensor([41, 17]))
    ids = torch.tensor([placeholder(2), 99, placeholder(5), 0])
    assert fm.resolve(ids).tolist() == [17, 99, 41, 0]


def test_the_key_is_the_row_not_the_position_in_the_batch():
    fm = FutureMap(num_rows=8, device=CPU)
    fm.publish(torch.tensor([0, 1, 2]), torch.tensor([10, 11, 12]))  # batch n: rows 0, 1, 2
    # batch n+1: row 1 left, row 2 now comes first, a new request (row 3, real id) joined
    ids = torch.tensor([placeholder(2), placeholder(0), 7])
    assert fm.resolve(ids).tolist() == [12, 10, 7]


def test_a_later_publish_replaces_the_earlier_token():
    fm = FutureMap(num_rows=4, device=CPU)
    fm.publish(torch.tensor([3]), torch.tensor([5]))
    fm.publish(torch.tensor([3]), torch.tensor([6]))
    assert fm.resolve(torch.tensor([placeholder(3)])).tolist() == [6]


def test_resolve_leaves_its_input_alone():
    fm = FutureMap(num_rows=4, device=CPU)
    fm.publish(torch.tensor([1]), torch.tensor([9]))
    ids = torch.tensor([placeholder(1), 4])
    out = fm.resolve(ids)
    assert out.tolist() == [9, 4] and ids.tolist() == [placeholder(1), 4]
    assert out.dtype == torch.int64
