"""KV accounting in one place: promises, availability, allocation, release (lessons/readings §9).

A promise counts against what is available (free slots plus the evictable cache) until allocated, so
under reserve admission a running request never runs out of slots (optimistic: features/retraction.py)."""

from __future__ import annotations

import torch

from .kv_pool import KVAccountingError, KVPool
from .mechanisms import Mechanisms
from .radix_cache import RadixCache
from .request import Req


class KVLedger:
    def __init__(self, kv_pool: KVPool, mechanisms: Mechanisms, lookahead: int = 1) -> None:
        self.kv_pool = kv_pool
        self.lookahead = lookahead  # slots a step may write past a request's last token (config.lookahead_slots)
        self.cache = RadixCache(kv_pool.free)
        self.mechanisms = mechanisms
        self.reserved = 0  # slots promised to admitted requests and not yet allocated

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.on(mechanism)

    @staticmethod
    def promise(req: Req, cached_len: int = 0, lookahead: int = 1) -> int:
        """Slots a request may still need: uncached prefill, remaining outputs, and `lookahead` (the overshoot)."""
        return req.prefill_len - cached_len + req.max_new_tokens - len(req.output_ids) + lookahead

    def available(self) -> int:
        return self.kv_pool.free_count + self.cache.evictable_size

    def headroom(self, charged: int | None = None) -> int:
        """Slots a new request may be promised: available, less what admitted requests are charged."""
        return self.available() - (self.reserved if charged is None else charged)

    def check_fits(self, req: Req) -> None:
        """A request the pool could never hold is refused up front (admission would wait forever)."""
        need = self.promise(req, 0, self.lookahead)
        if need > self.kv_pool.kv_tokens:
            raise ValueError(f"request needs {need} KV slots (prompt {req.prompt_len} + max_new_tokens "
                             f"{req.max_new_tokens} + {self.lookahead}): kv_tokens is {self.kv_pool.kv_tokens}, raise it")

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
        """Give back every slot a finished, aborted or retracted request holds."""
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
