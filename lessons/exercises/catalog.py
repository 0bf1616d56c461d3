"""The exercises: what each one removes, which lesson it follows, its tests and its hints.

Hints come in three levels, so that a stuck learner can ask for as little as they need:
1. a question that points at the concept and at the reading (`lessons/readings/README.md`);
2. the idea of the solution, in words;
3. the solution's shape, close to code.

The marked regions in `minisgl/` name the part only (`# >>> exercise N: <name>`); the
hints live here, so that reading the skeleton does not give the answer away.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    number: int
    title: str
    lesson: int
    tests: tuple[str, ...]  # pytest node ids inside the work dir; the teaching test file comes first
    hints: tuple[str, str, str]  # levels 1, 2, 3


EXERCISES = {e.number: e for e in (
    Exercise(1, "write overlap_loop from normal_loop (scheduler.py)", 3, (
        "tests/test_ex1_overlap_loop.py",
        "tests/test_overlap.py::test_overlap_pipelines_launches_ahead_of_commits",
        "tests/test_overlap.py::test_overlap_equals_normal[3.0-0]",
        "tests/test_mechanisms.py::test_future_map_off_brings_the_bubble_back",
        "tests/test_mechanisms.py::test_prefill_sync_commits_consecutive_prefills",
    ), (
        "normal_loop waits for batch n before it plans n+1. Which of its three calls could wait until "
        "the next iteration, and what must the loop carry across iterations to do that? "
        "(readings §3 and §11: 「关键设计：延迟处理」; lesson 3)",
        "Schedule and launch the new batch first, then commit the batch that was in flight (`last`), "
        "and return the new in-flight batch (an InFlight of its view and result) for the next call. "
        "Commit `last` even when nothing new was planned. Two boundaries commit `last` early instead, "
        "with commit(last, early=True): before scheduling when future_map is off (the new input ids "
        "must be committed tokens), and before launching when prefill_sync is on and the new batch and "
        "`last` are both prefills. Unlike normal_loop, the InFlight must hold a snapshot of the view "
        "(planned.view.snapshot(): schedule() changes the live batch before the commit, lesson 5); "
        "with batch_snapshot off, the live view.",
        "if self._must_commit_first(last, None): commit(last, early=True); last = None. "
        "planned = self.schedule(). if self._must_commit_first(last, planned): the same. "
        "inflight = None; if planned: result = self.launch(planned); inflight = InFlight(view, result) "
        "where view = planned.view.snapshot() if self.on('batch_snapshot') else planned.view. "
        "if last is not None: self.commit(last). return inflight.",
    )),
    Exercise(2, "FutureMap publish and resolve (future_map.py)", 4, (
        "tests/test_ex2_future_map.py",
        "tests/test_overlap.py::test_overlap_equals_normal[0.0-0]",
    ), (
        "Batch n+1 needs batch n's sampled tokens as input ids, but the host has not seen them. The "
        "host does know *where* each token will be. What is stable for a request's whole life, and "
        "what changes every step? (readings §6; lesson 4)",
        "publish: write each sampled token into the slot of `tokens` named by its request-pool row. "
        "resolve: a negative id -(row+1) names a row: replace it by that row's token; keep real ids "
        "(>= 0). Both run on the device, as tensor operations: no Python loop over values, no .item() "
        "or .tolist() (that would make the host wait), and resolve must not modify its input.",
        "publish: self.tokens[rows] = next_tokens. resolve: is_future = input_ids < 0; rows = "
        "(-input_ids - 1).clamp(min=0); return torch.where(is_future, self.tokens[rows], input_ids).",
    )),
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
        "return BatchView(self.batch_id, False, list(self.reqs), self.rows, self.generations, "
        "self.samples, self.qo_lens)  (the properties already build new lists).",
    )),
    Exercise(4, "overshoot: skip late results, look ahead by length, release by allocated length "
                "(scheduler.py, 3 places)", 6, (
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
        "if self.on('length_lookahead'): self.running.reqs[:] = [r for r in self.running.reqs if not "
        "r.will_finish_by_length()]. In _commit_results: if req.finished and self.on('skip_finished'): "
        "self.stats.overshoot_tokens += qo_len; continue. In _release: end = req.allocated_len if "
        "self.on('release_allocated') else written; self.kv_pool.free(req.slot_ids[written:end]).",
    )),
    Exercise(5, "the radix-cache checkpoint at the safe point: the commit (scheduler.py, 2 places)", 7, (
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
        "if req.finished: if finished_before or not req.released: self._release(req); "
        "self.finished.append(req). In _release: written = min(req.kv_committed_len, "
        "req.committed_len); slots = req.slot_ids[:written]; present = self.cache.insert("
        "req.committed_ids()[:written], torch.tensor(slots, dtype=torch.int64)); "
        "self.kv_pool.free(slots[req.cached_len:present]); self.cache.unlock(req.prefix_node).",
    )),
    Exercise(6, "reuse a request row only after its last in-flight batch (scheduler.py, 2 places)", 7, (
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
        "_free_row: if self.on('deferred_row_free') and self._row_last_launch[row] > "
        "self._device_done_id: self.deferred_rows.append(row) else: self.req_to_token.free(row). "
        "_free_deferred_rows: keep the rows with _row_last_launch[row] > _device_done_id, free the rest.",
    )),
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
        "if buf.consumed is not None and not buf.consumed.query(): if self.war_wait: self.waits += 1; "
        "buf.consumed.synchronize() else: self.unread_overwrites += 1.",
    )),
    Exercise(8, "the handoff between the streams: the engine waits for the scheduler stream, the host "
                "waits for copy_done (engine.py, scheduler.py)", 2, (
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
        "Engine.launch: self.stream.wait_stream(after). Scheduler.commit: result.copy_done.synchronize().",
    )),
)}
