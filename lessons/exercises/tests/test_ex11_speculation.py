"""Exercise 11: speculative decoding under the overlap (readings §18, lesson 12). A verify step keeps
the drafts up to the first one the target disagrees with, plus the target's own token after them;
the next step is planned before those accept lengths exist, so it is given KV for two steps past the
committed length, and the host reads its mirror of the lengths only after their publish event.
Each assertion names its rule."""

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.features.speculative.verify import accept_greedy

from .host_reads import host_reads_tried

K = 3
PROMPTS = [[3, 4, 5 + i] * (2 + i) for i in range(3)] + [[9, 10, 11, 12, 13, 14, 15]]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 5, 9, 14)]

ACCEPT_RULE = ("the accept length is the number of leading drafts equal to the target's token before them, up to "
               "the first that differs, plus one for the target's own token after them (the bonus)")
RESERVE_RULE = ("a verify step gets KV slots up to two steps of K+1 past max(committed length, prefill length): the "
                "verify in flight may still add K+1, the new one writes K+1 more, and the promise covers no more")
WAIT_RULE = ("the host reads its mirror of the lengths only after the publish event of the batch in flight "
             "(publish_ready.synchronize()) while spec_publish_wait is on; with the switch off, without waiting")


def test_accept_length_counts_the_leading_agreements_and_the_bonus():
    target = torch.tensor([[1, 2, 3, 4]] * 4)
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3], [1, 2, 9]])
    assert accept_greedy(drafts, target).tolist() == [4, 2, 1, 3], ACCEPT_RULE


def generate(qwen3: str, loop: str, *disabled: str, rule: str, on_step=None) -> tuple[LLM, list[list[int]]]:
    llm = LLM(qwen3, loop=loop, disable=disabled, device_delay_ms=2, speculative_algorithm="standalone",
              speculative_draft_model_path=qwen3, speculative_num_steps=K)  # the target drafts for itself
    try:
        rids = [llm.add_request(p, s) for p, s in zip(PROMPTS, PARAMS)]
        outs = {}
        while llm.has_unfinished():
            outs.update({o.rid: o.token_ids for o in llm.step()})
            if on_step is not None:
                on_step(llm)
    except Exception as exc:  # noqa: BLE001 - a crash is reported as the rule it breaks
        if "exercise 11" in str(exc):
            raise
        raise AssertionError(f"{rule} ({type(exc).__name__}: {exc})") from None
    return llm, [outs[r] for r in rids]


@pytest.fixture(scope="module")
def plain(qwen3) -> list[list[int]]:
    llm = LLM(qwen3, loop="normal")
    outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    llm.close()
    return outs


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_verify_steps_give_the_plain_tokens(qwen3, plain, loop):
    def within_reserve(llm):
        for r in llm.scheduler.running.reqs:
            if not r.released:
                assert r.allocated_len <= max(r.kv_committed_len, r.prefill_len) + 2 * (K + 1), RESERVE_RULE

    llm, outs = generate(qwen3, loop, rule=ACCEPT_RULE, on_step=within_reserve)
    spec = llm.scheduler.features.speculation
    assert spec.unallocated_writes == 0, RESERVE_RULE
    assert outs == plain, WAIT_RULE if loop == "overlap" else ACCEPT_RULE
    assert llm.stats.spec_accepted_tokens / llm.stats.spec_verify_rows > 3, ACCEPT_RULE  # a perfect draft
    llm.close()


def test_the_switches_are_kept(qwen3, plain):
    llm, outs = generate(qwen3, "overlap", "spec_publish_wait", rule=WAIT_RULE)
    assert outs != plain, WAIT_RULE + "; here the switch is off and the tokens came out right: keep the switch"
    llm.close()
    llm, outs = generate(qwen3, "overlap", "spec_alloc_reserve", rule=RESERVE_RULE)
    assert llm.scheduler.features.speculation.unallocated_writes > 0, \
        RESERVE_RULE + "; with spec_alloc_reserve off, one step only: keep the switch"
    llm.close()


def test_the_accept_length_stays_on_the_device():
    """On the meta device a tensor has no values: .tolist(), .item() or a Python loop over values
    (a host sync on a GPU, in the middle of the device's verify step) raises here."""
    meta = torch.device("meta")
    try:
        out = accept_greedy(torch.zeros(4, K, dtype=torch.int64, device=meta),
                            torch.zeros(4, K + 1, dtype=torch.int64, device=meta))
    except (RuntimeError, NotImplementedError) as exc:
        if "exercise 11" in str(exc):
            raise
        raise AssertionError("the accept length must be computed with tensor operations on the device: reading the "
                             "drafts on the host (.tolist(), a loop over values) makes the verify step wait for the "
                             f"device ({type(exc).__name__}: {exc})") from None
    assert out.shape == (4,) and out.device == meta
    out, tried = host_reads_tried(  # where tensors have values, the same rule
        lambda: accept_greedy(torch.tensor([[1, 2, 3], [1, 9, 3]]), torch.tensor([[1, 2, 3, 4]] * 2)), "exercise 11")
    assert not tried, (
        "the accept length must be computed with tensor operations on the device, on every device: reading the "
        "drafts on the host (.tolist(), .item(), a loop over values) makes the verify step wait for the device, "
        f"whether or not it is caught (tried: {', '.join(tried)})")
    assert out.tolist() == [4, 2], ACCEPT_RULE


class PublishedOnTheHostOnly:
    """A publish event as CUDA's looks between its launch and the device reaching it: `done` (the
    host's flag) is set once the record is queued, the device's copy of the lengths not yet made."""

    def __init__(self) -> None:
        import threading

        self.done = threading.Event()
        self.done.set()
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


@pytest.mark.parametrize("switch_on", [True, False])
def test_the_host_waits_for_the_publish_even_when_its_flag_is_set(switch_on):
    """On CUDA the host's flag is set at launch, long before the device has published: the flag
    says nothing about the mirror's values, only the event's synchronize() does."""
    from minisgl.features.speculative.relay import SpecRelay
    from minisgl.mechanisms import Mechanisms

    relay = SpecRelay(4, 8, torch.device("cpu"), Mechanisms(() if switch_on else ("spec_publish_wait",)))
    relay.publish_ready = event = PublishedOnTheHostOnly()
    relay.host_lengths([0, 1])
    assert event.waits == (1 if switch_on else 0), (
        WAIT_RULE + f"; here the publish event's host flag was set (as on CUDA once its record is queued) and "
        f"synchronize() was called {event.waits} times with spec_publish_wait {'on' if switch_on else 'off'}: "
        "wait through synchronize() whatever the flag says")
