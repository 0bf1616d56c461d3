"""Known-wrong solutions: plausible mistakes, each of which the exercise's tests must catch.

Each entry replaces one or more marked regions of an exercise (by the region's name, the text
after `# >>> exercise N:`) with wrong code; the other regions keep the reference. The
repository's test (tests/test_exercises.py) puts each one into a copy of the package, runs the
exercise's tests in-process (runner.py), and checks that they fail within a minute and that the
first failure says `expect`: the concept the learner has to think about. `make_exercise.py check N --wrong NAME`
shows a teacher what a learner with that mistake sees.
"""

from __future__ import annotations

from minisgl.course.catalog import Wrong


OVERLAP_LOOP = """
if self._must_commit_first(last, planned=None):
    self.commit(last, early=True)
    last = None
planned = self.schedule()
{before_launch}
inflight = None
if planned is not None:
    result = self.launch(planned)
    inflight = InFlight({view}, result)
{after_launch}
if last is not None:
    self.commit(last)
return inflight
"""
EARLY = """
if self._must_commit_first(last, planned):
    self.commit(last, early=True)
    last = None
"""
SNAPSHOT = 'planned.view.snapshot() if self.on("batch_snapshot") else planned.view'


def overlap_loop(before_launch: str = EARLY, after_launch: str = "", view: str = SNAPSHOT) -> str:
    return OVERLAP_LOOP.format(before_launch=before_launch.strip(), after_launch=after_launch.strip(), view=view)


