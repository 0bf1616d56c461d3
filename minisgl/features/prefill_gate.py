"""The prefill gate (GPU): admit new requests while others decode only when their prefill is
worth a launch. Plugged in when `min_prefill_tokens` > 0 (the GPU's default); the CPU's lessons
count batches and run without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..kv_ledger import KVLedger
from ..request import Req

# Open the gate anyway once this share of the rows is free (the running batch drained to 7/8 of
# max_running_requests): where the target cannot be reached (short prompts, a small KV pool) the
# decode batch still stays nearly full.
GATE_DRAIN_FRACTION = 0.875


@dataclass(frozen=True)
class PrefillGate:
    """Whether new requests may be admitted now, while others decode.

    On a GPU an eager prefill batch costs a fixed host time to launch whatever its size, up to a
    few thousand tokens (benchmarks/RESULTS.md). Admitted as running requests finish, one or two
    at a time, every prefill batch would be that fixed cost. The gate lets requests in only when
    the batch they form is worth a launch. It is open when:

    - nothing decodes (the device would idle: never stall);
    - a chunked prompt continues (`prefilling`: the batch launches anyway, new requests ride along);
    - the requests that fit now form at least `target` prompt tokens;
    - the waiting queue holds fewer than `target` tokens in all (slow arrivals: waiting for
      more would only add latency, without bound in an online workload);
    - the running batch has drained to GATE_DRAIN_FRACTION of max_running_requests.

    "Fit now" is an estimate made before admitting: a free row each and their whole KV promise
    against `kv_headroom`, in queue order, as `Scheduler._admit` takes them, but without the
    radix cache's prefix matches (a lookup locks nodes): a cached prefix makes the real batch
    smaller and its promise smaller. The gate only delays admission, `_admit` still decides it.
    """

    target: int  # prompt tokens a prefill batch should reach (> 0: a gate of 0 is not plugged in)
    max_running_requests: int

    def is_open(self, waiting: Iterable[Req], *, running: int, prefilling: int, free_rows: int,
                kv_headroom: Callable[[], int]) -> bool:
        """`running`, `prefilling`: requests decoding, and admitted with a prompt left to launch;
        `free_rows`: the request table's free rows; `kv_headroom()`: the slots a new request may be
        promised (`KVLedger.headroom`), asked only when the queue must be walked (optimistic
        admission sums over every running request)."""
        if running == 0 or prefilling > 0:
            return True
        if running <= GATE_DRAIN_FRACTION * self.max_running_requests:
            return True
        free_rows = min(free_rows, self.max_running_requests - running - prefilling)
        queued = fitting = 0  # prompt tokens in the queue so far, and of the requests that fit
        fits, headroom = True, kv_headroom()
        for req in waiting:
            queued += req.prefill_len
            need = KVLedger.promise(req)  # the admission promise, without a cached prefix
            fits = fits and free_rows > 0 and need <= headroom
            if fits:
                fitting += req.prefill_len
                free_rows -= 1
                headroom -= need
            if fitting >= self.target:
                return True
            if not fits and queued >= self.target:
                return False
        return queued < self.target
