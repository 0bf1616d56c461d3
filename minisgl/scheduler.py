"""The scheduler: continuous batching, and the two event loops side by side.

Read `normal_loop` (lessons/readings §2) and `overlap_loop` (§3, §11) first: they share every other
method and differ only in *when* batch n-1 is committed, before batch n launches or while it runs.
The lag must never change a token, leak a slot or corrupt a cache entry: every place that protects that is marked
`self.on("<mechanism>")`. Parts: `kv_ledger` (KV accounting, radix cache), `rows` (request rows and the batches
in flight using them), `batch_builder` (staging, batch ids); features plug in through `features` (seams.py)."""

from __future__ import annotations

import os
import time
from collections import deque

from .batch import BatchView, InFlight, Planned, RunningBatch, SchedulerStats
from .config import EngineConfig
from .engine import Engine, ForwardResult
from .future_map import placeholder
from .interrupts import atomic_step
from .invariants import check_invariants
from .kv_ledger import KVLedger
from .planning import BatchBuilder
from .request import Req
from .rows import RowTracker
from .seams import Features
from .staging import TokenColumns
from .streams import make_host_stream
from .tracer import SpanName


class Scheduler:
    def __init__(self, config: EngineConfig, engine: Engine) -> None:
        assert engine.config is config, "the scheduler and its engine must share one EngineConfig"
        self.config = config
        self.engine = engine
        self.device = config.device
        self.mechanisms = config.mechanisms
        self.host_delay_s = config.host_delay_ms / 1000.0  # mutable: the lab turns it between runs
        self.stream = make_host_stream("scheduler", self.device)
        self.tracer = engine.tracer
        self.stats = SchedulerStats()
        self.features = Features()  # the front end plugs features in (features.plug_in)

        self.kv_ledger = KVLedger(engine.kv_pool, self.mechanisms, config.lookahead_slots)
        self.kv_pool, self.cache = self.kv_ledger.kv_pool, self.kv_ledger.cache
        self.req_to_token = engine.req_to_token
        self.rows = RowTracker(engine.req_to_token, self.mechanisms)
        self.batch_builder = BatchBuilder(config)

        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully launched (chunked prefill)
        self.running = RunningBatch()
        self.releasing: list[Req] = []  # aborted: released when their last batch commits
        self.finished: list[Req] = []  # finished, not yet collected by the caller
        self.last: InFlight | None = None  # overlap loop: batch n-1, committed during the next step
        self.unsampled: InFlight | None = None  # launched, its sampling waits for n-1's commit (grammar)
        self.error: BaseException | None = None  # set when an exception escaped a step
        self.check_each_step = os.environ.get("MINISGL_CHECK_INVARIANTS") == "1"
        self._aborts_pending = False  # abort() since the last scan: only then are the queues scanned

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.on(mechanism)

    # ------------------------------------------------------------------ the two loops
    def step(self) -> list[Req]:
        """One loop iteration; returns the requests that finished during it. Whole: the front
        end holds Ctrl-C back around it, and an error stops the scheduler (interrupts.py)."""
        self.tracer.iteration += 1
        with atomic_step(self):
            match self.config.loop:
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
            # A snapshot: the next schedule() filters and merges the live running batch before this
            # commit, which would zip batch n's tokens with n+1's requests (readings §5).
            inflight = InFlight(planned.view.snapshot() if self.on("batch_snapshot") else planned.view, result)
        if last is not None:
            self.commit(last)  # batch n-1's results, while batch n runs on the device
        # <<< exercise 1
        return inflight

    def _must_commit_first(self, last: InFlight | None, planned: Planned | None) -> bool:
        """Must batch n-1 (`last`) be committed before batch n? Asked before schedule() (`planned` None)
        and after it. True before planning with the FutureMap off: n's input ids must be committed tokens
        (lesson 4; lessons/readings §6); after planning when n-1 and n are both prefills and prefill_sync
        is on: n-1's first tokens are out one batch sooner (lesson 8; lessons/readings §3, §14)."""
        if last is None:
            return False
        if planned is None:
            return not self.on("future_map")
        return planned.forward.is_prefill and last.view.is_prefill and self.on("prefill_sync")

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Req) -> None:
        if (req.params.grammar, req.params.logprobs) != (None, None) and None in (self.features.grammar,
                                                                                 self.features.logprobs):
            raise ValueError("grammars and logprobs need their features plugged in (minisgl.features.plug_in)")
        self.kv_ledger.check_fits(req)
        self.waiting.append(req)

    def has_work(self) -> bool:  # `finished`: a step that raised has not handed them out yet
        return bool(self.waiting or self.prefilling or self.running.reqs or self.releasing or self.last
                    or self.finished)

    def abort(self, req: Req) -> None:
        req.abort_requested = self._aborts_pending = True  # acted on at the start of the next schedule

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> Planned | None:
        """Plan batch n from committed state plus what is in flight. Prefill first."""
        with self.tracer.host(SpanName.SCHEDULE):
            if self._aborts_pending:
                self._handle_aborts()
            self._release_committed_aborts()
            self.running.reqs[:] = [r for r in self.running.reqs if not r.finished]  # filter_batch
            planned = self._schedule_prefill() or self._schedule_decode()
            if planned is not None:
                # Its rows count as in flight from now, not from its launch: an early commit of n-1
                # (prefill_sync) runs in between, and with mixed chunk batch n's decode rows may
                # belong to requests that n-1 finishes; freed there, a row would be reused by the next
                # admission while n still writes it (the prefix copy races n's table writes).
                self.rows.planned(planned.view.rows, planned.forward.batch_id)
            if self.host_delay_s:  # emulated host work (the lab's knob for C), after planning
                time.sleep(self.host_delay_s)
            return planned

    def _handle_aborts(self) -> None:
        """An aborted request stops being scheduled at once; its resources go back at the commit
        of its last batch in flight, which may still write its slots and row (readings §9)."""
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

    def _schedule_prefill(self) -> Planned | None:
        budget = self.config.chunk_size
        chunks: list[tuple[Req, int]] = []
        for req in self.prefilling:  # continue chunked prompts first
            n = min(budget, req.prefill_len - req.launched_len)
            if n > 0:
                chunks.append((req, n))
                budget -= n
        gate = self.features.prefill_gate
        gate_open = gate is None or gate.is_open(self.waiting, running=len(self.running.reqs),
                                                 prefilling=len(self.prefilling),
                                                 free_rows=self.req_to_token.free_count, kv_headroom=self._kv_headroom)
        while gate_open and self.waiting and budget > 0 and self._admit(self.waiting[0]):
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
            tokens.add(req.row, req.prefill_ids(start, n), start, self.kv_ledger.allocate(req, n))
            req.launched_len += n
            sampled = req.prefill_launched  # the last chunk samples the next output token
            req.inflight_samples += sampled
            if sampled:  # decode from the next step on, its first token relayed by the FutureMap
                self.prefilling.remove(req)
                self.running.reqs.append(req)
            kv_lens.append(req.launched_len)
            samples.append(sampled)
        self.stats.prefill_batches += 1
        self.stats.prefill_tokens += sum(qo_lens)
        if self.features.mixed_chunk is not None:  # the running decodes join this forward
            self.features.mixed_chunk.mix(self, tokens, reqs, qo_lens, kv_lens, samples)
        forward = self.batch_builder.build(reqs, tokens, qo_lens, kv_lens, True, self.features)
        return Planned(forward, BatchView(forward.batch_id, True, reqs, [r.row for r in reqs],
                                          [r.row_generation for r in reqs], samples, qo_lens))

    def _schedule_decode(self) -> Planned | None:
        # >>> exercise 4: length lookahead
        if self.on("length_lookahead"):
            # Leave out requests whose launched samples already reach max_new_tokens: their last
            # token is in flight, another step would be wasted overshoot (lessons/readings §8).
            self.running.reqs[:] = [r for r in self.running.reqs if not r.will_finish_by_length()]
        # <<< exercise 4
        admission = self.features.admission
        if not self.running.reqs or (admission is not None and not admission.retract_for_decode(
                self.running.reqs, self.kv_ledger.available, self._retract)):
            return None
        if self.features.speculation is not None:  # a verify step of K+1 tokens per request
            return self.features.speculation.plan_decode(self)
        reqs = self.running.reqs
        self.stats.overshoot_steps += sum(r.will_finish_by_length() for r in reqs)
        tokens = TokenColumns()
        release_when_planned = not self.on("commit_point_cache")
        for req in reqs:  # a few list operations per request: this loop is the decode step's host cost
            tokens.add(req.row, [self._decode_input(req)], req.launched_len, self.kv_ledger.allocate(req, 1))
            req.launched_len += 1
            req.inflight_samples += 1
            if release_when_planned and req.will_finish_by_length():
                # WRONG on purpose: released when its last step is only planned, later requests in
                # this batch get slots it still uses (readings §9: release after the last use).
                self._release(req)
        self.stats.decode_batches += 1
        self.stats.decode_rows += len(reqs)
        forward = self.batch_builder.build(reqs, tokens, [1] * len(reqs), [r.launched_len for r in reqs], False,
                                     self.features)
        self.running.batch_id = forward.batch_id
        return Planned(forward, self.running)

    def _decode_input(self, req: Req) -> int:
        """The input id of req's next decode step: a committed token, or a FutureMap placeholder."""
        if req.launched_len < req.committed_len:
            return req.token_at(req.launched_len)
        assert self.on("future_map"), "without the FutureMap the input token must be committed"
        return placeholder(req.row)  # batch n gathers what batch n-1 published in the FutureMap

    def _admit(self, req: Req) -> bool:
        """Admit if the KV pool can promise all the request may still need (less a cached prefix); else wait."""
        if self.req_to_token.free_count == 0 or \
                len(self.running.reqs) + len(self.prefilling) >= self.config.max_running_requests:
            return False
        # Match at most prefill_len - 1 tokens: the prefill must compute one, for its logits.
        matched, node = self.cache.match_prefix(req.committed_ids()[:req.prefill_len - 1])
        self.cache.lock(node)  # before the headroom: its own prefix must not count as evictable
        need = self.kv_ledger.promise(req, len(matched), self.kv_ledger.lookahead)
        if self._kv_headroom() < need:
            self.cache.unlock(node)
            return False
        req.prefix_node = node
        self.stats.cached_tokens += len(matched)
        req.cached_len = req.launched_len = req.kv_committed_len = len(matched)
        req.slot_ids = matched.tolist()
        self.kv_ledger.reserve(req, need)
        req.released = False  # a retracted request was released once already
        self.rows.assign(req)
        if req.cached_len:
            row = req.row
            # Keep-alive: the device copy is made inside the queued work, on the stream that reads
            # it; made here, the allocator could reuse its memory before the copy ran (readings §4).
            self.stream.launch(lambda: self.req_to_token.table[row, :len(matched)].copy_(
                matched.to(self.device, non_blocking=True)))
        return True

    def _kv_headroom(self) -> int:
        admission = self.features.admission
        if admission is None:
            return self.kv_ledger.headroom()
        return self.kv_ledger.headroom(admission.charged(self.running.reqs + self.prefilling))

    # ------------------------------------------------------------------ launch and commit
    def launch(self, planned: Planned) -> ForwardResult:
        forward = planned.forward
        with self.tracer.host(SpanName.LAUNCH, forward.batch_id):
            result = self.engine.launch(forward, after=self.stream)
        self.stats.batches += 1
        self.stats.events.append((SpanName.LAUNCH, forward.batch_id))
        if result.delayed is not None:  # the grammar seam: sample once batch n-1 is committed
            assert self.unsampled is None, "a batch launched before the previous one was sampled"
            self.unsampled = InFlight(planned.view.snapshot(), result)
            self._sample_if_ready()
        return result

    def _sample_if_ready(self) -> None:
        # The delayed sampling must be queued after n-1's commit (its masks need n-1's tokens)
        # and before batch n+1's forward, which reads n's tokens from the FutureMap.
        if self.unsampled is not None and self.rows.done_id == self.unsampled.result.batch_id - 1:
            unsampled, self.unsampled = self.unsampled, None
            self.features.grammar.launch(unsampled)

    def commit(self, inflight: InFlight, early: bool = False) -> None:
        """The commit point: outputs and token finishes change only here (an abort: _handle_aborts).
        `early`: committed before batch n launches, at a sync boundary."""
        view, result = inflight.view, inflight.result
        assert result.delayed is None, f"batch {result.batch_id}: its delayed sampling was never launched"
        self.stats.early_commits += early
        with self.tracer.host(SpanName.WAIT, result.batch_id):
            # >>> exercise 8: the host waits for copy_done
            result.copy_done.synchronize()  # the host may read the tokens, and the batch's device work is done
            # <<< exercise 8
        with self.tracer.host(SpanName.COMMIT, result.batch_id):
            if self.features.speculation is not None and not view.is_prefill:  # one row per accepted token
                view, result = self.features.speculation.accepted(view, result)
            self._commit_results(view, result)
        self._sample_if_ready()

    def _commit_results(self, view: BatchView | RunningBatch, result: ForwardResult) -> None:
        """Batch n-1's tokens become outputs, row by row of the view fixed at launch; what the
        one-step lag made stale is dropped. A finished request is released right here."""
        self.rows.committed(result.batch_id)
        self.stats.events.append((SpanName.COMMIT, result.batch_id))
        tokens = result.next_tokens_host.tolist()
        logprobs = {} if result.logprobs is None else \
            self.features.logprobs.by_row(view, result, tokens, self.on("logprob_snapshot"))
        for i, (req, row, generation, sampled, qo_len, token) in enumerate(zip(
                view.reqs, view.rows, view.generations, view.samples, view.qo_lens, tokens)):
            # >>> exercise 9: skip a retracted request's in-flight result
            if (req.row, req.row_generation) != (row, generation) and self.on("retract_skip_inflight"):
                # Retracted after this batch launched: its re-prefill samples this step again.
                self.stats.retracted_late_results += 1
                continue
            # <<< exercise 9
            if self.req_to_token.generation[row] != generation:
                # Recycled while this batch was in flight (ABA): only with deferred_row_free off.
                if self.on("row_generation_check"):
                    self.stats.stale_row_results += 1
                    continue
                # WRONG on purpose: trust the row, as a reader keyed by row alone would.
                req = self.rows.owner[row] or req
            # >>> exercise 4: skip_finished
            if req.finished and self.on("skip_finished"):
                # Overshoot: finished (at batch n-1, or aborted) while this batch was in flight.
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
        self.rows.free_deferred()

    # ------------------------------------------------------------------ release
    def _release(self, req: Req) -> None:
        """Give back a finished, aborted or retracted request's KV (checkpointed, tail freed), then its row."""
        self.kv_ledger.release(req)
        self.rows.free(req.row)

    def _retract(self, req: Req) -> None:
        """Back to waiting, KV released (optimistic admission: features/retraction.py decides whom)."""
        self.running.reqs.remove(req)
        self._release(req)
        req.reset_for_retract()
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        self.stats.events.append((SpanName.RETRACT, self.batch_builder.next_id))

    def _release_committed_aborts(self) -> None:
        for req in [r for r in self.releasing if not self.rows.in_flight(r.row)]:
            self.releasing.remove(req)
            if not req.released:  # commit_point_cache off may have released it at planning
                self._release(req)
            self.finished.append(req)

    def close(self) -> None:
        """Commit the batch in flight, unless an error stopped the scheduler."""
        if self.last is not None and self.error is None:
            last, self.last = self.last, None
            self.commit(last)