WRONG: list[Wrong] = [
    # ---------------------------------------------------------------- exercise 1: overlap_loop
    Wrong(1, "commit-before-launch", "commits batch n-1 before launching batch n: the serial loop again",
          "must launch batch n before it commits batch n-1", {"overlap_loop": """
planned = self.schedule()
if last is not None:
    self.commit(last)
if planned is None:
    return None
result = self.launch(planned)
return InFlight(planned.view.snapshot() if self.on("batch_snapshot") else planned.view, result)
"""}),
    Wrong(1, "early-commit-after-launch", "makes the early commit after planning only once the new batch is launched",
          "must be committed BEFORE batch n is launched",
          {"overlap_loop": overlap_loop(before_launch="", after_launch=EARLY)}),
    Wrong(1, "drop-last-when-idle", "returns as soon as nothing new is planned, dropping the batch in flight",
          "must still be committed when schedule() plans nothing", {"overlap_loop": """
planned = self.schedule()
if planned is None:
    return None
if self._must_commit_first(last, planned):
    self.commit(last, early=True)
    last = None
result = self.launch(planned)
inflight = InFlight(planned.view.snapshot() if self.on("batch_snapshot") else planned.view, result)
if last is not None:
    self.commit(last)
return inflight
"""}),
    Wrong(1, "live-view-like-normal-loop", "keeps normal_loop's InFlight(planned.view, result): no snapshot",
          "must hold a snapshot of the batch", {"overlap_loop": overlap_loop(view="planned.view")}),
    Wrong(1, "no-question-before-planning", "asks _must_commit_first only after schedule(), never before it",
          "before schedule() in every call", {"overlap_loop": """
planned = self.schedule()
if self._must_commit_first(last, planned):
    self.commit(last, early=True)
    last = None
inflight = None
if planned is not None:
    result = self.launch(planned)
    inflight = InFlight(planned.view.snapshot() if self.on("batch_snapshot") else planned.view, result)
if last is not None:
    self.commit(last)
return inflight
"""}),
    Wrong(1, "early-commit-not-marked", "commits early where _must_commit_first says so, but as a usual commit",
          "commit(last, early=True)", {"overlap_loop": overlap_loop(before_launch="""
if self._must_commit_first(last, planned):
    self.commit(last)
    last = None
""")}),
]
WRONG += [
    # ---------------------------------------------------------------- exercise 2: FutureMap
    Wrong(2, "host-loop-except-on-meta", "reads the values on the host, except on the meta device (where that "
          "would raise)", "must be tensor operations that stay on the device", {"publish": """
if str(rows.device) == "meta":
    return
for row, token in zip(rows.tolist(), next_tokens.tolist()):
    self.tokens[row] = token
"""}),
    Wrong(2, "host-loop-unless-it-raises", "reads the values on the host, and falls back to tensor operations when "
          "that raises (as it does only while a test watches)", "whether or not it is caught", {"publish": """
try:
    for row, token in zip(rows.tolist(), next_tokens.tolist()):
        self.tokens[row] = token
except (RuntimeError, NotImplementedError):
    self.tokens[rows] = next_tokens
"""}),
    Wrong(2, "no-publish", "publish does nothing (only resolve written)", "publish wrote nothing",
          {"publish": "pass"}),
    Wrong(2, "key-by-position", "publishes by position in the batch instead of by row",
          "keyed by request-pool row, not by position", {"publish": "self.tokens[: len(next_tokens)] = next_tokens"}),
    Wrong(2, "placeholder-off-by-one", "reads row -id instead of -id - 1",
          "placeholder(row) is -(row+1)", {"resolve": """
is_future = input_ids < 0
return torch.where(is_future, self.tokens[(-input_ids).clamp(min=0)], input_ids)
"""}),
    Wrong(2, "real-ids-replaced", "treats every id as a placeholder", "real token ids (>= 0, including 0)",
          {"resolve": "return self.tokens[(-input_ids - 1).clamp(min=0)]"}),
    Wrong(2, "resolve-in-place", "overwrites the placeholders in the input tensor and returns it",
          "resolve must not modify its input", {"resolve": """
is_future = input_ids < 0
input_ids[is_future] = self.tokens[-input_ids[is_future] - 1]
return input_ids
"""}),
    Wrong(2, "host-loop", "resolves with a Python loop over .tolist() values", "stay on the device", {"resolve": """
ids = [int(self.tokens[-t - 1]) if t < 0 else t for t in input_ids.tolist()]
return torch.tensor(ids, dtype=torch.int64, device=input_ids.device)
"""}),
]
WRONG += [
    # ---------------------------------------------------------------- exercise 3: batch snapshot
    Wrong(3, "return-self", "returns the live batch", "not the live batch itself", {"snapshot": "return self"}),
    Wrong(3, "shared-list", "builds a BatchView around the live request list",
          "its own copy of the request list", {"snapshot": """
return BatchView(self.batch_id, False, self.reqs, self.rows, self.generations, self.samples, self.qo_lens)
"""}),
    Wrong(3, "copied-requests", "copies the requests as well", "the very same Req objects", {"snapshot": """
import copy
reqs = [copy.copy(req) for req in self.reqs]
return BatchView(self.batch_id, False, reqs, self.rows, self.generations, self.samples, self.qo_lens)
"""}),
    Wrong(3, "wrong-batch-id", "gives the snapshot the next batch id", "must be the value at launch", {"snapshot": """
return BatchView(self.batch_id + 1, False, list(self.reqs), self.rows, self.generations, self.samples,
                 self.qo_lens)
"""}),
    Wrong(3, "shared-list-for-one", "copies the request list, except for a batch of one request (nothing to "
          "reorder)", "one request included", {"snapshot": """
reqs = self.reqs if len(self.reqs) <= 1 else list(self.reqs)
return BatchView(self.batch_id, False, reqs, self.rows, self.generations, self.samples, self.qo_lens)
"""}),
]
WRONG += [
    # ---------------------------------------------------------------- exercise 4: overshoot
    Wrong(4, "lookahead-by-committed-length", "looks ahead by committed outputs instead of launched samples",
          "LAUNCHED samples already reach max_new_tokens", {"length lookahead": """
if self.on("length_lookahead"):
    self.running.reqs[:] = [r for r in self.running.reqs if len(r.output_ids) < r.max_new_tokens]
"""}),
    Wrong(4, "no-lookahead", "plans every running request, finished by length or not",
          "must be left out of the next decode batch", {"length lookahead": "pass"}),
    Wrong(4, "lookahead-ignores-switch", "looks ahead even with length_lookahead off",
          "with length_lookahead off every capped request", {"length lookahead": """
self.running.reqs[:] = [r for r in self.running.reqs if not r.will_finish_by_length()]
"""}),
    Wrong(4, "skip-without-counting", "drops the late result but does not count it",
          "count each dropped late result", {"skip_finished": """
if req.finished and self.on("skip_finished"):
    continue
"""}),
    Wrong(4, "no-skip", "commits late results of finished requests", "is not an output: skip it",
          {"skip_finished": "pass"}),
    Wrong(4, "skip-ignores-switch", "skips late results even with skip_finished off", "with skip_finished off",
          {"skip_finished": """
if req.finished:
    self.stats.overshoot_tokens += qo_len
    continue
"""}),
    Wrong(4, "release-committed-only", "frees the tail only up to the KV-committed length",
          "release by allocated length", {"release by allocated length": """
self.kv_pool.free(req.slot_ids[written:req.kv_committed_len])
"""}),
    Wrong(4, "release-ignores-switch", "frees up to the allocated length even with release_allocated off",
          "with release_allocated off", {"release by allocated length": """
self.kv_pool.free(req.slot_ids[written:req.allocated_len])
"""}),
    # From a student trial (2026-12-04): right wherever a request allocates only what it launches.
    Wrong(4, "release-launched", "frees the tail up to the launched length: a verify step allocates more",
          "release by allocated length", {"release by allocated length": """
end = req.launched_len if self.on("release_allocated") else written
self.kv_pool.free(req.slot_ids[written:end])
"""}),
    Wrong(4, "lookahead-removes-while-iterating", "removes from the running list while looping over it, which "
          "skips the request after each one removed", "must be left out of the next decode batch",
          {"length lookahead": """
if self.on("length_lookahead"):
    for req in self.running.reqs:
        if req.will_finish_by_length():
            self.running.reqs.remove(req)
"""}),
]
CHECKPOINT = """
written = {written}
slots = req.slot_ids[:written]
present = self.cache.insert(req.committed_ids()[:written], torch.tensor(slots, dtype=torch.int64))
{free_copies}
{unlock}
"""


