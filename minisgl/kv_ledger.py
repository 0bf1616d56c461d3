"""KV accounting in one place: what a request is promised, what is available, allocation, release.

Admission promises a request every slot it may still need (`promise`). The promise is counted
against what is available (free slots plus what the radix cache could evict) until the request
allocates its slots, one batch at a time; a release checkpoints the committed KV into the radix
cache and frees the rest. Under reserve admission a running request never runs out of slots;
optimistic admission (features/retraction.py) charges less and retracts when a step runs short.
"""

from __future__ import annotations

import torch

from .kv_pool import KVAccountingError, KVPool
from .mechanisms import Mechanisms
from .radix_cache import RadixCache
from .request import Req


class KVLedger:
    def __init__(self, kv_pool: KVPool, mechanisms: Mechanisms) -> None:
        self.kv_pool = kv_pool
        self.cache = RadixCache(kv_pool.free)
        self.mechanisms = mechanisms
        self.reserved = 0  # slots promised to admitted requests and not yet allocated

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.on(mechanism)

    @staticmethod
    def promise(req: Req, cached_len: int = 0) -> int:
        """Slots a request may still need: its prefill beyond the cached prefix, the outputs it may
        still produce, and the one slot an overshoot step writes past its last token."""
        return req.prefill_len - cached_len + req.max_new_tokens - len(req.output_ids) + 1

    def available(self) -> int:
        return self.kv_pool.free_count + self.cache.evictable_size

    def headroom(self, charged: int | None = None) -> int:
        """Slots a new request may be promised: what is available, less what the admitted requests
        are charged (everything they were promised, unless a policy charges less)."""
        return self.available() - (self.reserved if charged is None else charged)

    def check_fits(self, req: Req) -> None:
        """A request the pool could never hold is refused up front (admission would wait forever)."""
        need = self.promise(req)
        if need > self.kv_pool.kv_tokens:
            raise ValueError(f"request needs {need} KV slots (prompt {req.prompt_len} + max_new_tokens "
                             f"{req.max_new_tokens} + 1), the KV pool has {self.kv_pool.kv_tokens}; raise kv_tokens")

    def reserve(self, req: Req, need: int) -> None:
        req.reserved_tokens = need
        self.reserved += need

    def allocate(self, req: Req, n: int) -> list[int]:
        shortfall = n - self.kv_pool.free_count
        if shortfall > 0:
            self.cache.evict(shortfall)  # the promise (or a retraction) left this much evictable
        req.slot_ids += (slots := self.kv_pool.alloc(n))
        req.reserved_tokens -= n
        self.reserved -= n
        return slots

    # Slots of a request being released, by position (cached <= present <= written <= allocated):
    #   [0, cached)          the prefix matched at admission: the tree's slots; only unlocked
    #   [cached, present)    our copies of what the tree already holds: freed
    #   [present, written)   KV that committed batches wrote: handed to the tree (the checkpoint)
    #   [written, allocated) the tail no committed batch wrote (overshoot included): freed
    def release(self, req: Req) -> None:
        """Give back every slot a finished, aborted or retracted request holds (lessons/readings §9)."""
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
        # Freeing the tail while an overshoot step may still write it is safe: a new owner's
        # writes queue behind that step on the same stream.
        # >>> exercise 4: release by allocated length
        end = req.allocated_len if self.on("release_allocated") else written
        self.kv_pool.free(req.slot_ids[written:end])
        # <<< exercise 4
        self.reserved -= req.reserved_tokens
        req.reserved_tokens = 0
