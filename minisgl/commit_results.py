"""Batch n-1's results become outputs: the methods behind `Scheduler.commit()` (a part of the
Scheduler, kept apart).

`_commit_results` is the one place where tokens are appended and token finishes happen (an abort
finishes at planning: release.py). It walks the batch view that was fixed at launch, row by row,
and drops what the one-step lag made stale: the result of a request retracted since its launch,
of a recycled row, or of a request that already finished (overshoot). A finished request is
released right here, at its commit point (release.py).

A mixin: `Scheduler` inherits these methods; the state they use is set in `Scheduler.__init__`.
"""

from __future__ import annotations

from .batch import BatchView, RunningBatch
from .engine import ForwardResult
from .logprobs import output_index
from .request import TokenLogprob
from .tracer import SpanName


class CommitResultsMixin:
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