def checkpoint(written: str = "min(req.kv_committed_len, req.committed_len)",
               free_copies: str = "self.kv_pool.free(slots[req.cached_len:present])",
               unlock: str = "self.cache.unlock(req.prefix_node)") -> str:
    return CHECKPOINT.format(written=written, free_copies=free_copies, unlock=unlock)


WRONG += [
    # ---------------------------------------------------------------- exercise 5: checkpoint at the commit
    Wrong(5, "not-reported", "releases the finished request but never reports it", "must be reported",
          {"the commit point": """
if req.finished and (finished_before or not req.released):
    self._release(req)
"""}),
    Wrong(5, "checkpoint-committed-len", "checkpoints every committed position, including the last token's",
          "checkpoint only the positions whose KV committed batches wrote",
          {"checkpoint": checkpoint(written="req.committed_len")}),
    Wrong(5, "no-unlock", "never unlocks the prefix locked at admission", "unlock the prefix node",
          {"checkpoint": checkpoint(unlock="")}),
    Wrong(5, "copies-not-freed", "does not free its copies of positions the tree already held",
          "free your own copies", {"checkpoint": checkpoint(free_copies="")}),
    Wrong(5, "release-every-finish", "releases at every finish, even a request released already",
          "only if it was not released already", {"the commit point": """
if req.finished:
    self._release(req)
    self.finished.append(req)
"""}),
    Wrong(5, "second-finish-silent", "skips the release on a second finish, hiding the double free",
          "must still call _release", {"the commit point": """
if req.finished and not finished_before:
    if not req.released:
        self._release(req)
    self.finished.append(req)
"""}),
]
FREE_ROW = """
if self.on("deferred_row_free") and self.last_launch[row] {cmp} self.done_id{shift}:
    self.deferred_rows.append(row)
else:
    self.req_to_token.free(row)
"""
FREE_DEFERRED = """
still = []
for row in self.deferred_rows:
    if self.last_launch[row] {cmp} self.done_id{shift}:
        still.append(row)
    else:
        self.req_to_token.free(row)
self.deferred_rows = still
"""


def rows(cmp: str = ">", shift: str = "") -> dict[str, str]:
    return {"deferred row free": FREE_ROW.format(cmp=cmp, shift=shift),
            "free deferred rows": FREE_DEFERRED.format(cmp=cmp, shift=shift)}


