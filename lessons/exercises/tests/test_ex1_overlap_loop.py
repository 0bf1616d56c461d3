"""Exercise 1: overlap_loop and its sync boundaries. Every assertion names the rule it checks,
so that the first failure tells the learner what to think about (readings §3, lesson 3)."""

from minisgl import LLM, SamplingParams
from minisgl.tracer import SpanName

FOUR = SamplingParams(max_new_tokens=4, ignore_eos=True)
LONG_PROMPTS = [f"prompt number {i} is a little longer than the chunk" for i in range(3)]


def stepped(llm: LLM, prompts: list[str], params: SamplingParams, late: list[str] = (), after: int = 0,
            max_steps: int = 300) -> dict[int, list[int]]:
    """Drive the loop step by step: `prompts` at once, `late` ones after `after` steps. Returns
    rid -> output ids of every request that finished; stops when there is no work left."""
    for prompt in prompts:
        llm.add_request(prompt, params)
    done: dict[int, list[int]] = {}
    try:
        for step in range(max_steps):
            if step == after:
                for prompt in late:
                    llm.add_request(prompt, params)
            if step > after and not llm.has_unfinished():
                break
            for out in llm.step():
                done[out.rid] = out.token_ids
    except RuntimeError:  # KVAccountingError, InvariantError: a batch committed twice is the likely cause
        assert_each_batch_committed_once(llm)
        raise
    assert_each_batch_committed_once(llm)
    return done


def assert_each_batch_committed_once(llm: LLM) -> None:
    """Also called while the error a double commit caused is handled: the rule replaces that error."""
    commits = [n for kind, n in llm.stats.events if kind == "commit"]
    twice = sorted({n for n in commits if commits.count(n) > 1})
    if twice:
        raise AssertionError("each batch is committed exactly once: after an early commit of the batch in flight it "
                             "is done, so it must not be committed again at the end of the call; batches "
                             f"{twice} were committed twice") from None


def order(llm: LLM) -> dict[tuple[str, int], int]:
    return {event: i for i, event in enumerate(llm.stats.events)}


def spy_kinds(llm: LLM) -> LLM:
    """Record 'P' or 'D' for every launched batch, in batch-id order, as `llm.batch_kinds`."""
    llm.batch_kinds = []
    launch = llm.scheduler.launch

    def spy(planned):
        llm.batch_kinds.append("P" if planned.forward.is_prefill else "D")
        return launch(planned)

    llm.scheduler.launch = spy
    return llm


def test_the_batch_in_flight_is_committed_even_when_nothing_new_is_planned(qwen3):
    llm = LLM(qwen3, loop="overlap")
    llm.scheduler.check_each_step = False  # the ownership audit would report the symptom (leaked slots) first
    done = stepped(llm, ["hello there", "the lazy dog"], FOUR)
    events = set(llm.stats.events)
    uncommitted = [n for n in range(llm.stats.batches) if (SpanName.COMMIT, n) not in events]
    # Two mistakes lose results here; the events tell them apart, so that the message names the right one.
    assert not uncommitted, ("the batch in flight must still be committed when schedule() plans nothing: "
                             f"batches launched but never committed: {uncommitted}")
    assert len(done) == 2 and all(len(ids) == 4 for ids in done.values()), (
        "every batch was committed, yet the results did not reach their requests: the in-flight entry must "
        "hold a snapshot of the batch (planned.view.snapshot(), lesson 5), not the live RunningBatch that "
        f"normal_loop passes, because schedule() changes it before the commit; finished {len(done)} of 2 "
        f"requests, outputs {done}")


def test_batch_n_is_launched_before_batch_n_minus_1_is_committed(qwen3):
    llm = LLM(qwen3, loop="overlap")
    stepped(llm, ["hello there", "the lazy dog"], FOUR)
    pos = order(llm)
    serial = [n for n in range(1, llm.stats.batches) if pos[(SpanName.LAUNCH, n)] > pos[(SpanName.COMMIT, n - 1)]]
    assert not serial, ("overlap_loop must launch batch n before it commits batch n-1 (that is the whole "
                        f"point: commit n-1 while n runs); batches launched after the previous commit: {serial}")


