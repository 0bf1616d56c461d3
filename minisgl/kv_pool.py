"""KV memory: a pool of token slots and the request-to-token table (request-pool rows).

Ownership is exact (the ownership that lessons/readings §1 starts from): every usable slot is
in exactly one place at any time: the free list, a request's row (private), or the radix
cache. `memory_report()` must therefore always satisfy, once no batch is in flight,
`kv_free + kv_cached + held_by_requests == kv_total`.

Page size is 1: a slot holds the K and V of one token in every layer.
"""

from __future__ import annotations

import torch


class KVAccountingError(RuntimeError):
    """A slot or row was freed twice, or more was freed than allocated."""


class KVPool:
    """Free list of `kv_tokens` usable KV slots, numbered 1..kv_tokens.

    Slot 0 is reserved: padded (dummy) tokens of a CUDA-graph batch read and write it, so
    the KV cache has `num_slots = kv_tokens + 1` entries and no request ever owns slot 0.
    """

    RESERVED_SLOT = 0

    def __init__(self, kv_tokens: int) -> None:
        self.kv_tokens = kv_tokens  # at least 3: the setting's range (settings.py)
        num_slots = kv_tokens + 1
        self.num_slots = num_slots
        # A stack: the most recently freed slot is handed out first. Reuse is therefore
        # immediate and deterministic, which is what makes the reuse hazards of the overlap
        # pipeline (lessons/readings §9) show up every time
        # a safety mechanism is switched off, rather than once in a while.
        self._free: list[int] = list(range(num_slots - 1, 0, -1))
        # One byte per slot (1 = free), for double-free detection. A bytearray, not a tensor:
        # a decode step allocates one slot per request, and a tensor call each would cost
        # tens of microseconds of host time per request.
        self._is_free = bytearray([1]) * num_slots
        self._is_free[self.RESERVED_SLOT] = 0

    @property
    def free_count(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVAccountingError(f"asked for {n} KV slots, {len(self._free)} free")
        slots = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        slots.reverse()
        for slot in slots:
            self._is_free[slot] = 0
        return slots

    def free(self, slots: list[int] | torch.Tensor) -> None:
        if isinstance(slots, torch.Tensor):
            slots = slots.tolist()
        if not slots:
            return
        already = sorted({s for s in slots if self._is_free[s]})
        if already or len(set(slots)) != len(slots):
            raise KVAccountingError(f"double free of KV slots {already[:8] or sorted(slots)[:8]}")
        for slot in slots:
            self._is_free[slot] = 1
        self._free.extend(reversed(slots))


class ReqToTokenPool:
    """Request-pool rows: row r of `table` lists the KV slot of every position of one request.

    A row is a request's stable address for its whole life: the KV page table, and the
    FutureMap mailbox key (lessons/readings §6). Each reuse bumps the row's
    generation so that a late reader can detect ABA reuse.
    """

    def __init__(self, max_running_requests: int, table_width: int, device: torch.device) -> None:
        self.max_running_requests = max_running_requests  # one row per running request
        self.table = torch.zeros(max_running_requests, table_width, dtype=torch.int64, device=device)
        self.generation = [0] * max_running_requests
        self._free: list[int] = list(range(max_running_requests - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise KVAccountingError("no free request-pool row")
        row = self._free.pop()
        self.generation[row] += 1
        return row

    def free_rows(self) -> list[int]:
        return list(self._free)

    def free(self, row: int) -> None:
        if row in self._free:
            raise KVAccountingError(f"double free of request-pool row {row}")
        self._free.append(row)
