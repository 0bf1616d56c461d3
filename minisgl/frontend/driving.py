"""How LLM runs the scheduler for its callers and hands the results out (a mixin of LLM).

A step's finished requests become results (`_store`), kept until a public call hands them out
(`_take_results`). generate() steps until its own requests are out (`_run_until_done`); undone
(guard.py), it abandons them: aborted, their results dropped when they come (`_abandon`).
"""

from __future__ import annotations

from typing import Callable

from ..invariants import memory_report
from ..kv_pool import KVAccountingError
from ..request import Req
from ..sampling_params import RequestOutput


class DrivingMixin:
    """LLM's scheduler-driving half: needs `scheduler`, `_reqs`, `_results`, `_abandoned`, `_output`."""

    def _abandon(self, reqs: list[Req]) -> None:
        """generate() undone: its requests aborted (the next drain frees them), results dropped."""
        for req in reqs:
            self._results.pop(req.rid, None)
            if req.rid in self._reqs:  # not finished yet (and queued)
                self._abandoned.add(req.rid)
                self.scheduler.abort(req)

    def _run_until_done(self, reqs: list[Req], on_step: Callable[[int], None] | None) -> list[RequestOutput]:
        mine = {req.rid for req in reqs}
        outputs: dict[int, RequestOutput] = {}
        while len(outputs) < len(mine):
            self._guard.held.deliver()  # a held-back Ctrl-C goes to its handler between two steps
            if not self.scheduler.has_work():
                # Only reachable with a mechanism switched off (e.g. batch_snapshot): results
                # went to the wrong requests and some can never be scheduled again.
                lost = sorted(mine - outputs.keys())
                raise RuntimeError(f"requests {lost[:8]} can no longer be scheduled: the scheduler lost "
                                   f"track of them (disabled: {sorted(self.scheduler.mechanisms.disabled)})")
            # Only this step's results are looked at: never every result so far (a long run's
            # host work per step would grow with the requests already finished).
            outputs.update((rid, self._results[rid]) for rid in self._step() if rid in mine)
            if on_step is not None:
                on_step(len(outputs))
        # Every request is out, but an overshoot step may still be in flight: commit it, so that
        # memory_report() shows the pool whole, unless the caller has other requests queued.
        while self.scheduler.has_work() and not self._reqs:
            self._guard.held.deliver()
            self._step()
        for rid in mine:  # handed out only now: a Ctrl-C before this point drops them (_abandon)
            del self._results[rid]
        return [outputs[req.rid] for req in reqs]

    def _step(self) -> list[int]:
        """One scheduler iteration; the requests that finished go to self._results (the public
        call around it holds Ctrl-C back until they are stored). An error (not a held-back
        Ctrl-C) stops the scheduler: it is raised here once, and every later call refuses (see
        _refuse); what finished before it is still stored, for collect(). Returns their ids."""
        if self._guard.stopping.is_set():  # the finalizer at interpreter exit waits for this (Guard.stop_calls)
            self._guard.park()
        nothing_in_flight, launched = self.scheduler.last is None, self.scheduler.stats.batches
        try:
            done = self.scheduler.step()
        except BaseException:
            if self._guard.stopping.is_set():
                # The engine was stopped under this running call: only the finalizer at interpreter
                # exit does that (close() refuses while a call runs), after waiting for it to park
                # in vain (a step longer than its bound). This daemon thread ends with the
                # interpreter instead of printing the stopped engine's error.
                self._guard.park()
            done, self.scheduler.finished = self.scheduler.finished, []  # finished before the error
            self._store(done)
            raise
        stored = self._store(done)
        if nothing_in_flight and self.scheduler.stats.batches == launched:
            self._check_not_stuck()
        return stored

    def _store(self, done: list[Req]) -> list[int]:
        """Turn the requests a step finished into results. A request finished twice is the
        double free a switched-off mechanism causes (skip_finished): detected, latched (the
        engine refuses further work), raised after every other result is stored."""
        twice, stored = [], []
        for req in done:
            if req.rid not in self._reqs:
                twice.append(req.rid)
                continue
            del self._reqs[req.rid]
            if req.rid in self._abandoned:
                self._abandoned.discard(req.rid)
            else:
                self._results[req.rid] = self._output(req)
                stored.append(req.rid)
        if twice:
            error = KVAccountingError(f"double free: request(s) {twice} finished and were released twice "
                                      f"(disabled: {sorted(self.scheduler.mechanisms.disabled)})")
            self.scheduler.error = self.scheduler.error or error
            raise error
        return stored

    def _check_not_stuck(self) -> None:
        """After a step that had nothing in flight and launched nothing: if requests still wait
        while nothing runs, no later step can admit them (nobody will free a slot or a row), and
        generate() or a step() loop would spin forever. With every mechanism on this cannot
        happen (admission promises, check_fits); it is a leak, e.g. release_allocated off."""
        s = self.scheduler
        if s.waiting and not (s.prefilling or s.running.reqs or s.releasing):
            mem = memory_report(s)
            raise RuntimeError(f"{len(s.waiting)} request(s) wait for KV slots or rows that nothing running will free "
                               f"(kv_free {mem['kv_free']} + kv_cached {mem['kv_cached']} of {mem['kv_total']}, "
                               f"rows_free {mem['rows_free']} of {mem['rows_total']}): leaked, see check_invariants() "
                               f"(disabled: {sorted(s.mechanisms.disabled)})")

    def _take_results(self) -> list[RequestOutput]:
        """Hand out every stored result; should the call not complete, they go back."""
        taken, self._results = self._results, {}
        self._guard.undo.append(lambda: self._results.update(taken))
        return list(taken.values())