WRONG += [
    # ---------------------------------------------------------------- exercise 6: row reuse
    Wrong(6, "free-at-once", "frees the row at once, whatever is in flight", "may be reused only after every batch",
          {"deferred row free": "self.req_to_token.free(row)"}),
    Wrong(6, "one-batch-too-early", "frees the row while its last batch is still in flight",
          "may be reused only after every batch", rows(shift=" + 1")),
    Wrong(6, "one-batch-too-late", "keeps the row until one batch after its last one: the next owner waits forever",
          "wait for KV slots or rows", rows(cmp=">=")),
    Wrong(6, "never-drained", "parks rows but never frees the parked ones", "wait for KV slots or rows",
          {"free deferred rows": "pass"}),
    Wrong(6, "drain-all", "frees every parked row at the next commit", "may be reused only after every batch",
          {"free deferred rows": """
for row in self.deferred_rows:
    self.req_to_token.free(row)
self.deferred_rows = []
"""}),
    Wrong(6, "remove-while-iterating", "removes freed rows from the list it is looping over, skipping the next one",
          "also when several rows become free at the same commit", {"free deferred rows": """
for row in self.deferred_rows:
    if self.last_launch[row] <= self.done_id:
        self.deferred_rows.remove(row)
        self.req_to_token.free(row)
"""}),
    Wrong(6, "ignores-switch", "defers even with deferred_row_free off", "keep the switch", {"deferred row free": """
if self.last_launch[row] > self.done_id:
    self.deferred_rows.append(row)
else:
    self.req_to_token.free(row)
"""}),
]
WRONG += [
    # ---------------------------------------------------------------- exercise 7: staging write-after-read
    Wrong(7, "waits-only-for-a-gate", "waits only for an event that can be completed by hand (a test's, it "
          "guesses), never for a real one", "must wait for THAT buffer's consumed event", {
              "staging write-after-read wait": """
if buf.consumed is not None and not buf.consumed.query():
    if self.war_wait and hasattr(buf.consumed, "complete"):
        self.waits += 1
        buf.consumed.synchronize()
    elif not self.war_wait:
        self.unread_overwrites += 1
"""}),
    Wrong(7, "no-wait", "counts the wait but never waits", "must wait for THAT buffer's consumed event",
          {"staging write-after-read wait": """
if buf.consumed is not None and not buf.consumed.query():
    if self.war_wait:
        self.waits += 1
    else:
        self.unread_overwrites += 1
"""}),
    Wrong(7, "inverted-query", "waits only when the device has already read the buffer",
          "must wait for THAT buffer's consumed event", {"staging write-after-read wait": """
if buf.consumed is not None and buf.consumed.query():
    if self.war_wait:
        self.waits += 1
        buf.consumed.synchronize()
    else:
        self.unread_overwrites += 1
"""}),
    Wrong(7, "waits-for-the-other-buffer", "waits for the other buffer's read instead of this one's",
          "must wait for THAT buffer's consumed event", {"staging write-after-read wait": """
other = self.buffers[self._next]
if other.consumed is not None and not other.consumed.query():
    if self.war_wait:
        self.waits += 1
        other.consumed.synchronize()
    else:
        self.unread_overwrites += 1
"""}),
    Wrong(7, "ignores-switch", "waits even with staging_war_wait off", "keep the switch",
          {"staging write-after-read wait": """
if buf.consumed is not None and not buf.consumed.query():
    self.waits += 1
    buf.consumed.synchronize()
"""}),
]
WRONG += [
    # ---------------------------------------------------------------- exercise 8: the stream handoff
    Wrong(8, "no-stream-wait", "queues the forward without waiting for the scheduler stream",
          "must wait for the scheduler stream", {"the engine stream waits for the scheduler stream": "pass"}),
    Wrong(8, "reversed-stream-wait", "makes the scheduler stream wait for the engine stream instead",
          "must wait for the scheduler stream",
          {"the engine stream waits for the scheduler stream": "after.wait_stream(self.stream)"}),
    Wrong(8, "host-waits-for-scheduler-stream", "blocks the host until the scheduler stream is done",
          "launch() blocked the host", {"the engine stream waits for the scheduler stream": "after.synchronize()"}),
    Wrong(8, "no-copy-done-wait", "reads the tokens without waiting for copy_done",
          "before its copy_done event passed", {"the host waits for copy_done": "pass"}),
    Wrong(8, "query-instead-of-wait", "asks copy_done whether it passed, and reads anyway",
          "before its copy_done event passed", {"the host waits for copy_done": "result.copy_done.query()"}),
    Wrong(8, "scheduler-stream-waits-for-copy-done", "queues the copy_done wait on the scheduler stream, not the host",
          "before its copy_done event passed",
          {"the host waits for copy_done": "self.stream.wait_event(result.copy_done)"}),
    Wrong(8, "waits-for-the-whole-stream", "waits for the whole engine stream instead of copy_done",
          "not for the whole engine stream", {"the host waits for copy_done": "self.engine.stream.synchronize()"}),
]

