"""The exercises: what each one removes, which lesson it follows, its tests and its hints.

Hints come in three levels, so that a stuck learner can ask for as little as they need:
1. a question that points at the concept and at the reading (`lessons/readings/README.md`);
2. the idea of the solution, in words;
3. the solution's shape, close to code.

The marked regions in `minisgl/` name the part only (`# >>> exercise N: <name>`); the
hints live here, so that reading the skeleton does not give the answer away.
Each exercise's stubs (what the student edition puts in its regions) are here too, and stub_note
(at the end), which tells a lesson whether a region still holds its stub.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from minisgl.course import ROOT
from minisgl.course.markers import written_regions


@dataclass(frozen=True)
class Exercise:
    number: int
    title: str
    lesson: int
    tests: tuple[str, ...]  # pytest node ids inside the work dir; the teaching test file comes first
    hints: tuple[str, str, str]  # levels 1, 2, 3
    # region name -> the student edition's stub there: a correct but naive version (or, where none
    # can be correct, one that keeps the course running), which the exercise's own check refuses
    stubs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Wrong:
    exercise: int
    name: str
    story: str  # the mistake, in one line
    expect: str  # a phrase the first failure (or the hang report) must contain
    regions: dict[str, str] = field(default_factory=dict)  # region name -> code put there (any indent)


# Each exercise is checked alone: its tests go through another exercise's region only where what is
# there is right, the stub in the student edition (correct, if naive) or the reference (the grader).
# Exercise 3's stub reads a batch's rows at the commit, not at the launch, which is wrong once a
# request is retracted while its batch is in flight: exercise 9's tests, the only ones that do
# that, state the view of that batch themselves.
EXERCISES = {e.number: e for e in (
    Exercise(1, "write overlap_loop from normal_loop (scheduler.py)", 3, (
        "tests/test_ex1_overlap_loop.py",
        "tests/test_overlap.py::test_overlap_pipelines_launches_ahead_of_commits",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-0]",
    ), (
        "normal_loop waits for batch n before it plans n+1. Which of its three calls could wait until "
        "the next iteration, and what must the loop carry across iterations to do that? "
        "(readings §3 and §11: 「关键设计：延迟处理」; lesson 3)",
        "Schedule and launch the new batch first, then commit the batch that was in flight (`last`), "
        "and leave the new in-flight batch (an InFlight of its view and result, or None) in `inflight`: the "
        "code after the region hands it to the next call. "
        "Commit `last` even when nothing new was planned. _must_commit_first is given: ask it before "
        "schedule() (planned=None) and again after it; where it says so, commit `last` at once with "
        "commit(last, early=True), before that point, and it is then no longer in flight. Unlike "
        "normal_loop, the InFlight must hold a frozen copy of the view (planned.view.snapshot(): schedule() "
        "changes the live batch before the commit; lesson 3, and lesson 5 for why), and keep the "
        "batch_snapshot switch: with it off, the live view.",
        "_must_commit_first(last, planned=None); if True, commit(last, early=True) and last = None. Then "
        "schedule(); then the same question with the plan, and the same early commit. If there is a plan, "
        "launch it and keep an InFlight of (its view's snapshot, or the live view when batch_snapshot is "
        "off; the result) in `inflight` (None without a plan). Then the usual commit of last, if any is "
        "left; do not return: the lines after the region return `inflight`.",
    ), {"overlap_loop": """
        # STUB (exercise 1 not written): correct, not precise: never asks the sync boundary after
        # planning, so two prefills in a row overlap as well (prefill_sync's earlier first tokens are lost).
        if last is not None and self._must_commit_first(last, None):
            self.commit(last, True)
            last = None
        planned = self.schedule()
        inflight = None
        if planned is not None:
            view = planned.view.snapshot() if self.on("batch_snapshot") else planned.view
            inflight = InFlight(view, self.launch(planned))
        if last is not None:
            self.commit(last)
    """}),
    Exercise(2, "FutureMap publish and resolve (future_map.py)", 4, (
        "tests/test_ex2_future_map.py",
        "tests/test_overlap.py::test_overlap_equals_normal[0.0-0]",
        "tests/test_mechanisms.py::test_future_map_off_brings_the_bubble_back",
    ), (
        "Batch n+1 needs batch n's sampled tokens as input ids, but the host has not seen them. The "
        "host does know *where* each token will be. What is stable for a request's whole life, and "
        "what changes every step? (readings §6; lesson 4)",
        "publish: write each sampled token into the slot of `tokens` named by its request-pool row. "
        "resolve: a negative id -(row+1) names a row: replace it by that row's token; keep real ids "
        "(>= 0). Both run on the device, as tensor operations: no Python loop over values, no .item() "
        "or .tolist() (that would make the host wait), and resolve must not modify its input.",
        "publish: one indexed assignment into self.tokens, the rows as the index. resolve: a boolean mask of "
        "the negative ids; the rows they name, -id - 1, clamped at 0 so that real ids index safely too; then "
        "torch.where picks, position by position, the mailbox token or the id itself.",
    ), {"publish": """
        # STUB (exercise 2 not written): correct, not precise: a round trip through the host, one
        # row at a time (.tolist() makes the host wait for the device).
        for row, token in zip(rows.tolist(), next_tokens.tolist()):
            self.tokens[row] = token
    """, "resolve": """
        # STUB (exercise 2 not written): correct, not precise: on the host, one id at a time.
        mailbox = self.tokens.tolist()
        ids = [mailbox[-i - 1] if i < 0 else i for i in input_ids.tolist()]
        return torch.tensor(ids, dtype=torch.int64, device=input_ids.device)
    """}),
    Exercise(3, "snapshot the running batch for the result queue (batch.py)", 5, (
        "tests/test_ex3_snapshot.py",
        "tests/test_mechanisms.py::test_batch_snapshot_off_results_land_on_wrong_requests",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-1]",
    ), (
        "Between the launch of batch n and its commit, the next schedule() filters and merges the "
        "running batch in place. Which fields does the commit read, and which of them can change "
        "in between? (readings §5: batch.copy(); lesson 5)",
        "Return a BatchView that freezes what the commit reads: the batch id, is_prefill False, a new "
        "list holding the same Req objects (not copies of them: the commit writes into them), and the "
        "per-row lists rows, generations, samples and qo_lens as they are now.",
        "One BatchView(...) call: the batch id, False, a fresh list() around the request list, and the "
        "properties rows, generations, samples and qo_lens (each already builds a new list).",
    ), {"snapshot": """
        # STUB (exercise 3 not written): no correct naive snapshot exists; this copy of the live batch
        # keeps the course running. Its rows are read at the commit, not frozen at launch: a request
        # retracted meanwhile (lesson 10) is then caught by the row generation check instead.
        frozen = RunningBatch()
        frozen.batch_id = self.batch_id
        frozen.reqs = [r for r in self.reqs]
        return frozen
    """}),
    Exercise(4, "overshoot: skip late results, look ahead by length, release by allocated length "
                "(scheduler.py, kv_ledger.py)", 6, (
        "tests/test_ex4_overshoot.py",
        "tests/test_mechanisms.py::test_length_lookahead_off_wastes_overshoot_steps",
        "tests/test_mechanisms.py::test_skip_finished_off_leaks_token_after_stop_and_double_frees",
        "tests/test_mechanisms.py::test_release_allocated_off_leaks_kv_slots",
        "tests/test_abort.py::test_abort_while_final_token_in_flight",
    ), (
        "The overlap loop always plans one step past a request's end. Which ends can the host "
        "foresee, what must happen to the result of the extra step, and which KV slot did it "
        "take? (readings §8: the three conditions; lesson 6)",
        "Lookahead: leave out of the decode batch every request whose *launched* samples already "
        "reach max_new_tokens (Req.will_finish_by_length). Skip: at commit, a result for a request "
        "that already finished is not an output: count its positions in stats.overshoot_tokens and "
        "move on. Release: free the private tail from the KV-committed length up to the allocated "
        "length, which covers the overshoot slot. Each only while its switch is on.",
        "Lookahead: while the switch is on, rebuild running.reqs in place (slice assignment) keeping the "
        "requests for which Req.will_finish_by_length() is false. Skip: inside the commit loop, for a request "
        "already finished and with skip_finished on, add qo_len to the overshoot_tokens statistic and go to "
        "the next request. Release: the end of the freed tail is allocated_len with the switch on, else the "
        "written length; free the request's slot ids between the written length and that end.",
    ), {"length lookahead": """
        # STUB (exercise 4 not written): looks ahead whatever the length_lookahead switch says.
        for req in [r for r in self.running.reqs if r.will_finish_by_length()]:
            self.running.reqs.remove(req)
    """, "skip_finished": """
        # STUB (exercise 4 not written): drops a late result, but counts it once, not per position.
        if self.on("skip_finished") and req.finished:
            self.stats.overshoot_tokens = self.stats.overshoot_tokens + 1
            continue
    """, "release by allocated length": """
        # STUB (exercise 4 not written): frees the whole tail, whatever the release_allocated switch says.
        self.kv_pool.free(req.slot_ids[written:])
    """}),
    Exercise(5, "the radix-cache checkpoint at the safe point: the commit (scheduler.py, kv_ledger.py)", 7, (
        "tests/test_ex5_checkpoint.py",
        "tests/test_engine.py::test_radix_cache_hits_give_same_tokens[overlap]",
        "tests/test_engine.py::test_prompt_sharing_prefix_reads_cached_kv",
        "tests/test_abort.py::test_abort_while_decoding[overlap]",
    ), (
        "When is a finished request's KV really written, and when may another request read it "
        "through the prefix cache? Which positions did committed batches write? (readings §9: the "
        "safe order; §7; lesson 7)",
        "At the commit, a request that commit_token() finished is released once (a second finish "
        "must still reach _release, which reports the double free) and reported as finished. "
        "_release hands to the cache only the positions committed batches wrote "
        "(min(kv_committed_len, committed_len)), frees its own copies of positions the tree already "
        "had, and unlocks the prefix it locked at admission.",
        "At the commit point: for a finished request, release it when it finished before (so that _release "
        "reports the double free) or is not released yet, then append it to the finished list. In _release "
        "define `written` (the code below the region uses it): the smaller of the KV-committed and committed "
        "lengths. Insert that many committed ids with their slot ids (an int64 tensor) into the cache; insert "
        "returns how many leading positions the tree already held: free your slots from cached_len up to "
        "that count; unlock the prefix node locked at admission.",
    ), {"checkpoint": """
        # STUB (exercise 5 not written): correct, not precise: nothing is handed to the radix cache;
        # every slot of the request's own is freed, so no later request reuses its prefix.
        written = min(req.committed_len, req.kv_committed_len)
        self.kv_pool.free(req.slot_ids[req.cached_len:written])
        node = req.prefix_node
        self.cache.unlock(node)
    """, "the commit point": """
        # STUB (exercise 5 not written): releases at every finish, unless the request was released at
        # planning (commit_point_cache off); a second finish then goes unreported.
        if req.finished:
            if self.on("commit_point_cache") or not req.released:
                self._release(req)
            self.finished.append(req)
    """}),
    Exercise(6, "reuse a request row only after its last in-flight batch (rows.py, 2 places)", 7, (
        "tests/test_ex6_rows.py",
        "tests/test_abort.py::test_abort_while_final_token_in_flight",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-1]",
    ), (
        "A request finished at the commit of batch n, but its overshoot step n+1 is still in flight "
        "and writes into its request-table row. When may a new request own that row? "
        "(readings §9: row reuse and ABA; lesson 7)",
        "When a row is released, free it at once only if every batch that used it has passed "
        "copy_done (the scheduler records the last batch launched per row and the last batch "
        "committed); otherwise park it. At every commit, free the parked rows whose last batch has "
        "now passed copy_done, and keep the others. With deferred_row_free off, free at once.",
        "RowTracker.free: with the switch on and the row still in flight (in_flight: its last launched batch "
        "id, last_launch, beyond the last batch committed, done_id), park the row in deferred_rows; otherwise "
        "free it in req_to_token. free_deferred: build a new list of the rows still in flight, free every "
        "other one, and store the new list (never remove from the list you are looping over).",
    ), {"deferred row free": """
        # STUB (exercise 6 not written): correct, not precise: parks the row while ANY batch is in
        # flight, whether or not it uses this row.
        if self.on("deferred_row_free") and max(self.last_launch) > self.done_id:
            self.deferred_rows += [row]
        else:
            self.req_to_token.free(row)
    """, "free deferred rows": """
        # STUB (exercise 6 not written): frees the parked rows all together, once the last batch of
        # every one of them has passed, not each row at the first commit after its own last batch.
        if all(self.last_launch[parked] <= self.done_id for parked in self.deferred_rows):
            for parked in self.deferred_rows:
                self.req_to_token.free(parked)
            self.deferred_rows = []
    """}),
    Exercise(7, "the staging buffers' write-after-read wait (staging.py)", 7, (
        "tests/test_ex7_staging.py",
        "tests/test_mechanisms.py::test_staging_both_protections_off_gives_wrong_tokens[5.0]",
        "tests/test_mechanisms.py::test_staging_two_buffers_without_the_wait_hold_while_n_commits_before_n_plus_2[5.0]",
    ), (
        "The host writes batch n+1's metadata into a host buffer that the device copies when it "
        "reaches the batch. What may the device still have to read when the host wants to rewrite "
        "a buffer, and who has to wait for whom? (readings §4: the write-after-read barrier, and why "
        "minisgl's wait is on the host; lesson 7)",
        "Before handing out a buffer, check its `consumed` event (recorded on the engine stream "
        "right after the device copied the buffer). If the device has not passed it yet, the host "
        "must wait for it when staging_war_wait is on, and count the wait in `waits`; when the "
        "switch is off, do not wait, and count the hazard in `unread_overwrites`. Wait for *this* "
        "buffer's event only, never for the whole stream.",
        "Only when the buffer has a consumed event that query() says has not passed: with war_wait on, count "
        "one in waits and block on that event (its synchronize); with it off, count one in unread_overwrites "
        "and go on.",
    ), {"staging write-after-read wait": """
        # STUB (exercise 7 not written): correct, not precise: waits for the buffer's read (and counts
        # a wait) at every acquire, also when the device has long passed it.
        event = buf.consumed
        if event is not None and self.war_wait:
            self.waits = self.waits + 1
            event.synchronize()
        elif event is not None and not event.query():
            self.unread_overwrites = self.unread_overwrites + 1
    """}),
    Exercise(8, "the handoff between the streams: the engine waits for the scheduler stream, the host "
                "waits for copy_done (engine.py, scheduler.py)", 3, (  # taught in lesson 2, checked in lesson 3's loop
        "tests/test_ex8_handoff.py",
        "tests/test_overlap.py::test_overlap_pipelines_launches_ahead_of_commits",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-0]",
    ), (
        "Two streams and a host run at once. What has the scheduler's stream queued that a forward "
        "reads, and what has the engine stream queued that the host reads? For each, who must wait, "
        "and must that wait block the host? (readings §12: the two sync points; §3; lesson 2)",
        "In Engine.launch, before queueing anything else, make the engine stream wait for the "
        "scheduler's stream (`after`): a device-side wait, so launch() still returns at once. In "
        "Scheduler.commit, before the tokens are read, the host waits for that batch's copy_done "
        "event: only that event, not the whole engine stream, or the host would also wait for the "
        "batch launched after it.",
        "Engine.launch: the engine stream's wait_stream, given `after` (a device-side wait). Scheduler.commit: "
        "the synchronize of the batch result's copy_done event (the host waits for that event only).",
    ), {"the engine stream waits for the scheduler stream": """
        # STUB (exercise 8 not written): correct, not precise: the HOST waits for the scheduler stream.
        after.synchronize()
    """, "the host waits for copy_done": """
            # STUB (exercise 8 not written): correct, not precise: waits for the whole engine stream.
            self.engine.stream.synchronize()
    """}),
    Exercise(9, "skip the in-flight result of a retracted request (scheduler.py)", 10, (
        "tests/test_ex9_retraction.py",
    ), (
        "With admission='optimistic', schedule() may retract a request while its last decode step is "
        "still in flight. The request waits to be re-prefilled from its committed tokens. When that "
        "step's result reaches the commit, whose token is it, and which step will sample it again? "
        "(readings §15: is_retracted; lesson 10)",
        "Retraction gives the request's row back and marks the request as owning no row "
        "(Req.reset_for_retract). The batch view remembers the row and its generation at launch: when "
        "they are no longer the request's own, the request was retracted after this batch launched. "
        "Skip that row's result entirely (no KV length, no sample count, no token) and count it in "
        "stats.retracted_late_results. With retract_skip_inflight off, do not skip.",
        "First thing in the loop over the view's rows: if (req.row, req.row_generation) differs from "
        "(row, generation) and the switch is on, add one to stats.retracted_late_results and continue.",
    ), {"skip a retracted request's in-flight result": """
            # STUB (exercise 9 not written): compares the row only, not its generation.
            if req.row != row and self.on("retract_skip_inflight"):
                self.stats.retracted_late_results = self.stats.retracted_late_results + 1
                continue
    """}),
    Exercise(10, "delayed sampling for constrained decoding: masks from the committed grammar states "
                 "(grammar.py in features/, 2 places)", 11, (
        "tests/test_ex10_delayed_sampling.py",
        "tests/test_grammar_logprobs.py::test_every_output_follows_its_grammar_in_both_loops",
        "tests/test_grammar_logprobs.py::test_grammar_delayed_sample_off_masks_one_token_behind",
        "tests/test_grammar_logprobs.py::test_demo_add_grammar_digits_then_stop",
    ), (
        "A grammar's mask for batch n+1 depends on the token batch n samples, and the overlap loop plans "
        "and launches batch n+1 before it commits batch n. What can still overlap with batch n, what has to "
        "wait for its commit, and how does the host know that commit has happened? (readings §16: "
        "delay_sample_func, launch_batch_sample_if_needed; lesson 11)",
        "At planning, a batch with a grammar only decides whether its sampling waits: it does while "
        "grammar_delayed_sample is on; with the switch off it builds the masks right there, from the "
        "states at planning (right in the normal loop, one token behind in the overlap loop). The "
        "delayed sampling itself runs after the commit of the previous batch: first refuse to go on unless "
        "the last batch that passed copy_done is the one just before this batch; then build the mask from "
        "the batch's own requests, one entry per row and in the batch's order, each from its grammar and "
        "its state now (a request without a grammar has none: its row is unconstrained), and hand it to the "
        "engine with the launched result. Do that host work inside the tracer's SAMPLE span and count it "
        "in stats.delayed_samples.",
        "In DelayedSampling.plan: set delay_sample from the switch; when it is off, set mask to build_mask of the "
        "requests' grammars and their grammar_state. In DelayedSampling.launch: take the result from the InFlight; "
        "assert that rows.done_id equals the result's batch id minus one; inside a host span of the tracer named "
        "SpanName.SAMPLE with that batch id, call launch_sample with the engine, the result and build_mask of "
        "the grammars and states of the view's requests; then add one to the delayed_samples statistic.",
    ), {"delay the sampling": """
        # STUB (exercise 10 not written): every grammar batch waits, whatever the grammar_delayed_sample
        # switch says.
        delay_sample = True
    """, "launch the delayed sampling": """
        # STUB (exercise 10 not written): samples with masks from the states now, but neither checks
        # that the previous batch is committed, nor traces nor counts the sampling.
        batch = inflight.view.reqs
        masks = build_mask([r.params.grammar for r in batch], [r.grammar_state for r in batch])
        launch_sample(sched.engine, inflight.result, masks)
    """}),
    Exercise(11, "speculative decoding under the overlap: the KV reserve, the publish wait and the accept length "
                 "(features/speculative/: __init__.py, relay.py, verify.py)", 12, (
        "tests/test_ex11_speculation.py",
        "tests/test_speculative.py::test_greedy_speculation_gives_the_plain_tokens[ngram-overlap]",
    ), (
        "A verify step keeps between 1 and K+1 tokens, a number that exists only on the device after the verify, "
        "and the overlap loop plans the next verify before that. What may the next step need that the host cannot "
        "know yet, and what may the host read, and when? (readings §18: get_alloc_reserve_per_decode, "
        "resolve_seq_lens_cpu, publish_ready; lesson 12)",
        "The accept length: count the drafts equal to the target's token at the position before them, stopping at "
        "the first that differs, then add the bonus (the target's own token). The reserve: the host's committed "
        "length lags by the verify in flight (up to K+1) and the new verify writes K+1 more: two steps of K+1 past "
        "the larger of the committed and the prefill length (one step with spec_alloc_reserve off). The host "
        "lengths: wait for the newest publish event (if any, and while spec_publish_wait is on), then read the "
        "mirror's rows.",
        "accept_greedy: compare drafts with target[:, :-1], as integers, take the running product along the "
        "drafts, sum each row, add one. _slots_wanted: a step's width is num_steps + 1; the reserve is twice that "
        "with spec_alloc_reserve on, once with it off; the result is the larger of kv_committed_len and "
        "prefill_len plus the reserve. host_lengths: when there is a publish_ready event and the switch is on, "
        "synchronize it; then the mirror's entries at `rows`, as a Python list.",
    ), {"allocate for the most a step can accept": """
        # STUB (exercise 11 not written): correct, not precise: KV for the request's whole life at once,
        # whatever the spec_alloc_reserve switch says.
        return req.prompt_len + req.max_new_tokens + 2 * (self.num_steps + 1)
    """, "wait for the publish before reading the mirror": """
        # STUB (exercise 11 not written): waits for the publish whatever spec_publish_wait says.
        ready = self.publish_ready
        if ready is not None:
            ready.synchronize()
        lengths = self.mirror[rows]
        return lengths.tolist()
    """, "the accept length": """
    # STUB (exercise 11 not written): correct, not precise: on the host, row by row (a round trip).
    lengths = []
    for row_drafts, row_target in zip(drafts.tolist(), target.tolist()):
        n = 0
        while n < len(row_drafts) and row_drafts[n] == row_target[n]:
            n += 1
        lengths.append(n + 1)
    return torch.tensor(lengths, dtype=torch.int64, device=drafts.device)
    """}),
    Exercise(12, "mixed chunk: a running request's decode row in a prefill batch (features/mixed_chunk.py)", 12, (
        "tests/test_ex12_mixed_chunk.py",
        "tests/test_speculative_fuzz.py::test_features_match_plain_decoding_under_random_aborts[mixed-chunk]",
    ), (
        "A decode row that rides in a prefill batch is still a decode step of its request. What does a decode "
        "batch write for each request, and which of the request's lengths says where its next token goes, in "
        "both loops? (readings §18: mix_with_running, the overlap's delta; lesson 12)",
        "Build the row as _schedule_decode does: the input input_id (_decode_input's: a placeholder while the "
        "token is in flight), the position the launched length, one newly allocated KV slot; then advance launched_len "
        "and inflight_samples by one. With mixed_prefix_from_launched off the position is committed_len - 1.",
        "The position: launched_len while mixed_prefix_from_launched is on, else committed_len - 1. Then one "
        "tokens.add for the request's row with a one-element list of input_id (the scheduler's _decode_input), that "
        "position and one slot from the ledger's allocate; then one more launched position and one more sample "
        "in flight.",
    ), {"the decode row": """
            # STUB (exercise 12 not written): no decode row rides in a prefill batch: mixed chunk
            # degrades to the plain path (the request decodes in the next decode batch).
            continue
    """}),
)}


STUB_TAG = re.compile(r"^STUB \(exercise \d+ not written\):\s*")


def stub_note(number: int, name: str, tree: Path = ROOT) -> str | None:
    """While exercise `number`'s region `name` in tree/minisgl still holds the student edition's
    stub unchanged: what that stub gives up, in its own words (its opening comment, without the
    "STUB (exercise N not written):" tag). None once anything else is written there, and in the
    teacher's checkout, whose regions hold the reference. A lesson asks this before it prints a
    figure that the stub cannot show (lessons/common.py figure(needs=...))."""
    def squeezed(code: str) -> list[str]:
        return [line.rstrip() for line in textwrap.dedent(code).strip("\n").splitlines()]

    written = written_regions(tree).get(number, {})
    if name not in written:
        raise KeyError(f"no region 'exercise {number}: {name}' in {tree / 'minisgl'}")
    stub = squeezed(EXERCISES[number].stubs[name])
    if squeezed(written[name]) != stub:
        return None
    opening = []
    for line in stub:  # the comment lines before the stub's first line of code
        if not line.lstrip().startswith("#"):
            break
        opening.append(line.lstrip().lstrip("#").strip())
    return STUB_TAG.sub("", " ".join(opening))
