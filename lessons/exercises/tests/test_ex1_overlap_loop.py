"""Exercise 1: overlap_loop. Every assertion names the rule it checks, so that the first failure
tells the learner what to think about (readings §3, lesson 3).

Only what lessons 0-3 teach is checked here: the pipelining, the commit of every batch exactly
once, the in-flight hand-off, and the loop's side of the sync boundaries: `_must_commit_first` is
given, and the tests answer for it (its two cases belong to lessons 4 and 8, whose switches are
checked by exercise 2 and lesson 8's tests)."""

from minisgl import LLM, SamplingParams
from minisgl.tracer import SpanName

FOUR = SamplingParams(max_new_tokens=4, ignore_eos=True)


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
        "hold a snapshot of the batch (a frozen copy of its view; lesson 3, and lesson 5 for why), not the live "
        "RunningBatch that normal_loop passes, because schedule() changes it before the commit; finished "
        f"{len(done)} of 2 requests, outputs {done}")


def test_batch_n_is_launched_before_batch_n_minus_1_is_committed(qwen3):
    llm = LLM(qwen3, loop="overlap")
    stepped(llm, ["hello there", "the lazy dog"], FOUR)
    pos = order(llm)
    serial = [n for n in range(1, llm.stats.batches) if pos[(SpanName.LAUNCH, n)] > pos[(SpanName.COMMIT, n - 1)]]
    assert not serial, ("overlap_loop must launch batch n before it commits batch n-1 (that is the whole "
                        f"point: commit n-1 while n runs); batches launched after the previous commit: {serial}")


def record(llm: LLM, early_before: int, early_after: int) -> list[tuple]:
    """What overlap_loop does, in order: each question to _must_commit_first (answered by the test:
    True before planning while batch `early_before` is in flight, True after planning while
    `early_after` is), and each schedule(), launch() and commit()."""
    sched, log = llm.scheduler, []
    schedule, launch, commit = sched.schedule, sched.launch, sched.commit

    def must_commit_first(last, planned):
        when = "before" if planned is None else "after"
        says = last is not None and last.view.batch_id == (early_before if planned is None else early_after)
        log.append(("ask", when, None if last is None else last.view.batch_id, says))
        return says

    def recorded_schedule():
        planned = schedule()
        log.append(("schedule",))
        return planned

    def recorded_launch(planned):
        result = launch(planned)
        log.append(("launch", result.batch_id))
        return result

    def recorded_commit(inflight, early=False):
        log.append(("commit", inflight.view.batch_id, early))
        return commit(inflight, early=early)

    sched._must_commit_first, sched.schedule = must_commit_first, recorded_schedule
    sched.launch, sched.commit = recorded_launch, recorded_commit
    return log


def first_after(log: list[tuple], start: int, kind: str) -> int:
    return next((i for i in range(start, len(log)) if log[i][0] == kind), len(log))


def test_an_early_commit_happens_where_must_commit_first_says(qwen3):
    """_must_commit_first is given (its docstring says when and why); the loop must ask it before
    and after schedule(), and when it says so commit `last` early, before that point."""
    before, after = 2, 5  # the batches in flight when the test's answers are True
    llm = LLM(qwen3, loop="overlap")
    log = record(llm, early_before=before, early_after=after)
    done = stepped(llm, ["hello there", "the lazy dog"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(done) == 2 and all(len(ids) == 8 for ids in done.values()), f"outputs {done}"
    for batch, when, point in ((before, "before", "schedule"), (after, "after", "launch")):
        asked = [i for i, e in enumerate(log) if e[:3] == ("ask", when, batch)]
        planned = "planned=None" if when == "before" else "planned"
        assert asked, (f"overlap_loop must ask _must_commit_first(last, {planned}) {when} schedule() in every call "
                       f"with a batch in flight; it never asked that while batch {batch} was in flight")
        committed = next(i for i, e in enumerate(log) if e[:2] == ("commit", batch))
        launched = next(i for i, e in enumerate(log) if e == ("launch", batch))
        assert committed < first_after(log, launched + 1, point), (
            f"when _must_commit_first(last, {planned}) says so, batch n-1 must be committed BEFORE "
            f"{'schedule() plans batch n' if point == 'schedule' else 'batch n is launched'}: batch {batch} "
            f"was committed after the next {point}()")
        assert log[committed][2], (f"an early commit must say so: commit(last, early=True) (batch {batch} was "
                                   "committed with early=False)")
    assert llm.stats.early_commits == 2, (
        f"commit early only where _must_commit_first says so: 2 early answers, {llm.stats.early_commits} early "
        "commits")


def test_the_batch_snapshot_switch_is_kept(qwen3):
    """With batch_snapshot on, the batch in flight is committed through a frozen copy of its view;
    with it off, through the live view that planning returned (lesson 5 shows what then goes wrong)."""
    for switch_on in (True, False):
        llm = LLM(qwen3, loop="overlap", disable=() if switch_on else ("batch_snapshot",))
        llm.scheduler.check_each_step = False
        planned_views, committed_views = {}, {}
        launch, commit_results = llm.scheduler.launch, llm.scheduler._commit_results

        def spy_launch(planned):
            planned_views[planned.forward.batch_id] = planned.view
            return launch(planned)

        def spy_commit(view, result):
            committed_views[result.batch_id] = view
            return commit_results(view, result)

        llm.scheduler.launch, llm.scheduler._commit_results = spy_launch, spy_commit
        stepped(llm, ["hello there", "the lazy dog", "count 1 to 9:"], FOUR)
        decode = [n for n, view in planned_views.items() if not view.is_prefill]
        assert decode and set(committed_views) == set(planned_views)
        live = [n for n in decode if committed_views[n] is planned_views[n]]
        if switch_on:
            assert not live, ("a decode batch in flight must be committed through a frozen copy of its view (the next "
                              f"schedule() changes the live one): batches {live} were committed through the live view")
        else:
            assert live == decode, ("keep the switch: with batch_snapshot off, the batch in flight keeps the live view "
                                    f"that planning returned; batches {sorted(set(decode) - set(live))} got a copy")
        llm.close()