def test_two_prefills_in_a_row_commit_the_first_before_launching_the_second(qwen3):
    llm = spy_kinds(LLM(qwen3, loop="overlap", chunk_size=8))
    stepped(llm, LONG_PROMPTS, FOUR)
    pos, kind = order(llm), llm.batch_kinds
    pairs = [n for n in range(1, len(kind)) if kind[n - 1] == kind[n] == "P"]
    assert pairs, "the workload should produce consecutive prefill batches"
    late = [n for n in pairs if pos[(SpanName.COMMIT, n - 1)] > pos[(SpanName.LAUNCH, n)]]
    assert not late, ("prefill_sync: when batch n and batch n-1 are both prefills, batch n-1 must be committed "
                      f"BEFORE batch n is launched (its first tokens come out one batch sooner); batches {late} "
                      "were launched first. Where is the early commit placed relative to launch()?")
    assert llm.stats.early_commits == len(pairs), (
        f"prefill_sync: {len(pairs)} prefill-after-prefill boundaries, but {llm.stats.early_commits} early commits "
        "were counted: commit them with commit(last, early=True), and only at those boundaries")


def test_a_prefill_after_a_decode_still_overlaps(qwen3):
    llm = spy_kinds(LLM(qwen3, loop="overlap"))
    stepped(llm, ["hello there"], SamplingParams(max_new_tokens=12, ignore_eos=True), late=["the lazy dog"], after=4)
    pos, kind = order(llm), llm.batch_kinds
    after_decode = [n for n in range(1, len(kind)) if kind[n - 1] == "D" and kind[n] == "P"]
    assert after_decode, "the workload should produce a prefill right after a decode"
    synced = [n for n in after_decode if pos[(SpanName.COMMIT, n - 1)] < pos[(SpanName.LAUNCH, n)]]
    assert not synced and llm.stats.early_commits == 0, (
        "prefill_sync applies only to two prefills in a row: a prefill that follows a DECODE batch must still "
        f"be launched before that decode is committed (batches {synced} were synced, "
        f"{llm.stats.early_commits} early commits)")


def test_future_map_off_commits_before_scheduling(qwen3):
    llm = LLM(qwen3, loop="overlap", disable=("future_map",))
    try:
        done = stepped(llm, ["hello there", "the lazy dog"], FOUR)
    except AssertionError as exc:
        if "committed exactly once" in str(exc):
            raise
        raise AssertionError("future_map off: batch n's input ids must be committed tokens, so batch n-1 must be "
                             "committed BEFORE schedule() plans batch n (commit(last, early=True)); "
                             f"instead schedule() met an uncommitted token ({exc})") from None
    assert len(done) == 2
    assert llm.stats.early_commits == llm.stats.batches, (
        "future_map off: every batch must be committed early, before the next schedule(); "
        f"{llm.stats.early_commits} early commits for {llm.stats.batches} batches")


def test_batch_snapshot_off_keeps_the_live_running_batch(qwen3):
    for disabled, live in (((), False), (("batch_snapshot",), True)):
        llm = LLM(qwen3, loop="overlap", disable=disabled)
        llm.add_request("hello there", FOUR)
        views = []
        for _ in range(3):
            llm.step()
            if llm.scheduler.last is not None:
                views.append(llm.scheduler.last.view is llm.scheduler.running)
        assert views and all(v == live for v in views[1:]), (
            "the in-flight entry must hold a snapshot of the batch (planned.view.snapshot()) while batch_snapshot "
            "is on, and the live RunningBatch itself when it is switched off (the switch shows the bug of "
            f"lesson 5); with disable={disabled}: holds the live batch = {views}")
        llm.close()
