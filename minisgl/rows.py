"""Request rows and the batches in flight that still use them (lesson 7).

A row (request-table line and FutureMap mailbox) is reused only after the last batch planned with it
was committed: an overshoot step may still write it. `in_flight` is the one test of that in minisgl."""

from __future__ import annotations

from .kv_pool import ReqToTokenPool
from .mechanisms import Mechanisms
from .request import Req


class RowTracker:
    def __init__(self, req_to_token: ReqToTokenPool, mechanisms: Mechanisms) -> None:
        self.req_to_token = req_to_token
        self.mechanisms = mechanisms
        rows = req_to_token.max_running_requests
        self.last_launch = [-1] * rows  # the id of the newest batch planned with each row (and so launched)
        self.done_id = -1  # every batch up to this id has passed copy_done (set as its commit begins)
        self.owner: list[Req | None] = [None] * rows
        self.deferred_rows: list[int] = []  # freed by their request, still used by a batch in flight

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.on(mechanism)

    def in_flight(self, row: int) -> bool:
        """Whether a planned or launched batch that uses `row` has not been committed yet."""
        return self.last_launch[row] > self.done_id

    def assign(self, req: Req) -> None:
        req.row = self.req_to_token.alloc()
        req.row_generation = self.req_to_token.generation[req.row]
        self.owner[req.row] = req

    def planned(self, rows: list[int], batch_id: int) -> None:
        for row in rows:
            self.last_launch[row] = batch_id

    def committed(self, batch_id: int) -> None:
        self.done_id = max(self.done_id, batch_id)

    def free(self, row: int) -> None:
        self.owner[row] = None
        # Reusing a row a batch in flight may still write lets the old request's late write land in the new
        # request's row (ABA; lessons/readings §9).
        # >>> exercise 6: deferred row free
        if self.on("deferred_row_free") and self.in_flight(row):
            self.deferred_rows.append(row)
        else:
            self.req_to_token.free(row)
        # <<< exercise 6

    def free_deferred(self) -> None:
        # >>> exercise 6: free deferred rows
        still = []
        for row in self.deferred_rows:
            if self.in_flight(row):
                still.append(row)
            else:
                self.req_to_token.free(row)
        self.deferred_rows = still
        # <<< exercise 6
