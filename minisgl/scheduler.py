"""The scheduler: continuous batching, and the two event loops side by side.

Read `normal_loop` and `overlap_loop` first (right below `step`, near the top of the class):
they share every other method and differ only in *when* a batch's results are committed.
Batch numbers everywhere in minisgl: n is the batch being launched, n-1 the one being committed.

- normal_loop  (lessons/readings §2, SGLang's event_loop_normal): schedule batch n, launch
  it, wait for it, commit it. The device idles while the host commits and schedules: the bubble.
- overlap_loop (lessons/readings §3 and §11, mini-SGLang's overlap_loop):
  schedule batch n and launch it while batch n-1 still runs, then commit n-1. The host work
  hides behind device work; results are committed one step late.

The one-step lag must never change a token, leak a slot or corrupt a cache entry. Every
place that protects that is marked `self.on("<mechanism>")` with what breaks without it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from itertools import accumulate

import torch

from .admission import NewTokenRatio, optimistic_charge
from .batch import BatchView, InFlight, Planned, RunningBatch, SchedulerStats
from .config import EngineConfig
from .engine import Engine, ForwardBatch, ForwardResult
from .future_map import placeholder
from .grammar import build_mask
from .interrupts import atomic_step
from .invariants import check_invariants
from .kv_pool import KVAccountingError
from .logprobs import logprob_rows, output_index
from .radix_cache import RadixCache
from .request import Req, TokenLogprob
from .staging import StagingRing, TokenColumns
from .streams import make_host_stream
from .tracer import SpanName


class Scheduler:
    def __init__(self, config: EngineConfig, engine: Engine) -> None:
        # One config for both: the KV pool and request table below were sized from engine.config.
        assert engine.config is config, "the scheduler and its engine must share one EngineConfig"
        self.config = config
        self.engine = engine
        self.device = config.device
        self.mechanisms = config.mechanisms
        # Mutable, unlike the config: the lab turns this knob between runs on one engine.
        self.host_delay_s = config.host_delay_ms / 1000.0
        self.stream = make_host_stream("scheduler", self.device)

        # The engine owns this memory (it allocated it and frees it); the scheduler decides
        # which request holds which KV slot and which row.
        self.kv_pool = engine.kv_pool
        self.req_to_token = engine.req_to_token
        self.cache = RadixCache(self.kv_pool.free)
        max_running_requests = config.max_running_requests
        self.staging = StagingRing(max(config.chunk_size, max_running_requests), max_running_requests, self.device,
                                   self.mechanisms)

        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully launched (chunked prefill)
        self.running = RunningBatch()
        self.releasing: list[Req] = []  # aborted: no longer scheduled, released when their batches commit
        self.finished: list[Req] = []  # finished, not yet collected by the caller
        self.last: InFlight | None = None  # overlap loop: batch n-1, committed during the next step
        self.stats = SchedulerStats()
        self.tracer = engine.tracer
        self.error: BaseException | None = None  # set when an exception escaped a step
        self.check_each_step = os.environ.get("MINISGL_CHECK_INVARIANTS") == "1"

        self._next_batch_id = 0
        self._device_done_id = -1  # every batch up to this id has passed copy_done
        self._row_last_launch = [-1] * max_running_requests
        self._row_owner: list[Req | None] = [None] * max_running_requests
        self.deferred_rows: list[int] = []  # rows of released requests that a batch in flight still uses
        self._reserved = 0  # KV slots promised to admitted requests but not yet allocated
        self._aborts_pending = False  # abort() since the last scan: only then are the queues scanned
        self.new_token_ratio = NewTokenRatio()  # admission="optimistic": the share of decode slots charged

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.on(mechanism)

    # ------------------------------------------------------------------ the two loops
    def step(self) -> list[Req]:
        """One loop iteration; returns the requests that finished during it.

        Atomic (interrupts.py): Ctrl-C lands after the step, any other error stops the scheduler."""
        self.tracer.iteration += 1
        with atomic_step(self):
            match self.config.loop:  # a Loop: resolve_config refused anything else
                case "normal":
                    self.normal_loop()
                case "overlap":
                    self.last = self.overlap_loop(self.last)
            if self.check_each_step:
                check_invariants(self)
        done, self.finished = self.finished, []
        return done

    def normal_loop(self) -> None:
        """Serial (event_loop_normal): schedule batch n, launch it, wait for it, commit it."""
        planned = self.schedule()
        if planned is not None:
            inflight = InFlight(planned.view, self.launch(planned))
            self._sample_if_delayed(inflight)
            self.commit(inflight)  # the device idles until the next launch

    def overlap_loop(self, last: InFlight | None) -> InFlight | None:
        """Pipelined (overlap_loop(last_data)): launch batch n, then commit batch n-1 while n runs."""
        # >>> exercise 1: overlap_loop
        if self._must_commit_first(last, planned=None):
            self.commit(last, early=True)
            last = None
        planned = self.schedule()
        if self._must_commit_first(last, planned):
            self.commit(last, early=True)
            last = None
        inflight = None
        if planned is not None:
            result = self.launch(planned)
            # The queue keeps a snapshot: the live running batch will be filtered and merged by
            # the next schedule() before this result is committed. Holding the live batch would
            # zip batch n's tokens with batch n+1's requests (lessons/readings §5, "batch.copy()").
            inflight = InFlight(planned.view.snapshot() if self.on("batch_snapshot") else planned.view, result)
        if last is not None:
            self.commit(last)  # batch n-1's results, while batch n runs on the device
        # <<< exercise 1
        self._sample_if_delayed(inflight)  # a grammar in batch n: its masks need n-1's tokens, committed just now
        return inflight

    def _must_commit_first(self, last: InFlight | None, planned: Planned | None) -> bool:
        """The sync boundaries: batch n-1 must be committed before batch n launches when

        - before planning (`planned` is None), the FutureMap is off: batch n's input ids must
          then be committed host tokens, so the bubble is back (lessons/readings §6);
        - after planning, n-1 and n are both prefills and prefill_sync is on: commit the first
          so its first tokens are out one batch sooner (lessons/readings §3; SGLang's default
          differs: §14).
        """
        # >>> exercise 1: the sync boundaries
        if last is None:
            return False
        if planned is None:
            return not self.on("future_map")
        return planned.forward.is_prefill and last.view.is_prefill and self.on("prefill_sync")
        # <<< exercise 1

    # ------------------------------------------------------------------ requests in and out
    def check_fits(self, req: Req) -> None:
        """A request the KV pool could never hold is refused up front (admission would wait forever)."""
        need = req.prompt_len + req.max_new_tokens + 1
        if need > self.kv_pool.total:
            raise ValueError(f"request needs {need} KV slots (prompt {req.prompt_len} + max_new_tokens "
                             f"{req.max_new_tokens} + 1), the KV pool has {self.kv_pool.total}; raise kv_tokens")

    def add(self, req: Req) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def has_work(self) -> bool:  # `finished`: a step ended by Ctrl-C has not handed them out yet
        return bool(self.waiting or self.prefilling or self.running.reqs or self.releasing or self.last
                    or self.finished)

    def abort(self, req: Req) -> None:
        req.abort_requested = self._aborts_pending = True  # acted on at the start of the next schedule

    # ------------------------------------------------------------------ scheduling (planning)
    def schedule(self) -> Planned | None:
        """Plan batch n from committed state plus what is in flight. Prefill first."""
        with self.tracer.host(SpanName.SCHEDULE):
            self._handle_aborts()
            self.running.reqs[:] = [r for r in self.running.reqs if not r.finished]  # filter_batch
            planned = self._schedule_prefill() or self._schedule_decode()
            if self.host_delay_s:  # emulated scheduler work, the lab's knob for C: a sleep after the
                time.sleep(self.host_delay_s)  # planning, so planning and device never queue for the GIL
            return planned

    def _schedule_prefill(self) -> Planned | None:
        budget = self.config.chunk_size
        chunks: list[tuple[Req, int]] = []
        for req in self.prefilling:  # continue chunked prompts first
            n = min(budget, req.prefill_len - req.launched_len)
            if n > 0:
                chunks.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            self.prefilling.append(req)
            n = min(budget, req.prefill_len - req.launched_len)
            chunks.append((req, n))
            budget -= n
        if not chunks:
            return None
        tokens = TokenColumns()
        reqs, qo_lens, kv_lens, samples = [r for r, _ in chunks], [n for _, n in chunks], [], []
        for req, n in chunks:
            start = req.launched_len
            tokens.add(req.row, req.prefill_ids(start, n), start, self._alloc_slots(req, n))
            req.launched_len += n
            sampled = req.prefill_launched  # the last chunk samples the next output token
            req.inflight_samples += sampled
            if sampled:  # decode from the next step on, its first token relayed by the FutureMap
                self.prefilling.remove(req)
                self.running.reqs.append(req)
            kv_lens.append(req.launched_len)
            samples.append(sampled)
        self.stats.prefill_batches += 1
        return self._plan(reqs, tokens, qo_lens, kv_lens, samples, is_prefill=True)

    def _schedule_decode(self) -> Planned | None:
        # >>> exercise 4: length lookahead
        if self.on("length_lookahead"):
            # Leave out requests whose launched samples already reach max_new_tokens: their last
            # token is in flight, another step would be wasted overshoot (lessons/readings §8:
            # article 000's _reqs_finishing_inflight()).
            self.running.reqs[:] = [r for r in self.running.reqs if not r.will_finish_by_length()]
        # <<< exercise 4
        if not self.running.reqs or not self._decode_slots_available():
            return None
        reqs = self.running.reqs
        # Requests whose last sample is already in flight: this step is wasted overshoot.
        self.stats.overshoot_steps += sum(r.will_finish_by_length() for r in reqs)
        tokens = TokenColumns()
        release_when_planned = not self.on("commit_point_cache")
        for req in reqs:  # a few list operations per request: this loop is the decode step's host cost
            tokens.add(req.row, [self._decode_input(req)], req.launched_len, self._alloc_slots(req, 1))
            req.launched_len += 1
            req.inflight_samples += 1  # planned: this step samples one more token
            if release_when_planned and req.will_finish_by_length():
                # WRONG on purpose: hand the prefix to the cache and free the request's slots now,
                # when its final step is only planned. Requests later in this same batch are then
                # given the slots this step still reads and writes (lessons/readings §9: release
                # only after the last device use).
                self._release(req)
        self.stats.decode_batches += 1
        self.stats.decode_rows += len(reqs)
        return self._plan(reqs, tokens, [1] * len(reqs), [r.launched_len for r in reqs], [True] * len(reqs),
                          is_prefill=False)

    def _decode_input(self, req: Req) -> int:
        """The input id of req's next decode step: a committed token, or a FutureMap placeholder."""
        if req.launched_len < req.committed_len:
            return req.token_at(req.launched_len)
        assert self.on("future_map"), "without the FutureMap the input token must be committed"
        return placeholder(req.row)  # in flight: batch n gathers what batch n-1 published in the FutureMap

    def _plan(self, reqs: list[Req], tokens: TokenColumns, qo_lens: list[int], kv_lens: list[int],
              samples: list[bool], is_prefill: bool) -> Planned:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        params = [r.params for r in reqs]
        staging = self.staging.acquire()  # may wait: write-after-read barrier
        staging.write(tokens, rows=[r.row for r in reqs], kv_lens=kv_lens,
                      qo_indptr=[0, *accumulate(qo_lens)], kv_indptr=[0, *accumulate(kv_lens)],
                      temperature=[p.temperature for p in params], top_p=[p.top_p for p in params],
                      top_k=[p.top_k for p in params], seeds=[r.sample_seed for r in reqs],
                      sample_steps=[r.next_sample_index for r in reqs])
        delay_sample, mask = False, None  # no grammar in the batch: sample inside the forward, unmasked
        if any(p.grammar is not None for p in params):
            # >>> exercise 10: delay the sampling
            delay_sample = self.on("grammar_delayed_sample")
            if not delay_sample:
                # WRONG on purpose: masks from the states at planning, which in the overlap loop
                # lack the token batch n-1 is still sampling (one token behind).
                mask = build_mask([p.grammar for p in params], [r.grammar_state for r in reqs])
            # <<< exercise 10
        rows = logprob_rows(reqs, kv_lens)  # fixed now, from the lengths at planning: the launch snapshot
        forward = ForwardBatch(batch_id, is_prefill, qo_lens, kv_lens, staging,
                               all_greedy=all(p.temperature == 0 for p in params), delay_sample=delay_sample,
                               mask=mask, logprob_rows=rows,
                               logprob_indices=[output_index(reqs[i], kv_lens[i]) for i in rows],
                               logprob_k=max((params[i].logprobs or 0 for i in rows), default=0))
        if is_prefill:
            view: BatchView | RunningBatch = BatchView(batch_id, True, reqs, [r.row for r in reqs],
                                                       [r.row_generation for r in reqs], samples, qo_lens)
        else:
            self.running.batch_id = batch_id
            view = self.running
        return Planned(forward, view)

    # ------------------------------------------------------------------ admission and memory
    def _admit(self, req: Req) -> bool:
        """Admit if the KV pool can promise the request all it may ever need; else wait.

        The promise (prompt + max_new_tokens + 1 overshoot slot, minus the cached prefix) is
        counted against what admitted requests were promised: in full with admission="reserve",
        so a running request never runs out of slots and nothing is ever retracted; with
        "optimistic", their decode part only by the new-token ratio, and a decode step that
        runs short retracts (`_decode_slots_available`). A request that could never fit was
        refused by `add()`. A retracted request comes back here with its outputs to re-prefill.
        """
        if self.req_to_token.free_count == 0 or len(self.running.reqs) + len(self.prefilling) >= self.config.max_running_requests:
            return False
        # compute >= 1 token: we need logits
        matched, node = self.cache.match_prefix(req.committed_ids()[:req.prefill_len - 1])
        self.cache.lock(node)
        need = req.prefill_len - len(matched) + req.max_new_tokens - len(req.output_ids) + 1
        if self.config.admission == "reserve":
            promised = self._reserved
        else:
            promised = optimistic_charge(self.running.reqs + self.prefilling, self.new_token_ratio.current)
        if self.kv_pool.free_count + self.cache.evictable_size - promised < need:
            self.cache.unlock(node)
            return False
        req.prefix_node = node
        self.stats.cached_tokens += len(matched)
        req.cached_len = req.launched_len = req.kv_committed_len = len(matched)
        req.slot_ids = matched.tolist()
        req.reserved_tokens = need
        self._reserved += need
        req.released = False  # a retracted request was released once already
        req.row = self.req_to_token.alloc()
        req.row_generation = self.req_to_token.generation[req.row]
        self._row_owner[req.row] = req
        if req.cached_len:
            row = req.row
            # The scheduler writes the cached prefix into the row (the engine writes new slots).
            # Keep-alive: the device copy of the slots is made inside the launched work, so it is
            # allocated on the scheduler stream that reads it; made here, on the default stream,
            # the caching allocator could hand its memory to someone else before the queued copy
            # ran (lessons/readings §4, keeping memory alive across streams).
            self.stream.launch(lambda: self.req_to_token.table[row, :len(matched)].copy_(
                matched.to(self.device, non_blocking=True)))
        return True

    def _decode_slots_available(self) -> bool:
        """admission="optimistic": make sure the next decode step gets one slot per running
        request, retracting requests if it cannot (SGLang: check_decode_mem, retract_decode).
        False: not even one request fits until the batch in flight commits its finishes."""
        if self.config.admission == "reserve":
            return True  # the admission promise covers every decode slot
        reqs = self.running.reqs
        if self.kv_pool.free_count + self.cache.evictable_size >= len(reqs):
            self.new_token_ratio.decay_step()
            return True
        # Retract until a few steps fit (fewer retractions in a row), keeping at least one request.
        steps = self.new_token_ratio.schedule.retract_headroom_steps
        while len(reqs) > 1 and self.kv_pool.free_count + self.cache.evictable_size < len(reqs) * steps:
            # SGLang's order: the request with the fewest outputs goes first, the longer prompt on a tie.
            self._retract(min(reqs, key=lambda r: (len(r.output_ids), -r.prompt_len)))
            self.stats.events.append((SpanName.RETRACT, self._next_batch_id))
            self.new_token_ratio.after_retract(reqs)
        return self.kv_pool.free_count + self.cache.evictable_size >= len(reqs)

    def _retract(self, req: Req) -> None:
        """Send a running request back to waiting: its committed KV goes to the radix cache and the
        rest back to the pool, as at a finish (`_release`). A batch in flight may still write its
        last slot, which the next batch may then be given: safe, the new owner's writes queue
        behind it on the engine stream. Its row waits for that batch (`_free_row`), and that
        batch's result for it must be skipped at commit (retract_skip_inflight)."""
        self.running.reqs.remove(req)
        self._release(req)
        req.reset_for_retract()
        self.waiting.appendleft(req)
        self.stats.retractions += 1

    def _alloc_slots(self, req: Req, n: int) -> list[int]:
        shortfall = n - self.kv_pool.free_count
        if shortfall > 0:
            self.cache.evict(shortfall)  # the admission promise guarantees this suffices
        req.slot_ids += (slots := self.kv_pool.alloc(n))
        req.reserved_tokens -= n
        self._reserved -= n  # promised at admission, now allocated
        return slots

    # ------------------------------------------------------------------ launch and commit
    def launch(self, planned: Planned) -> ForwardResult:
        forward = planned.forward
        with self.tracer.host(SpanName.LAUNCH, forward.batch_id):
            result = self.engine.launch(forward, after=self.stream)
        for row in planned.view.rows:
            self._row_last_launch[row] = forward.batch_id
        self.stats.batches += 1
        self.stats.events.append((SpanName.LAUNCH, forward.batch_id))
        return result

    def _sample_if_delayed(self, inflight: InFlight | None) -> None:
        """A grammar batch's sampling, delayed until every earlier batch is committed: build its
        masks from the grammar states now and launch it (SGLang's launch_batch_sample_if_needed;
        lessons/readings §16). A batch without a grammar sampled inside its forward: nothing to do."""
        if inflight is None or inflight.result.delayed is None:
            return
        # >>> exercise 10: launch the delayed sampling
        result = inflight.result
        # The mask needs each request's latest token: every earlier batch must be committed, so
        # that the states are not one token behind (what grammar_delayed_sample off shows).
        assert self._device_done_id == result.batch_id - 1, "delayed sampling before the previous batch's commit"
        with self.tracer.host(SpanName.SAMPLE, result.batch_id):
            reqs = inflight.view.reqs  # the batch's own rows, in its order: one mask entry per row
            self.engine.launch_sample(result, build_mask([r.params.grammar for r in reqs],
                                                         [r.grammar_state for r in reqs]))
        self.stats.delayed_samples += 1
        # <<< exercise 10

    def commit(self, inflight: InFlight, early: bool = False) -> None:
        """The commit point: outputs and token finishes change only here (an abort: _handle_aborts).

        `early`: batch n-1 is committed before batch n launches, at a sync boundary."""
        view, result = inflight.view, inflight.result
        assert result.delayed is None, f"batch {result.batch_id}: its delayed sampling was never launched"
        self.stats.early_commits += early
        with self.tracer.host(SpanName.WAIT, result.batch_id):
            # >>> exercise 8: the host waits for copy_done
            result.copy_done.synchronize()  # the host may read the tokens, and the batch's device work is done
            # <<< exercise 8
        with self.tracer.host(SpanName.COMMIT, result.batch_id):
            self._commit_results(view, result)

    def _commit_results(self, view: BatchView | RunningBatch, result: ForwardResult) -> None:
        self._device_done_id = max(self._device_done_id, result.batch_id)
        self.stats.events.append((SpanName.COMMIT, result.batch_id))
        tokens = result.next_tokens_host.tolist()
        logprobs = self._logprobs_by_row(view, result, tokens)
        for i, (req, row, generation, sampled, qo_len, token) in enumerate(zip(
                view.reqs, view.rows, view.generations, view.samples, view.qo_lens, tokens)):
            # >>> exercise 9: skip a retracted request's in-flight result
            if (req.row, req.row_generation) != (row, generation) and self.on("retract_skip_inflight"):
                # Retracted after this batch launched (admission="optimistic"): it waits to be
                # re-prefilled from its committed tokens, and that prefill samples this step
                # again. This row's token is no output (SGLang: is_retracted; readings §15).
                self.stats.retracted_late_results += 1
                continue
            # <<< exercise 9
            if self.req_to_token.generation[row] != generation:
                # The row was recycled while this batch was in flight: a late reader (ABA). Only
                # reachable with deferred_row_free off (lessons/readings §9, row reuse).
                if self.on("row_generation_check"):
                    self.stats.stale_row_results += 1
                    continue
                # WRONG on purpose: trust the row, as a reader keyed by row alone would: the old
                # request's late token is committed to the row's new owner.
                req = self._row_owner[row] or req
            # >>> exercise 4: skip_finished
            if req.finished and self.on("skip_finished"):
                # Overshoot: the request finished (EOS at batch n-1, or aborted) while this batch
                # was already in flight. Its positions are not outputs (lessons/readings §8).
                self.stats.overshoot_tokens += qo_len
                continue
            # <<< exercise 4
            req.kv_committed_len += qo_len
            if not sampled:
                continue
            req.inflight_samples -= 1
            finished_before = req.finished  # only possible with skip_finished off
            req.commit_token(token, logprobs.get(i))
            # >>> exercise 5: the commit point
            if req.finished:
                if finished_before or not req.released:
                    self._release(req)  # a second finish is a double free, and _release says so
                self.finished.append(req)
            # <<< exercise 5
        self._release_committed_aborts()
        self._free_deferred_rows()

    def _logprobs_by_row(self, view: BatchView | RunningBatch, result: ForwardResult,
                         tokens: list[int]) -> dict[int, tuple[int, TokenLogprob]]:
        """Batch row -> (output index, logprob) of this batch's logprobs (logprobs.py)."""
        if result.logprobs is None:
            return {}
        indices = result.logprobs.indices  # from the lengths at planning: the launch snapshot
        if not self.on("logprob_snapshot"):
            # WRONG on purpose: the live lengths, which the next schedule has already moved
            # (batch n+1 launched one more position): each logprob lands one token late.
            indices = [output_index(view.reqs[i], view.reqs[i].launched_len) for i in result.logprobs.rows]
        return result.logprobs.by_row(tokens, [r.params.logprobs or 0 for r in view.reqs], indices)

    # Slots of a request being released, by position (cached <= present <= written <= allocated):
    #
    #   [0, cached)          prefix matched at admission: the tree's slots; we only unlock them
    #   [cached, present)    our copies of what the tree already holds (another request inserted
    #                        the same ids first): freed
    #   [present, written)   KV that committed batches wrote: handed to the tree (checkpoint)
    #   [written, allocated) the tail: planned or overshoot positions no committed batch wrote:
    #                        freed (release_allocated; off, these slots leak)
    def _release(self, req: Req) -> None:
        """Give back everything a finished request holds, in the order of the safe point (readings §9):
        checkpoint committed KV into the radix cache, unlock the old path, free the private tail
        (overshoot included), then the row."""
        if req.released:
            raise KVAccountingError(f"double free: request {req.rid} released twice")
        req.released = True
        # >>> exercise 5: checkpoint
        written = min(req.kv_committed_len, req.committed_len)  # positions whose KV committed batches wrote
        slots = req.slot_ids[:written]
        present = self.cache.insert(req.committed_ids()[:written], torch.tensor(slots, dtype=torch.int64))
        self.kv_pool.free(slots[req.cached_len:present])  # our copies of what the tree already had
        self.cache.unlock(req.prefix_node)
        # <<< exercise 5
        # Freeing the tail while an overshoot step may still write it is safe: any new owner's
        # writes are queued behind that step on the same stream.
        # >>> exercise 4: release by allocated length
        end = req.allocated_len if self.on("release_allocated") else written
        self.kv_pool.free(req.slot_ids[written:end])
        # <<< exercise 4
        self._reserved -= req.reserved_tokens
        req.reserved_tokens = 0
        self._row_owner[req.row] = None
        self._free_row(req.row)

    def _free_row(self, row: int) -> None:
        # A batch still in flight may write this row (an overshoot step records its new slot in
        # the request table on the device). Reusing the row before that batch is done would let
        # the old request's late write land in the new request's row (ABA; lessons/readings §9).
        # >>> exercise 6: deferred row free
        if self.on("deferred_row_free") and self._row_last_launch[row] > self._device_done_id:
            self.deferred_rows.append(row)
        else:
            self.req_to_token.free(row)
        # <<< exercise 6

    def _free_deferred_rows(self) -> None:
        # >>> exercise 6: free deferred rows
        still = []
        for row in self.deferred_rows:
            if self._row_last_launch[row] > self._device_done_id:
                still.append(row)
            else:
                self.req_to_token.free(row)
        self.deferred_rows = still
        # <<< exercise 6

    def _handle_aborts(self) -> None:
        """An aborted request stops being scheduled at once. Its resources go back like a
        finish's, at the commit point of its last batch in flight: until then the device may
        still write its slots and row (lessons/readings §9). The queues are scanned only after
        an abort(): a scan at every step would grow the host's work with the waiting queue."""
        if self._aborts_pending:
            for req in [r for r in self.waiting if r.abort_requested]:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                self.finished.append(req)
            for queue in (self.prefilling, self.running.reqs):
                for req in [r for r in queue if r.abort_requested and not r.finished]:
                    req.finish_reason = "abort"  # its queued results are dropped at commit (skip_finished)
                    queue.remove(req)
                    self.releasing.append(req)
            self._aborts_pending = False
        self._release_committed_aborts()

    def _release_committed_aborts(self) -> None:
        for req in [r for r in self.releasing if self._row_last_launch[r.row] <= self._device_done_id]:
            self.releasing.remove(req)
            if not req.released:  # commit_point_cache off may have released it at planning
                self._release(req)
            self.finished.append(req)

    def close(self) -> None:
        """Commit the batch in flight, unless an error stopped the scheduler (LLM.close() then
        stops the engine and frees its memory)."""
        if self.last is not None and self.error is None:
            last, self.last = self.last, None
            self.commit(last)