# ---------------------------------------------------------------- a fresh pass (issue 23): written before reading
# the tests, each confirmed a real bug (wrong tokens, a leak, or garbage committed) before the test that names it
WRONG += [
    Wrong(2, "resolve-without-clamp", "computes the rows of every id, real ones included, and indexes the mailbox "
          "with them", "real ids must not index it", {"resolve": """
is_future = input_ids < 0
return torch.where(is_future, self.tokens[-input_ids - 1], input_ids)
"""}),
    Wrong(1, "early-commit-keeps-last", "commits the batch in flight early but keeps it as `last`, so it is "
          "committed again at the end", "each batch is committed exactly once", {"overlap_loop": overlap_loop(
              before_launch="""
if self._must_commit_first(last, planned):
    self.commit(last, early=True)
""")}),
    Wrong(1, "first-question-after-schedule", "asks the before-planning question (planned=None) after schedule() "
          "instead of before it", "committed BEFORE schedule() plans batch n", {"overlap_loop": """
planned = self.schedule()
if self._must_commit_first(last, planned=None):
    self.commit(last, early=True)
    last = None
if self._must_commit_first(last, planned):
    self.commit(last, early=True)
    last = None
inflight = None
if planned is not None:
    result = self.launch(planned)
    inflight = InFlight(planned.view.snapshot() if self.on("batch_snapshot") else planned.view, result)
if last is not None:
    self.commit(last)
return inflight
"""}),
    Wrong(2, "where-swapped", "gives torch.where its two choices the wrong way round", "came back as they were",
          {"resolve": """
is_future = input_ids < 0
rows = (-input_ids - 1).clamp(min=0)
return torch.where(is_future, input_ids, self.tokens[rows])
"""}),
    Wrong(3, "shallow-copy-of-the-batch", "returns copy.copy of the running batch", "a copy of the RunningBatch",
          {"snapshot": """
import copy
return copy.copy(self)
"""}),
    Wrong(3, "rows-and-generations-swapped", "passes generations where BatchView takes rows, and rows where it takes "
          "generations", "wrong fields in the snapshot: rows, generations", {"snapshot": """
return BatchView(self.batch_id, False, list(self.reqs), self.generations, self.rows, self.samples, self.qo_lens)
"""}),
    Wrong(4, "lookahead-by-committed-plus-one", "leaves out a request once its committed outputs plus one reach "
          "max_new_tokens, before its last token was launched", "only the requests whose LAUNCHED samples",
          {"length lookahead": """
if self.on("length_lookahead"):
    self.running.reqs[:] = [r for r in self.running.reqs if len(r.output_ids) + 1 < r.max_new_tokens]
"""}),
    Wrong(4, "skip-counts-one", "counts a dropped late result once, whatever its number of positions",
          "count each dropped late result by its positions", {"skip_finished": """
if req.finished and self.on("skip_finished"):
    self.stats.overshoot_tokens += 1
    continue
"""}),
    Wrong(5, "report-only-if-released-here", "reports a finished request only when this commit releases it",
          "must be reported", {"the commit point": """
if req.finished and (finished_before or not req.released):
    self._release(req)
    self.finished.append(req)
"""}),
    Wrong(5, "free-copies-from-zero", "frees every slot up to what the tree held, the borrowed prefix included",
          "and only those", {"checkpoint": checkpoint(free_copies="self.kv_pool.free(slots[:present])")}),
    Wrong(7, "counts-both", "counts every unread buffer as an overwrite, also when it then waits",
          "count a wait in `waits` only", {"staging write-after-read wait": """
if buf.consumed is not None and not buf.consumed.query():
    self.unread_overwrites += 1
    if self.war_wait:
        self.waits += 1
        buf.consumed.synchronize()
"""}),
    Wrong(6, "frees-one-parked-row-per-commit", "frees at most the first parked row at each commit",
          "also when several rows become free at the same commit", {"free deferred rows": """
if self.deferred_rows and self.last_launch[self.deferred_rows[0]] <= self.done_id:
    self.req_to_token.free(self.deferred_rows.pop(0))
"""}),
    Wrong(6, "switch-inverted", "parks the row only when deferred_row_free is OFF", "may be reused only after every batch",
          {"deferred row free": """
if not self.on("deferred_row_free") and self.last_launch[row] > self.done_id:
    self.deferred_rows.append(row)
else:
    self.req_to_token.free(row)
"""}),
    Wrong(7, "always-waits-and-counts", "waits for the buffer's event (and counts it) whether the device has read "
          "the buffer or not", "wait only while the buffer's consumed event has not passed",
          {"staging write-after-read wait": """
if buf.consumed is not None:
    if self.war_wait:
        self.waits += 1
        buf.consumed.synchronize()
    elif not buf.consumed.query():
        self.unread_overwrites += 1
"""}),
    Wrong(8, "engine-stream-synchronize", "makes the host wait for the engine stream in launch(), instead of the "
          "engine stream waiting for the scheduler stream", "must wait for the scheduler stream",
          {"the engine stream waits for the scheduler stream": "self.stream.synchronize()"}),
    Wrong(8, "poll-copy-done", "polls copy_done.query() until it passes instead of waiting on it: a failure "
          "of the device's work is never raised", "where a failure of the device's work reaches the host",
          {"the host waits for copy_done": """
while not result.copy_done.query():
    time.sleep(0.0005)
"""}),
]

SKIP_RETRACTED = """
if {condition} and self.on("retract_skip_inflight"):
    {count}
    continue
"""


def skip_retracted(condition: str = "(req.row, req.row_generation) != (row, generation)",
                   count: str = "self.stats.retracted_late_results += 1") -> dict[str, str]:
    return {"skip a retracted request's in-flight result": SKIP_RETRACTED.format(condition=condition, count=count)}


