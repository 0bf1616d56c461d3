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

One iteration is schedule(), launch() and commit(), all here. Their details live beside this
file, as parts of this class (mixins: Scheduler inherits their methods, the state they use is
set in __init__ below):
- planning.py        what schedule() calls: chunked prefill, admission, decode steps, retraction,
                     the staging write (`_plan`);
- commit_results.py  what commit() calls: batch n-1's tokens become outputs, stale results dropped;
- release.py         the safe point: a request's KV checkpointed into the radix cache, its tail
                     and row given back (the row deferred while a batch in flight uses it), aborts.
"""

from __future__ import annotations

import os
import time
from collections import deque

from .admission import NewTokenRatio, PrefillGate
from .batch import InFlight, Planned, RunningBatch, SchedulerStats
from .commit_results import CommitResultsMixin
from .config import EngineConfig
from .engine import Engine, ForwardResult
from .grammar import build_mask
from .interrupts import atomic_step
from .invariants import check_invariants
from .planning import PlanningMixin
from .radix_cache import RadixCache
from .release import ReleaseMixin
from .request import Req
from .staging import StagingRing
from .streams import make_host_stream
from .tracer import SpanName


class Scheduler(PlanningMixin, CommitResultsMixin, ReleaseMixin):
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
        self.prefill_gate = PrefillGate(config.min_prefill_tokens, max_running_requests)

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
        """The sync boundaries: whether batch n-1 (`last`) must be committed before batch n.

        overlap_loop asks twice per call: before schedule() (`planned` None) and after it. When
        the answer is True, the loop commits `last` at once with commit(last, early=True), and
        then has no batch in flight. Never True without a batch in flight. It is True

        - before planning, when the FutureMap is off: batch n's input ids must then be committed
          host tokens, so the bubble is back (lesson 4; lessons/readings §6);
        - after planning, when n-1 and n are both prefills and prefill_sync is on: commit the
          first so its first tokens are out one batch sooner (lesson 8; lessons/readings §3;
          SGLang's default differs: §14).
        """
        if last is None:
            return False
        if planned is None:
            return not self.on("future_map")
        return planned.forward.is_prefill and last.view.is_prefill and self.on("prefill_sync")

    # ------------------------------------------------------------------ requests in and out
    def check_fits(self, req: Req) -> None:
        """A request the KV pool could never hold is refused up front (admission would wait forever)."""
        need = req.prompt_len + req.max_new_tokens + 1
        if need > self.kv_pool.kv_tokens:
            raise ValueError(f"request needs {need} KV slots (prompt {req.prompt_len} + max_new_tokens "
                             f"{req.max_new_tokens} + 1), the KV pool has {self.kv_pool.kv_tokens}; raise kv_tokens")

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

    def close(self) -> None:
        """Commit the batch in flight, unless an error stopped the scheduler (LLM.close() then
        stops the engine and frees its memory)."""
        if self.last is not None and self.error is None:
            last, self.last = self.last, None
            self.commit(last)
