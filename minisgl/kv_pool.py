"""KV memory: a pool of token slots and the request-to-token table (request-pool rows).

Every usable slot is in exactly one place (lessons/readings §1): the free list, a request's
row, or the radix cache. Page size 1: a slot holds one token's K and V in every layer."""

from __future__ import annotations

import torch


class KVAccountingError(RuntimeError):
    """A slot or row was freed twice, or more was freed than allocated."""


class KVPool:
    """Free list of `kv_tokens` usable KV slots, numbered 1..kv_tokens: slot 0 is reserved for the
    padded tokens of a CUDA-graph batch, so the cache has `kv_tokens + 1` slots and no request owns 0."""

    RESERVED_SLOT = 0

    def __init__(self, kv_tokens: int) -> None:
        self.kv_tokens = kv_tokens  # at least 3: the setting's range (settings.py)
        num_slots = kv_tokens + 1
        self.num_slots = num_slots
        # A stack: the most recently freed slot is handed out first, so reuse is immediate and
        # deterministic and a switched-off safety mechanism shows its hazard every time (§9).
        self._free: list[int] = list(range(num_slots - 1, 0, -1))
        # One byte per slot (1 = free) for double-free detection: a bytearray, cheaper than a tensor call per slot.
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
    """Request-pool rows: row r of `table` lists the KV slot of every position of one request (its FutureMap
    key too, lessons/readings §6). Each reuse bumps the row's generation, so a late reader detects ABA."""

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
