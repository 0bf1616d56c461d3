"""Giving back what a request holds, at the safe point (a part of the Scheduler, kept apart).

A finished, aborted or retracted request hands its committed KV to the radix cache (the
checkpoint), frees its private tail (overshoot slot included) and gives back its row. The row
waits for the last batch in flight that uses it (deferred row free); an aborted request waits,
whole, for the commit of its last batch. `_row_last_launch` (set at launch) against
`_device_done_id` (set at commit) says which batches are still in flight (lesson 7).

A mixin: `Scheduler` inherits these methods; the state they use is set in `Scheduler.__init__`.
"""

from __future__ import annotations

import torch

from .kv_pool import KVAccountingError
from .request import Req


class ReleaseMixin:
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
