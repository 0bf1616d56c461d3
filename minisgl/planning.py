"""Planning batch n: the methods behind `Scheduler.schedule()` (a part of the Scheduler, kept apart).

A prefill batch first (chunked prompts continue, then admission of waiting requests), else one
decode step for every running request; then `_plan` numbers the batch and writes its metadata
into a staging buffer. Planning reads committed state plus what is in flight (`launched_len`,
`inflight_samples`), never a token the host has not committed: the input id of an in-flight
token is a FutureMap placeholder. Admission promises KV slots, and a decode step that runs short
retracts requests (admission="optimistic", lesson 10).

A mixin: `Scheduler` inherits these methods; the state they use is set in `Scheduler.__init__`.
"""

from __future__ import annotations

from itertools import accumulate

from .admission import optimistic_charge
from .batch import BatchView, Planned, RunningBatch
from .engine import ForwardBatch
from .future_map import placeholder
from .grammar import build_mask
from .logprobs import logprob_rows, output_index
from .request import Req
from .staging import TokenColumns
from .tracer import SpanName


class PlanningMixin:
    # ------------------------------------------------------------------ the batch: prefill or decode
    def _schedule_prefill(self) -> Planned | None:
        budget = self.config.chunk_size
        chunks: list[tuple[Req, int]] = []
        for req in self.prefilling:  # continue chunked prompts first
            n = min(budget, req.prefill_len - req.launched_len)
            if n > 0:
                chunks.append((req, n))
                budget -= n
        # On a GPU, new requests wait until their prefill is worth a launch (admission.PrefillGate).
        gate_open = self.prefill_gate.is_open(self.waiting, running=len(self.running.reqs), prefilling=len(self.prefilling),
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
        self.stats.prefill_tokens += sum(qo_lens)
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
        if self._kv_headroom() < need:
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

    def _kv_headroom(self) -> int:
        """KV slots a new request may be promised: free or evictable, less what the admitted ones
        are counted as still needing (all of it with "reserve", `optimistic_charge` otherwise)."""
        if self.config.admission == "reserve":
            promised = self._reserved
        else:
            promised = optimistic_charge(self.running.reqs + self.prefilling, self.new_token_ratio.current)
        return self.kv_pool.free_count + self.cache.evictable_size - promised

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