WRONG += [
    Wrong(9, "no-skip", "commits the retracted request's late token like any other", "is no output",
          {"skip a retracted request's in-flight result": "pass"}),
    Wrong(9, "prefill-results-only", "skips late results of retracted requests only in prefill batches",
          "is no output", skip_retracted("view.is_prefill and (req.row, req.row_generation) != (row, generation)")),
    Wrong(9, "skips-every-released", "skips every released request's result, a finished one's overshoot too",
          "skip only the results of requests retracted", skip_retracted("req.released")),
    Wrong(9, "uncounted", "skips the late result but does not count it", "count each one",
          skip_retracted(count="pass")),
    Wrong(9, "ignores-switch", "skips even with retract_skip_inflight off", "keep the switch",
          {"skip a retracted request's in-flight result": """
if (req.row, req.row_generation) != (row, generation):
    self.stats.retracted_late_results += 1
    continue
"""}),
]

DELAYED_SAMPLE = """
result = inflight.result
{check}
with sched.tracer.host(SpanName.SAMPLE, result.batch_id):
    reqs = {reqs}
    launch_sample(sched.engine, result, {mask})
sched.stats.delayed_samples += 1
"""
COMMITTED = 'assert sched.rows.done_id == result.batch_id - 1, "sampling before the previous commit"'
MASK_NOW = "build_mask([r.params.grammar for r in reqs], [r.grammar_state for r in reqs])"
DELAY_AT_PLANNING = """
delay_sample = self.on("grammar_delayed_sample")
if not delay_sample:
    mask = build_mask([p.grammar for p in params], [r.grammar_state for r in reqs])
"""


def delayed_sample(check: str = COMMITTED, reqs: str = "inflight.view.reqs", mask: str = MASK_NOW,
                   at_planning: str | None = None) -> dict[str, str]:
    regions = {"launch the delayed sampling": DELAYED_SAMPLE.format(check=check, reqs=reqs, mask=mask)}
    return regions if at_planning is None else {**regions, "delay the sampling": at_planning}


WRONG += [
    # ---------------------------------------------------------------- exercise 10: delayed sampling
    Wrong(10, "masks-built-at-planning", "builds every grammar batch's masks at planning and samples them late",
          "one token behind", delayed_sample(mask="result.delayed.batch.mask", at_planning="""
delay_sample = self.on("grammar_delayed_sample")
mask = build_mask([p.grammar for p in params], [r.grammar_state for r in reqs])
""")),
    Wrong(10, "grammar-rows-only", "builds mask entries only for the requests that have a grammar",
          "one entry per row of the batch", delayed_sample(reqs="[r for r in inflight.view.reqs if r.params.grammar]")),
    Wrong(10, "every-request-has-a-grammar", "asks every request's grammar for its allowed tokens, also a "
          "request without one", "without a grammar is unconstrained", delayed_sample(
              check=COMMITTED + "\nfrom .grammar import TokenMask",
              mask="TokenMask(tuple(r.params.grammar.allowed(r.grammar_state) for r in reqs))")),
    Wrong(10, "uncounted", "launches the delayed sampling but does not count it", "count each delayed sampling",
          {"launch the delayed sampling": DELAYED_SAMPLE.format(check=COMMITTED, reqs="inflight.view.reqs",
                                                                mask=MASK_NOW).replace(
              "sched.stats.delayed_samples += 1", "")}),
    Wrong(10, "no-host-span", "builds the masks and launches the sampling outside the tracer's host span",
          "the timeline must show", {"launch the delayed sampling": f"""
result = inflight.result
{COMMITTED}
reqs = inflight.view.reqs
launch_sample(sched.engine, result, {MASK_NOW})
sched.stats.delayed_samples += 1
"""}),
    Wrong(10, "no-commit-check", "samples without checking that the previous batch is committed",
          "refuse to sample a batch before every earlier batch is committed", delayed_sample(check="")),
    Wrong(10, "ignores-switch", "delays the sampling even with grammar_delayed_sample off", "keep the switch",
          {"delay the sampling": "delay_sample = True"}),
    Wrong(10, "masks-in-row-order", "builds the masks of the batch's requests sorted by row", "in the batch's order",
          delayed_sample(reqs="sorted(inflight.view.reqs, key=lambda r: r.row)")),
    Wrong(10, "counts-constraining-only", "counts a delayed sampling only when its masks constrain something",
          "also one whose masks constrain nothing", {"launch the delayed sampling": f"""
result = inflight.result
{COMMITTED}
with sched.tracer.host(SpanName.SAMPLE, result.batch_id):
    reqs = inflight.view.reqs
    mask = {MASK_NOW}
    launch_sample(sched.engine, result, mask)
if mask.constrains:
    sched.stats.delayed_samples += 1
"""}),
    Wrong(10, "no-mask-when-off", "with the switch off, builds no mask at all", "keep the switch",
          {"delay the sampling": 'delay_sample = self.on("grammar_delayed_sample")'}),
]

