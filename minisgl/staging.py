"""Host staging buffers for one batch's metadata, and their write-after-read protection.

The scheduler writes a batch's metadata (input ids, positions, KV slots, sampling
parameters) into host buffers; the engine stream copies them to the device when it reaches
the batch. In the overlap loop the host is already writing batch n+1 while batch n may
not have been copied yet. Two protections, each a switch here (lessons/readings §4 says how
they differ from the article's stream-side WAR barrier and its keep-alive buffer):

- `staging_double_buffer`: two buffers alternate, so batch n+1 never lands in batch n's;
- `staging_war_wait`: before a buffer is rewritten, the host waits for the event recorded
  right after the device read it (the write-after-read barrier).

Either one alone keeps the tokens right in this scheduler: the wait alone by waiting, the
second buffer alone because batch n is committed (so read) before batch n+2 is planned.
`unread_overwrites` counts the rewrites of a buffer the device had not read yet: the hazard
itself, whether or not it happened to change a token (lessons/readings §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .mechanisms import Mechanisms
from .streams import Event

TOKEN_FIELDS = ("input_ids", "positions", "out_slots", "token_rows")
REQUEST_FIELDS = ("rows", "kv_lens", "top_k", "seeds", "sample_steps")
INDPTR_FIELDS = ("qo_indptr", "kv_indptr")
FLOAT_FIELDS = ("temperature", "top_p")


@dataclass
class TokenColumns:
    """One batch's per-token metadata, built by the scheduler (the TOKEN_FIELDS of a buffer)."""

    input_ids: list[int] = field(default_factory=list)  # token ids, or FutureMap placeholders
    positions: list[int] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)  # KV slot each token's K/V is written to
    token_rows: list[int] = field(default_factory=list)  # request-pool row of each token

    def add(self, row: int, input_ids: list[int], start: int, out_slots: list[int]) -> None:
        """Append the tokens at positions start, start+1, ... of the request in `row`."""
        self.input_ids += input_ids
        self.positions += range(start, start + len(input_ids))
        self.out_slots += out_slots
        self.token_rows += [row] * len(input_ids)


@dataclass
class DeviceInputs:
    """A batch's metadata after the host-to-device copy, as the forward reads it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    token_rows: torch.Tensor
    rows: torch.Tensor
    kv_lens: torch.Tensor
    top_k: torch.Tensor
    seeds: torch.Tensor
    sample_steps: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor


class StagingBuffer:
    """One set of host columns, big enough for the largest batch: views into two blocks (int64,
    float32), so that the device copy is two transfers, not one per column."""

    def __init__(self, max_tokens: int, max_reqs: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        int_sizes = {**{f: max_tokens for f in TOKEN_FIELDS}, **{f: max_reqs for f in REQUEST_FIELDS},
                     **{f: max_reqs + 1 for f in INDPTR_FIELDS}}
        self.blocks: dict[torch.dtype, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}  # each column a view of its block (offset: storage_offset())
        for dtype, sizes in ((torch.int64, int_sizes), (torch.float32, {f: max_reqs for f in FLOAT_FIELDS})):
            self.blocks[dtype] = torch.zeros(sum(sizes.values()), dtype=dtype, pin_memory=pin)
            self.host.update(zip(sizes, self.blocks[dtype].split(list(sizes.values()))))
        # numpy views of the same (pinned) memory: a Python list is written into them about 3x
        # faster than through torch.tensor(list) (a decode step at 256 requests writes 13 columns).
        self._host_np = {f: t.numpy() for f, t in self.host.items()}
        self.consumed: Event | None = None  # recorded on the engine stream after the device copy

    def write(self, tokens: TokenColumns, **columns: list[int] | list[float]) -> None:
        for name, values in {**vars(tokens), **columns}.items():
            self._host_np[name][: len(values)] = values

    def to_device(self, num_tokens: int, num_reqs: int) -> DeviceInputs:
        """Runs on the engine stream: the read that the write-after-read wait protects."""
        on_device = {dtype: block.to(self.device, non_blocking=True) if self.device.type == "cuda" else block.clone()
                     for dtype, block in self.blocks.items()}

        def column(name: str) -> torch.Tensor:
            n = num_tokens if name in TOKEN_FIELDS else num_reqs + (name in INDPTR_FIELDS)
            host = self.host[name]
            start = host.storage_offset()
            return on_device[host.dtype][start:start + n]
        return DeviceInputs(**{name: column(name) for name in self.host})


class StagingRing:
    def __init__(self, max_tokens: int, max_reqs: int, device: torch.device, mechanisms: Mechanisms) -> None:
        count = 2 if mechanisms.on("staging_double_buffer") else 1
        self.buffers = [StagingBuffer(max_tokens, max_reqs, device) for _ in range(count)]
        self.war_wait = mechanisms.on("staging_war_wait")
        self._next = 0
        self.waits = 0  # acquires that had to wait for the device to read the buffer
        self.unread_overwrites = 0  # acquires that rewrote a buffer the device had not read: the hazard

    def acquire(self) -> StagingBuffer:
        buf = self.buffers[self._next]
        self._next = (self._next + 1) % len(self.buffers)
        # >>> exercise 7: staging write-after-read wait
        if buf.consumed is not None and not buf.consumed.query():
            # The device has not copied what this buffer holds for an earlier batch yet.
            # Write-after-read barrier: wait for it. Without the wait, the rewrite below
            # races the device's read, and the batch in flight may run on the new metadata.
            if self.war_wait:
                self.waits += 1
                buf.consumed.synchronize()
            else:
                self.unread_overwrites += 1
        # <<< exercise 7
        return buf
