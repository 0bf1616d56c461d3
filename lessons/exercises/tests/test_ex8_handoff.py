"""Exercise 8: the two sync points between the streams (readings §12 and §3, lesson 2):
the engine stream waits for the scheduler stream before a forward (a device-side wait: launch()
still returns at once), and the host waits for a batch's copy_done before reading its tokens
(that event only, not the whole engine stream). Each assertion names its rule."""

import threading
import time

import pytest

from minisgl import LLM, SamplingParams
from minisgl.batch import InFlight
from minisgl.streams import CpuStream, DeviceError

SIX = SamplingParams(max_new_tokens=6, ignore_eos=True)


def copied_within(staging, seconds: float) -> bool:
    """Whether the device copied the batch's metadata in (its `consumed` event passed) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if staging.consumed is not None and staging.consumed.query():
            return True
        time.sleep(0.01)
    return False


def test_the_forward_waits_for_the_scheduler_stream_without_blocking_the_host(qwen3):
    llm = LLM(qwen3, loop="normal")
    llm.add_request("hello there", SIX)
    planned = llm.scheduler.schedule()
    # A scheduler stream with work still queued: it finishes only when the test opens the gate.
    gate, scheduler_stream = threading.Event(), CpuStream("scheduler (test)")
    scheduler_stream.launch(lambda: gate.wait(10))
    results: list = []
    launcher = threading.Thread(target=lambda: results.append(llm.engine.launch(planned.forward, after=scheduler_stream)),
                                daemon=True)
    launcher.start()
    launcher.join(2)
    blocked = launcher.is_alive()
    copied_early = not blocked and copied_within(planned.forward.staging, seconds=1.0)
    gate.set()
    launcher.join(10)
    scheduler_stream.close()
    assert not blocked, ("launch() blocked the host until the scheduler stream was done: the ENGINE stream must wait "
                         "for it (a wait queued on the engine stream), so that launch() still returns at once")
    assert not copied_early, (
        "the forward started (its metadata was copied in) before the work queued on the scheduler stream was "
        "done: the engine stream must wait for the scheduler stream (`after`) before anything else of the batch")
    llm.scheduler.commit(InFlight(planned.view, results[0]))
    llm.close()


def run(model: str, loop: str, scheduler_stream: CpuStream | None = None, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model, loop=loop, **kwargs)
    if scheduler_stream is not None:
        llm.scheduler.stream = scheduler_stream
    return llm, generate_two(llm)


def generate_two(llm: LLM) -> list[list[int]]:
    """Two requests; a garbage token id (read before it was copied) is reported as that rule."""
    try:
        outs = llm.generate(["hello there", "the lazy dog"], SIX)
    except (DeviceError, IndexError, OverflowError, RuntimeError) as exc:
        if "exercise 8" in str(exc):
            raise
        switches = "" if llm.scheduler.on("pinned_copy") else " (here pinned_copy is off: wait whatever the switches)"
        raise AssertionError(
            "the host read a batch's tokens before its copy_done event passed: next_tokens_host is made with "
            "torch.empty and holds whatever was in that memory until the copy lands, and those ids were committed "
            f"and fed to the next forward{switches} ({type(exc).__name__}: {exc})") from None
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("disabled", [(), ("pinned_copy",)], ids=["defaults", "pinned_copy-off"])
def test_the_host_waits_for_copy_done_before_reading_the_tokens(qwen3, disabled):
    """pinned_copy off makes a GPU's copy to the host blocking inside launch(), but not every
    device's: on this one the copy still runs on the engine's worker. The wait never depends on it."""
    _, expected = run(qwen3, "normal")
    _, got = run(qwen3, "normal", device_delay_ms=20, disable=disabled)
    assert got == expected, (
        "the host read a batch's tokens before its copy_done event passed: wait for copy_done in commit() first, "
        f"always, whatever the switches{' (here pinned_copy is off)' if disabled else ''} "
        f"(got {got}, expected {expected})")


def test_the_host_itself_waits_for_copy_done_not_the_scheduler_stream(qwen3):
    """On a GPU the scheduler's stream is a CUDA stream, and a wait queued on it does not block the
    host. On a CPU it runs inline on the host, so here it gets a thread of its own, as on a GPU."""
    _, expected = run(qwen3, "normal")
    stream = CpuStream("scheduler (test)")
    try:
        _, got = run(qwen3, "normal", scheduler_stream=stream, device_delay_ms=20)
    finally:
        stream.close()
    assert got == expected, (
        "the host read a batch's tokens before its copy_done event passed: the host itself must wait for "
        "copy_done, on the host; a wait queued on a stream makes only that "
        f"stream's later work wait, the host reads on at once (got {got}, expected {expected})")


def test_a_commit_waits_for_its_own_batch_only(qwen3):
    llm = LLM(qwen3, loop="overlap", device_delay_ms=20)
    results, next_busy = {}, []
    launch, commit_results = llm.scheduler.launch, llm.scheduler._commit_results

    def spy_launch(planned):
        results[planned.forward.batch_id] = launch(planned)
        return results[planned.forward.batch_id]

    def spy_commit(view, result):
        if result.batch_id + 1 in results:  # batch n was launched before batch n-1 is committed
            next_busy.append(not results[result.batch_id + 1].copy_done.query())
        return commit_results(view, result)

    llm.scheduler.launch, llm.scheduler._commit_results = spy_launch, spy_commit
    generate_two(llm)
    assert next_busy and sum(next_busy) >= len(next_busy) - 1, (
        "commit() must wait for the copy_done event of the batch it commits, not for the whole engine stream: "
        "waiting for the stream also waits for the batch launched after it, and the overlap is gone; batch n was "
        f"still running during the commit of batch n-1 in {sum(next_busy)} of {len(next_busy)} commits")


def commit_once_over(commit, as_early: bool):
    """The scheduler's commit, begun only once the batch's copy_done event has passed, failed or
    not: the order a host slower than its device gives, forced (no sleep, no timing). The test's
    own wait raises a failure too; it sets that aside, so the commit meets a batch that is over.
    With `as_early`, every commit is made as one at a sync boundary (early=True)."""
    def each_commit(inflight, early=False):
        over = inflight.result.copy_done
        try:
            over.synchronize()
        except DeviceError:
            pass
        return commit(inflight, early or as_early)
    return each_commit


@pytest.mark.parametrize("order", ["device-slow", "batch-over-at-commit", "early-commit"])
def test_a_fault_in_the_devices_work_is_raised_on_the_host_and_nothing_of_it_is_committed(qwen3, order):
    """The engine's work fails on its stream; the host's wait for copy_done re-raises the failure.
    A host that reads on without that wait commits whatever the empty token buffer held. When the
    failed batch is over (its event passed) before its commit begins, as the test makes it, a wait
    only when query() says it has not passed yet misses the failure, every time; an early commit
    (at a sync boundary) waits the same."""
    llm = LLM(qwen3, loop="overlap", device_delay_ms=5 if order == "device-slow" else 1)
    if order != "device-slow":
        llm.scheduler.commit = commit_once_over(llm.scheduler.commit, as_early=order == "early-commit")
    forward, failing_batch = llm.engine._forward_and_sample, []

    def fails_on_the_third_batch(batch, *args):
        if batch.batch_id == 2:
            failing_batch.append(batch.batch_id)
            raise RuntimeError("injected device fault")
        return forward(batch, *args)

    llm.engine._forward_and_sample = fails_on_the_third_batch
    raised = None
    try:
        llm.generate(["hello there", "the lazy dog"], SIX)
    except Exception as exc:  # noqa: BLE001 - which exception came out is what is checked
        raised = exc
    committed = [n for kind, n in llm.stats.events if kind == "commit"]
    case = {"device-slow": "", "batch-over-at-commit": " (here the batch was over before its commit: query() "
            "only says the event passed, failed or not)", "early-commit": " (here at an early commit, at a sync "
            "boundary: it must wait like any other)"}[order]
    assert failing_batch and 2 not in committed, (
        "the host must always wait for a batch's copy_done event before it reads the tokens: that "
        f"wait is where a failure of the device's work reaches the host{case}; batch 2 failed on the device and was "
        f"committed anyway (its tokens are whatever the empty buffer held); committed batches {committed}")
    assert isinstance(raised, DeviceError) and "injected device fault" in str(raised), (
        "a failure of the device's work must reach the caller as the DeviceError that the host's wait for copy_done "
        f"raises, naming the fault; got {raised!r}")