WRONG += [
    # ---------------------------------------------------------------- classes a student found passing (a round of 83)
    Wrong(1, "snapshot-always", "freezes the view of the batch in flight even with batch_snapshot off",
          "keep the switch", {"overlap_loop": overlap_loop(view="planned.view.snapshot()")}),
    Wrong(6, "park-every-row", "parks every released row, in flight or not: with no later commit it is never freed",
          "must be freed at once", {"deferred row free": """
if self.on("deferred_row_free"):
    self.deferred_rows.append(row)
else:
    self.req_to_token.free(row)
"""}),
    Wrong(6, "park-behind-parked", "parks a row no batch in flight uses while other rows are parked (to keep "
          "the order): it is freed one commit late", "also while other rows are parked", {"deferred row free": """
if self.on("deferred_row_free") and (self.in_flight(row) or self.deferred_rows):
    self.deferred_rows.append(row)
else:
    self.req_to_token.free(row)
"""}),
    Wrong(8, "wait-only-if-not-passed", "waits for copy_done only when query() says it has not passed yet: a failed "
          "batch that is over by its commit is read as if it had worked", "where a failure of the device's work",
          {"the host waits for copy_done": """
if not result.copy_done.query():
    result.copy_done.synchronize()
"""}),
    Wrong(9, "skip-counts-the-sample", "takes the skipped result off the request's samples in flight, which the "
          "retraction had already reset", "leave the retracted request untouched",
          {"skip a retracted request's in-flight result": """
if (req.row, req.row_generation) != (row, generation) and self.on("retract_skip_inflight"):
    req.inflight_samples -= 1
    self.stats.retracted_late_results += 1
    continue
"""}),
    Wrong(8, "wait-only-with-pinned-copy", "waits for copy_done only with pinned_copy on (off, a GPU's copy blocks "
          "in launch(), but not every device's)", "whatever the switches", {"the host waits for copy_done": """
if self.on("pinned_copy"):
    result.copy_done.synchronize()
"""}),
    Wrong(8, "no-wait-on-early-commit", "waits for copy_done except at an early commit (a sync boundary), where "
          "the batch is thought to be over already: a failed batch committed early is read as if it had worked",
          "where a failure of the device's work",
          {"the host waits for copy_done": """
if not early:
    result.copy_done.synchronize()
"""}),
    Wrong(9, "generation-only", "compares the request's generation with the batch's, not its row: generations "
          "count per row, so a request admitted again into another row may carry the generation it launched with",
          "not the generation alone",
          {"skip a retracted request's in-flight result": """
if req.row_generation != generation and self.on("retract_skip_inflight"):
    self.stats.retracted_late_results += 1
    continue
"""}),
    Wrong(10, "check-after-launch", "refuses to go on only after it has launched the sampling: the sampling of a "
          "batch whose predecessor is still in flight is out already, from states one token behind",
          "refuse before launching the sampling", {"launch the delayed sampling": """
result = inflight.result
with sched.tracer.host(SpanName.SAMPLE, result.batch_id):
    reqs = inflight.view.reqs
    launch_sample(sched.engine, result, build_mask([r.params.grammar for r in reqs], [r.grammar_state for r in reqs]))
assert sched.rows.done_id == result.batch_id - 1, "sampling before the previous commit"
sched.stats.delayed_samples += 1
"""}),
    Wrong(9, "table-generation", "tests the row table's current generation instead of the request's own: with "
          "deferred_row_free off a finished request's row goes to the next request while its overshoot step is in "
          "flight, and that late result is counted as a retraction that never happened",
          "not the row table's generation",
          {"skip a retracted request's in-flight result": """
if (req.row != row or self.req_to_token.generation[row] != generation) and self.on("retract_skip_inflight"):
    self.stats.retracted_late_results += 1
    continue
"""}),
    Wrong(10, "live-running-batch", "builds the masks from the live running batch instead of the batch's own "
          "requests: by the delayed sampling the running batch has moved on (filtered, merged)",
          "not the live running batch", delayed_sample(reqs="sched.running.reqs")),
    Wrong(10, "masks-without-finished-rows", "builds the delayed masks without the rows whose request finished "
          "while the batch was in flight", "also for a request that finished",
          delayed_sample(reqs="[r for r in inflight.view.reqs if not r.finished]")),
]

ACCEPT = "agree = (drafts == target[:, :-1]).long()\nreturn agree.cumprod(1).sum(1) + 1"
RESERVE = """width = self.num_steps + 1
reserve = 2 * width if self.on("spec_alloc_reserve") else width
return {base} + reserve"""
BASE = "max(req.kv_committed_len, req.prefill_len)"
HOST_LENGTHS = """if self.publish_ready is not None and self.mechanisms.on("spec_publish_wait"):
    self.publish_ready.synchronize()
return self.mirror[rows].tolist()"""


