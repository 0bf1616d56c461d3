"""The scheduler: continuous batching, and the two event loops side by side.

Read `normal_loop` and `overlap_loop` first (bottom of the class): they share every other
method and differ only in *when* a batch's results are committed.

- normal_loop  (article 000 "串行调度", event_loop_normal): schedule, launch, wait, commit.
  The device idles while the host commits and schedules: the bubble.
- overlap_loop (article 000 "Overlap Scheduler 的执行时间线", article 001 overlap_loop):
  schedule batch n+1 and launch it while batch n still runs, then commit batch n. The host
  work hides behind device work; results are committed one step late.

The one-step lag must never change a token, leak a slot or corrupt a cache entry. Every
place that protects that is marked `self.on("<mechanism>")` with what breaks without it.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from .models.attention import KVCache
from .batch import BatchView, InFlight, Planned, RunningBatch, SchedulerStats
from .engine import Engine, ForwardBatch, ForwardResult
from .future_map import placeholder
from .kv_pool import KVAccountingError, KVPool, ReqToTokenPool
from .radix_cache import RadixCache
from .request import Req
from .staging import StagingRing
from .streams import make_host_stream


class Scheduler:
    def __init__(self, engine: Engine, *, eos_ids: frozenset[int], max_running: int, chunk_size: int,
                 kv_tokens: int, max_context: int, disabled: frozenset[str], loop: str,
                 host_delay_ms: float = 0.0) -> None:
        if loop not in ("normal", "overlap"):
            raise ValueError(f"loop must be 'normal' or 'overlap', got {loop!r}")
        self.engine = engine
        self.device = engine.device
        self.eos_ids = eos_ids
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.max_context = max_context
        self.disabled = disabled
        self.loop = loop
        self.host_delay_s = host_delay_ms / 1000.0
        self.stream = make_host_stream("scheduler", self.device)

        self.kv_pool = KVPool(kv_tokens + 1)
        self.req_to_token = ReqToTokenPool(max_running, max_context, self.device)
        self.cache = RadixCache(self.kv_pool.free)
        self.staging = StagingRing(max(chunk_size, max_running), max_running, self.device,
                                   double_buffer=self.on("staging_double_buffer"))
        engine.attach_memory(self._make_kv_cache(kv_tokens + 1), self.req_to_token)

        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully launched (chunked prefill)
        self.running = RunningBatch()
        self.finished: list[Req] = []  # finished, not yet collected by the caller
        self.last: InFlight | None = None  # overlap loop: the batch in flight, committed next step
        self.stats = SchedulerStats()
        self.tracer = engine.tracer

        self._next_batch_id = 0
        self._device_done_id = -1  # every batch up to this id has passed copy_done
        self._row_last_launch = [-1] * max_running
        self._deferred_rows: list[int] = []
        self._reserved = 0  # KV slots promised to admitted requests but not yet allocated

    def _make_kv_cache(self, num_slots: int) -> KVCache:
        m = self.engine.model
        return KVCache(m.num_layers, num_slots, m.num_kv_heads, m.head_dim, self.engine.dtype, self.device)

    def on(self, mechanism: str) -> bool:
        return mechanism not in self.disabled

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

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running.reqs or self.last)

    def step(self) -> list[Req]:
        """One loop iteration; returns the requests that finished during it."""
        self.tracer.iteration += 1
        if self.loop == "normal":
            self.normal_loop()
        else:
            self.last = self.overlap_loop(self.last)
        done, self.finished = self.finished, []
        return done

    def abort(self, req: Req) -> None:
        req.abort_requested = True  # acted on at the start of the next schedule

    # ------------------------------------------------------------------ the two loops
    def normal_loop(self) -> None:
        """Serial: the host waits for every batch before planning the next (event_loop_normal)."""
        planned = self.schedule()
        if planned is not None:
            result = self.launch(planned)
            self.commit(InFlight(planned.view, result))  # the device idles until we are done here

    def overlap_loop(self, last: InFlight | None) -> InFlight | None:
        """Pipelined: launch batch n+1, then commit batch n while n+1 runs (overlap_loop(last_data))."""
        # >>> exercise 1: write overlap_loop from normal_loop: schedule() batch n+1 and launch() it, keep
        # >>> InFlight(snapshot of planned.view, result), then commit(last) while n+1 runs; return the new
        # >>> InFlight (or None). Keep the switches: future_map off -> self._sync(last) before schedule();
        # >>> prefill_sync on and two prefills in a row -> self._sync(last) before launch(); batch_snapshot off
        # >>> -> keep the live RunningBatch as the view.
        if last is not None and not self.on("future_map"):
            # Without the device-side relay, n+1's input ids must come from committed host
            # tokens, so batch n is committed first: the bubble is back (article 000, "future token").
            last = self._sync(last)
        planned = self.schedule()
        if last is not None and planned is not None and planned.forward.is_prefill and last.view.is_prefill \
                and self.on("prefill_sync"):
            # Two prefills in a row: commit the first before launching the second, so its first
            # token is out one batch sooner (article 000, 「Overlap Scheduler 的执行时间线」: must_sync).
            last = self._sync(last)
        ongoing = None
        if planned is not None:
            result = self.launch(planned)
            # The queue keeps a snapshot: the live running batch will be filtered and merged by
            # the next schedule() before this result is committed. Holding the live batch would
            # zip batch n's tokens with batch n+1's requests (article 000, "batch.copy()").
            ongoing = InFlight(planned.view.snapshot() if self.on("batch_snapshot") else planned.view, result)
        if last is not None:
            self.commit(last)  # batch n-1's results, while batch n runs on the device
        return ongoing
        # <<< exercise 1

    def _sync(self, last: InFlight) -> None:
        self.stats.early_syncs += 1
        self.commit(last)
        return None

    # ------------------------------------------------------------------ scheduling (planning)
    def schedule(self) -> Planned | None:
        """Plan the next batch from committed state plus what is in flight. Prefill first."""
        with self.tracer.host("schedule"):
            if self.host_delay_s:
                # Emulated scheduler work (the lab's knob for C): counted as host time, like
                # the Python a real scheduler runs here. A sleep, so the device thread is not slowed.
                time.sleep(self.host_delay_s)
            self._handle_aborts()
            self.running.reqs[:] = [r for r in self.running.reqs if not r.finished]  # filter_batch
            return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Planned | None:
        budget = self.chunk_size
        chunks: list[tuple[Req, int]] = []
        for req in self.prefilling:  # continue chunked prompts first
            n = min(budget, req.prompt_len - req.launched_len)
            if n > 0:
                chunks.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            self.prefilling.append(req)
            n = min(budget, req.prompt_len - req.launched_len)
            chunks.append((req, n))
            budget -= n
        if not chunks:
            return None
        tokens: dict[str, list] = {k: [] for k in ("input_ids", "positions", "out_slots", "token_rows")}
        reqs, qo_lens, kv_lens, samples = [], [], [], []
        for req, n in chunks:
            start = req.launched_len
            tokens["input_ids"] += req.prompt_ids[start:start + n]
            tokens["positions"] += list(range(start, start + n))
            tokens["out_slots"] += self._alloc_slots(req, n)
            tokens["token_rows"] += [req.row] * n
            req.launched_len += n
            samples.append(req.prefill_launched)
            reqs.append(req)
            qo_lens.append(n)
            kv_lens.append(req.launched_len)
        for req, sampled in zip(reqs, samples):
            if sampled:  # prompt fully launched: decode from the next step, its first token via the FutureMap
                self.prefilling.remove(req)
                self.running.reqs.append(req)
        self.stats.prefill_batches += 1
        return self._plan(reqs, tokens, qo_lens, kv_lens, samples, is_prefill=True)

    def _schedule_decode(self) -> Planned | None:
        # Length lookahead: leave out requests whose launched samples already reach
        # max_new_tokens. Their last token is in flight; another step would be wasted overshoot
        # (article 000, "Overshoot": _reqs_finishing_inflight()).
        # >>> exercise 4: length lookahead: when length_lookahead is on, drop from self.running.reqs (in place) every
        # >>> request whose launched samples already reach max_new_tokens (Req.will_finish_by_length()).
        if self.on("length_lookahead"):
            self.running.reqs[:] = [r for r in self.running.reqs if not r.will_finish_by_length()]
        # <<< exercise 4
        if not self.running.reqs:
            return None
        tokens: dict[str, list] = {k: [] for k in ("input_ids", "positions", "out_slots", "token_rows")}
        for req in list(self.running.reqs):
            position = req.launched_len
            if position < req.committed_len:
                token = req.token_at(position)
            else:
                assert self.on("future_map"), "without the FutureMap the input token must be committed"
                token = placeholder(req.row)  # in flight: batch n+1 gathers it from the FutureMap
            if req.will_finish_by_length():
                self.stats.overshoot_steps += 1
            tokens["input_ids"].append(token)
            tokens["positions"].append(position)
            tokens["out_slots"] += self._alloc_slots(req, 1)
            tokens["token_rows"].append(req.row)
            req.launched_len += 1
            if not self.on("commit_point_cache") and len(req.output_ids) + req.inflight_samples + 1 >= req.max_new_tokens:
                # WRONG on purpose: hand the prefix to the cache and free the request's slots now,
                # when its final step is only planned. Requests later in this same batch are then
                # given the slots this step still reads and writes (article 000,
                # "缓存 checkpoint 与资源回收的安全点": release only after the last device use).
                self._release(req)
        reqs = list(self.running.reqs)
        n = len(reqs)
        self.stats.decode_batches += 1
        return self._plan(reqs, tokens, [1] * n, [r.launched_len for r in reqs], [True] * n, is_prefill=False)

    def _plan(self, reqs: list[Req], tokens: dict[str, list], qo_lens: list[int], kv_lens: list[int],
              samples: list[bool], is_prefill: bool) -> Planned:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        steps = []
        for req, sampled in zip(reqs, samples):
            steps.append(len(req.output_ids) + req.inflight_samples)  # output index of the sampled token
            req.inflight_samples += sampled
        params = [r.params for r in reqs]
        staging = self.staging.acquire()  # may wait: write-after-read barrier
        staging.write(**tokens, rows=[r.row for r in reqs], kv_lens=kv_lens,
                      qo_indptr=_cumsum(qo_lens), kv_indptr=_cumsum(kv_lens),
                      temperature=[p.temperature for p in params], top_p=[p.top_p for p in params],
                      top_k=[p.top_k for p in params], seeds=[r.sample_seed for r in reqs], sample_steps=steps)
        forward = ForwardBatch(batch_id, is_prefill, qo_lens, kv_lens, staging,
                               all_greedy=all(p.temperature == 0 for p in params))
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

        The promise (prompt + max_new_tokens + 1 overshoot slot, minus the cached prefix) means
        a running request never runs out of slots, so the engine never deadlocks and never has
        to retract. A request that could never fit was refused by `add()`.
        """
        if self.req_to_token.free_count == 0 or len(self.running.reqs) + len(self.prefilling) >= self.max_running:
            return False
        matched, node = self.cache.match_prefix(req.prompt_ids[:-1])  # compute >= 1 token: we need logits
        self.cache.lock(node)
        need = req.prompt_len - len(matched) + req.max_new_tokens + 1
        if self.kv_pool.free_count + self.cache.evictable_size - self._reserved < need:
            self.cache.unlock(node)
            return False
        req.prefix_node = node
        self.stats.cached_tokens += len(matched)
        req.cached_len = req.launched_len = req.kv_committed_len = len(matched)
        req.slot_ids = matched.tolist()
        req.reserved_tokens = need
        self._reserved += need
        req.row = self.req_to_token.alloc()
        req.row_generation = self.req_to_token.generation[req.row]
        if req.cached_len:
            row, slots = req.row, matched.to(self.device)
            # The scheduler writes the cached prefix into the row (the engine writes new slots).
            self.stream.launch(lambda: self.req_to_token.table[row, :len(slots)].copy_(slots))
        return True

    def _alloc_slots(self, req: Req, n: int) -> list[int]:
        shortfall = n - self.kv_pool.free_count
        if shortfall > 0:
            self.cache.evict(shortfall)  # the admission promise guarantees this suffices
        slots = self.kv_pool.alloc(n)
        req.slot_ids += slots
        req.reserved_tokens -= n
        self._reserved -= n
        return slots

    # ------------------------------------------------------------------ launch and commit
    def launch(self, planned: Planned) -> ForwardResult:
        forward = planned.forward
        with self.tracer.host("launch", forward.batch_id):
            result = self.engine.launch(forward, after=self.stream)
        for row in planned.view.rows:
            self._row_last_launch[row] = forward.batch_id
        self.stats.batches += 1
        self.stats.events.append(("launch", forward.batch_id))
        return result

    def commit(self, inflight: InFlight) -> None:
        """The commit point of batch n: the only place outputs, finish state and ownership change."""
        view, result = inflight.view, inflight.result
        with self.tracer.host("wait", result.batch_id):
            result.copy_done.synchronize()  # the host may read the tokens, and batch n's device work is done
        with self.tracer.host("commit", result.batch_id):
            self._commit_results(view, result)

    def _commit_results(self, view: BatchView | RunningBatch, result: ForwardResult) -> None:
        self._device_done_id = max(self._device_done_id, result.batch_id)
        self.stats.events.append(("commit", result.batch_id))
        tokens = result.next_tokens_host.tolist()
        for req, row, generation, sampled, qo_len, token in zip(view.reqs, view.rows, view.generations,
                                                                view.samples, view.qo_lens, tokens):
            if row >= 0 and self.req_to_token.generation[row] != generation:
                # The row was recycled while this batch was in flight: a late reader (ABA). Only
                # reachable with deferred_row_free off; the generation is how we detect it.
                self.stats.stale_row_results += 1
                continue
            # >>> exercise 4: skip_finished: when it is on and req already finished (EOS one batch earlier, or aborted),
            # >>> this late result is not an output: count it in self.stats.overshoot_tokens and skip the row.
            if req.finished and self.on("skip_finished"):
                # Overshoot: the request finished (EOS at batch n-1, or aborted) while this step
                # was already in flight. Its token is not an output (article 000, "Overshoot").
                self.stats.overshoot_tokens += 1
                continue
            # <<< exercise 4
            req.kv_committed_len += qo_len
            if not sampled:
                continue
            req.inflight_samples -= 1
            finished_before = req.finished  # only possible with skip_finished off
            req.commit_token(token)
            # >>> exercise 5: the commit point: if commit_token() finished req, release it here (unless it was already
            # >>> released, e.g. by an abort; a second finish, finished_before, must call _release again so that
            # >>> the double free is reported) and append it to self.finished.
            if req.finished:
                if finished_before or not req.released:
                    self._release(req)  # a second finish is a double free, and _release says so
                self.finished.append(req)
            # <<< exercise 5
        self._free_deferred_rows()

    def _release(self, req: Req) -> None:
        """Give back everything a finished request holds, in the order of article 000's safe point:
        checkpoint committed KV into the radix cache, unlock the old path, free the private tail
        (overshoot included), then the row."""
        if req.released:
            raise KVAccountingError(f"double free: request {req.rid} released twice")
        req.released = True
        # >>> exercise 5: checkpoint: written = positions whose KV committed batches wrote, min(req.kv_committed_len,
        # >>> req.committed_len); insert those committed ids and their slots (an int64 tensor) into self.cache;
        # >>> insert() returns how much the tree already had: free our slots from req.cached_len up to it;
        # >>> then unlock req.prefix_node. The code below needs `written`.
        written = min(req.kv_committed_len, req.committed_len)  # positions whose KV committed batches wrote
        slots = req.slot_ids[:written]
        present = self.cache.insert(req.committed_ids()[:written], torch.tensor(slots, dtype=torch.int64))
        self.kv_pool.free(slots[req.cached_len:present])  # our copies of what the tree already had
        self.cache.unlock(req.prefix_node)
        # <<< exercise 5
        # The tail beyond the committed KV: the overshoot slot and any planned-but-unused slot.
        # Freeing it while the overshoot step may still write it is safe: any new owner's writes
        # are queued behind that step on the same stream.
        # >>> exercise 4: free the private tail req.slot_ids[written:end] to self.kv_pool, where end is
        # >>> req.allocated_len (covers the overshoot slot) when release_allocated is on, else written.
        end = req.allocated_len if self.on("release_allocated") else written
        self.kv_pool.free(req.slot_ids[written:end])
        # <<< exercise 4
        self._reserved -= req.reserved_tokens
        req.reserved_tokens = 0
        self._free_row(req.row)

    def _free_row(self, row: int) -> None:
        # A batch still in flight may write this row (an overshoot step records its new slot in
        # the request table on the device). Reusing the row before that batch is done would let
        # the old request's late write land in the new request's row (ABA; article 000,
        # "请求行的释放也比普通循环敏感").
        # >>> exercise 6: a row last launched in a batch that has not passed copy_done (self._row_last_launch[row] >
        # >>> self._device_done_id) goes to self._deferred_rows while deferred_row_free is on; otherwise
        # >>> self.req_to_token.free(row) now.
        if self.on("deferred_row_free") and self._row_last_launch[row] > self._device_done_id:
            self._deferred_rows.append(row)
        else:
            self.req_to_token.free(row)
        # <<< exercise 6

    def _free_deferred_rows(self) -> None:
        # >>> exercise 6: free every deferred row whose last launched batch has now passed copy_done; keep the others.
        still = []
        for row in self._deferred_rows:
            if self._row_last_launch[row] > self._device_done_id:
                still.append(row)
            else:
                self.req_to_token.free(row)
        self._deferred_rows = still
        # <<< exercise 6

    def _handle_aborts(self) -> None:
        for req in [r for r in self.waiting if r.abort_requested]:
            self.waiting.remove(req)
            req.finish_reason = "abort"
            self.finished.append(req)
        for req in [r for r in self.prefilling + self.running.reqs if r.abort_requested and not r.finished]:
            # Queued results of this request are dropped at commit (skip_finished).
            req.finish_reason = "abort"
            if req in self.prefilling:
                self.prefilling.remove(req)
            self._release(req)
            self.finished.append(req)

    # ------------------------------------------------------------------ accounting
    def memory_report(self) -> dict[str, int]:
        return {
            "kv_total": self.kv_pool.total,
            "kv_free": self.kv_pool.free_count,
            "kv_cached": self.cache.total_size,
            "rows_total": self.req_to_token.num_rows,
            "rows_free": self.req_to_token.free_count,
        }

    def flush_cache(self) -> int:
        return self.cache.flush()

    def close(self) -> None:
        while self.last is not None:
            self.step()
        self.engine.stream.close()


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
