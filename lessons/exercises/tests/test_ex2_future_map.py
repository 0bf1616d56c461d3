"""Exercise 2: FutureMap.publish / FutureMap.resolve, checked directly (no model needed).
Each test checks one rule and says which (readings §6, lesson 4); they run in this order, so
that the first failure points at the first rule broken."""

import torch

from minisgl.future_map import FutureMap, placeholder

from .host_reads import host_reads_tried

CPU = torch.device("cpu")


def published(rows: list[int], tokens: list[int], max_running_requests: int = 8) -> FutureMap:
    fm = FutureMap(max_running_requests=max_running_requests, device=CPU)
    fm.publish(torch.tensor(rows), torch.tensor(tokens))
    assert fm.tokens.any(), ("publish wrote nothing into the FutureMap: it must store each sampled token in the "
                             "mailbox of its request-pool row (tokens[rows[i]] = next_tokens[i])")
    return fm


def check(fm: FutureMap, ids: list[int], expected: list[int], rule: str) -> None:
    try:
        got = fm.resolve(torch.tensor(ids)).tolist()
    except (IndexError, RuntimeError) as exc:
        raise AssertionError(f"{rule}: resolve({ids}) raised {type(exc).__name__}: {exc}. The mailbox may be indexed "
                             "only by rows: the row -id - 1 of a real id is no row (negative, or past the end), so "
                             "real ids must not index it (clamp their rows, or pick them out first)") from None
    kept = [i for i, g in zip(ids, got) if i < 0 and g == i]
    assert not kept, (f"every placeholder must be replaced by the token of the row it names; placeholders {kept} came "
                      f"back as they were (resolved {ids} to {got}, expected {expected}): which value does the "
                      "result take where an id is negative?")
    assert got == expected, f"{rule}: resolved {ids} to {got}, expected {expected}"


def test_placeholder_minus_row_plus_one_names_the_row():
    fm = published([0, 1], [7, 8])
    check(fm, [placeholder(0), placeholder(1)], [7, 8],
          "placeholder(row) is -(row+1): -1 names row 0 and -2 names row 1 (is the row computed as -id - 1?)")


def test_real_ids_stay():
    fm = published([0], [7])
    check(fm, [placeholder(0), 99, 0], [7, 99, 0],
          "only negative ids are placeholders: real token ids (>= 0, including 0) must pass through unchanged")


def test_the_key_is_the_row_not_the_position_in_the_batch():
    # Batch n had rows 2, 0, 5 at positions 0, 1, 2; in batch n+1 row 5 comes first, then row 2.
    fm = published([2, 0, 5], [12, 10, 15])
    check(fm, [placeholder(5), placeholder(2), placeholder(0)], [15, 12, 10],
          "the FutureMap is keyed by request-pool row, not by position in the batch: positions change when "
          "requests leave or join, rows do not (each token goes to its request's row, each placeholder reads its row)")


def test_a_later_publish_replaces_the_earlier_token():
    fm = published([3], [5])
    fm.publish(torch.tensor([3]), torch.tensor([6]))
    check(fm, [placeholder(3)], [6], "each publish overwrites the row's mailbox with the newest token")


def test_resolve_returns_a_new_tensor_and_leaves_its_input_alone():
    fm = published([1], [9])
    ids = torch.tensor([placeholder(1), 4])
    out = fm.resolve(ids)
    assert ids.tolist() == [placeholder(1), 4], (
        "resolve must not modify its input (the staged input ids, which the host may still hold): return a new "
        f"tensor; the input became {ids.tolist()}")
    assert out.tolist() == [9, 4] and out.dtype == torch.int64


def test_publish_and_resolve_stay_on_the_device():
    """On the meta device a tensor has no values: any .item(), .tolist() or Python loop over values
    (a host sync on a GPU, which would bring the bubble back) raises here."""
    meta = torch.device("meta")
    fm = FutureMap(max_running_requests=8, device=meta)
    try:
        fm.publish(torch.tensor([5, 2], device=meta), torch.tensor([41, 17], device=meta))
        out = fm.resolve(torch.tensor([-3, 99, -6], device=meta))
    except (RuntimeError, NotImplementedError) as exc:
        if "exercise 2" in str(exc):
            raise
        raise AssertionError("publish and resolve must be tensor operations that stay on the device: reading "
                             "values on the host (.item(), .tolist(), int(), a loop over values) makes the host "
                             f"wait for the device on a GPU ({type(exc).__name__}: {exc})") from None
    assert out.shape == (3,) and out.device == meta


def test_publish_and_resolve_read_no_value_on_the_host_on_any_device():
    """The same rule where tensors have values (this CPU): a region that does one thing on the meta
    device and another elsewhere is held to it too."""
    fm = FutureMap(max_running_requests=8, device=torch.device("cpu"))

    def publish_then_resolve():
        fm.publish(torch.tensor([5, 2]), torch.tensor([41, 17]))
        return fm.resolve(torch.tensor([placeholder(2), 99, placeholder(5)]))

    out, tried = host_reads_tried(publish_then_resolve, "exercise 2")
    assert not tried, (
        "publish and resolve must be tensor operations that stay on the device: reading values on the host "
        "(.item(), .tolist(), int(), a loop over values, a boolean mask) makes the host wait for the device on a "
        f"GPU, whether or not it is caught (tried: {', '.join(tried)})")
    assert out.tolist() == [17, 99, 41], f"resolve gave {out.tolist()}, not rows 2 and 5's tokens around 99"