def speculation(accept: str = ACCEPT, reserve: str = RESERVE.format(base=BASE),
                wait: str = HOST_LENGTHS) -> dict[str, str]:
    return {"the accept length": accept, "allocate for the most a step can accept": reserve,
            "wait for the publish before reading the mirror": wait}


WRONG += [
    # ---------------------------------------------------------------- exercise 11: speculation under the overlap
    Wrong(11, "counts-every-agreement", "counts every draft the target agrees with, also after a disagreement",
          "up to the first that differs", speculation(accept="return (drafts == target[:, :-1]).long().sum(1) + 1")),
    Wrong(11, "no-bonus", "counts the agreeing drafts but forgets the target's own token after them",
          "plus one for the target's own token",
          speculation(accept="return (drafts == target[:, :-1]).long().cumprod(1).sum(1)")),
    Wrong(11, "shifted-target", "compares each draft with the target's token at its own position, not the one "
          "before", "equal to the target's token before them",
          speculation(accept="return (drafts == target[:, 1:]).long().cumprod(1).sum(1) + 1")),
    Wrong(11, "one-step-reserve", "gives a verify step KV for one step of K+1 only", "two steps of K+1",
          speculation(reserve="return max(req.kv_committed_len, req.prefill_len) + self.num_steps + 1")),
    Wrong(11, "reserve-from-launched", "reserves two steps past the launched length, which already counts the "
          "verify in flight", "the promise covers no more", speculation(reserve=RESERVE.format(
              base="max(req.launched_len, req.prefill_len)"))),
    Wrong(11, "no-publish-wait", "reads the mirror of the lengths without waiting for the publish event",
          "only after the publish event", speculation(wait="return self.mirror[rows].tolist()")),
    Wrong(11, "ignores-wait-switch", "waits for the publish event even with spec_publish_wait off", "keep the switch",
          speculation(wait="""if self.publish_ready is not None:
    self.publish_ready.synchronize()
return self.mirror[rows].tolist()""")),
    Wrong(11, "wait-unless-flag-set", "skips the publish wait when the event's host flag is set already (on CUDA "
          "it is set at launch: the wait never happens there)", "whatever the flag says", speculation(wait="""ready = self.publish_ready
if ready is not None and self.mechanisms.on("spec_publish_wait") and not ready.done.is_set():
    ready.synchronize()
return self.mirror[rows].tolist()""")),
]

MIXED_ROW = """position = {position}
tokens.add(req.row, [{input_id}], position, sched.kv_ledger.allocate(req, 1))
{advance}"""
ADVANCE = "req.launched_len += 1\nreq.inflight_samples += 1"
LAUNCHED = 'req.launched_len if self.on("mixed_prefix_from_launched") else req.committed_len - 1'


def mixed_row(position: str = LAUNCHED, input_id: str = "input_id", advance: str = ADVANCE):
    return {"the decode row": MIXED_ROW.format(position=position, input_id=input_id, advance=advance)}


WRONG += [
    # ---------------------------------------------------------------- exercise 12: mixed chunk
    Wrong(12, "serial-formula", "puts the row at committed length - 1, SGLang's serial formula, in both loops",
          "is a decode row", mixed_row(position="req.committed_len - 1")),
    Wrong(12, "delta-by-loop", "puts the row at committed length - 1 in the normal loop and at the committed length in "
          "the overlap loop (one token in flight, SGLang's old delta)", "is a decode row", mixed_row(
              position='req.committed_len - (0 if sched.config.loop == "overlap" else 1) if self.on('
                       '"mixed_prefix_from_launched") else req.committed_len - 1')),
    Wrong(12, "committed-length", "puts the row at the committed length", "is a decode row",
          mixed_row(position="req.committed_len")),
    Wrong(12, "committed-input", "feeds the last committed token instead of the FutureMap's", "is a decode row",
          mixed_row(input_id="req.token_at(req.committed_len - 1)")),
    Wrong(12, "no-sample-count", "does not count the row's sample as in flight", "is a decode row",
          mixed_row(advance="req.launched_len += 1")),
    Wrong(12, "no-launched-advance", "does not advance the launched length", "is a decode row",
          mixed_row(advance="req.inflight_samples += 1")),
    Wrong(12, "ignores-switch", "uses the launched length even with mixed_prefix_from_launched off",
          "keep the switch", mixed_row(position="req.launched_len")),
    Wrong(12, "slot-from-the-pool", "takes the row's KV slot from the pool's free list, not through the ledger "
          "(no eviction, the reservation not drawn on)", "comes from the ledger", {"the decode row": """
position = req.launched_len if self.on("mixed_prefix_from_launched") else req.committed_len - 1
slots = sched.kv_ledger.kv_pool.alloc(1)
req.slot_ids += slots
tokens.add(req.row, [input_id], position, slots)
req.launched_len += 1
req.inflight_samples += 1
"""}),
]
