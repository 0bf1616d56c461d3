"""Host staging buffers for one batch's metadata, and their write-after-read protection.

The host writes batch n+1's metadata while the device may not have copied batch n's yet (lessons/readings
§4): `staging_double_buffer` (two buffers alternate) or `staging_war_wait` (wait for the event recorded
after the device read) each keeps the tokens right; `unread_overwrites` counts the hazard itself."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

import torch

from .mechanisms import Mechanisms
from .streams import Event


class Length(Enum):
    """How many entries of a staging column one batch uses."""

    TOKENS = "tokens"  # one per new token
    REQUESTS = "requests"  # one per request
    INDPTR = "indptr"  # one per request, plus the leading 0


def column(length: Length, dtype: torch.dtype = torch.int64):
    """A DeviceInputs field that is also a staging column: its length and its host dtype."""
    return field(metadata={"length": length, "dtype": dtype})


@dataclass
class DeviceInputs:
    """A batch's metadata on the device, as the forward reads it; every field is a staging column."""

    input_ids: torch.Tensor = column(Length.TOKENS)  # token ids, or FutureMap placeholders
    positions: torch.Tensor = column(Length.TOKENS)
    out_slots: torch.Tensor = column(Length.TOKENS)  # KV slot each token's K/V is written to
    token_rows: torch.Tensor = column(Length.TOKENS)  # request-pool row of each token
    rows: torch.Tensor = column(Length.REQUESTS)
    kv_lens: torch.Tensor = column(Length.REQUESTS)
    top_k: torch.Tensor = column(Length.REQUESTS)
    seeds: torch.Tensor = column(Length.REQUESTS)
    sample_steps: torch.Tensor = column(Length.REQUESTS)
    qo_indptr: torch.Tensor = column(Length.INDPTR)
    kv_indptr: torch.Tensor = column(Length.INDPTR)
    temperature: torch.Tensor = column(Length.REQUESTS, torch.float32)
    top_p: torch.Tensor = column(Length.REQUESTS, torch.float32)


COLUMNS: dict[str, Length] = {f.name: f.metadata["length"] for f in fields(DeviceInputs)}
COLUMN_DTYPES: dict[str, torch.dtype] = {f.name: f.metadata["dtype"] for f in fields(DeviceInputs)}


@dataclass
class TokenColumns:
    """One batch's per-token metadata, built by the scheduler (the TOKENS columns of a buffer)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)
    token_rows: list[int] = field(default_factory=list)

    def add(self, row: int, input_ids: list[int], start: int, out_slots: list[int]) -> None:
        """Append the tokens at positions start, start+1, ... of the request in `row`."""
        self.input_ids += input_ids
        self.positions += range(start, start + len(input_ids))
        self.out_slots += out_slots
        self.token_rows += [row] * len(input_ids)


# write() stores TokenColumns' lists into the columns of the same names: the two must agree.
assert [f.name for f in fields(TokenColumns)] == [n for n, length in COLUMNS.items() if length is Length.TOKENS]


def batch_length(length: Length, num_tokens: int, num_reqs: int) -> int:
    return {Length.TOKENS: num_tokens, Length.REQUESTS: num_reqs, Length.INDPTR: num_reqs + 1}[length]


class StagingBuffer:
    """Host columns for the largest batch: views into one block per dtype, so the device copy is two transfers."""

    def __init__(self, max_tokens: int, max_running_requests: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.blocks: dict[torch.dtype, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}  # each column a view of its block (offset: storage_offset())
        for dtype in dict.fromkeys(COLUMN_DTYPES.values()):
            sizes = {name: batch_length(length, max_tokens, max_running_requests) for name, length in COLUMNS.items()
                     if COLUMN_DTYPES[name] == dtype}
            self.blocks[dtype] = torch.zeros(sum(sizes.values()), dtype=dtype, pin_memory=pin)
            self.host.update(zip(sizes, self.blocks[dtype].split(list(sizes.values()))))
        # numpy views of the same memory: a list is written into them faster than through torch.tensor(list).
        self._host_np = {f: t.numpy() for f, t in self.host.items()}
        self.consumed: Event | None = None  # recorded on the engine stream after the device copy

    def write(self, tokens: TokenColumns, **columns: list[int] | list[float]) -> None:
        """Write one batch's metadata: every column, each with the batch's length. A column left
        out, or left short, would make the forward read the previous batch's values there."""
        written = {**vars(tokens), **columns}
        assert written.keys() == COLUMNS.keys(), f"staging columns missing: {sorted(COLUMNS.keys() - written.keys())}, " \
                                                 f"unknown: {sorted(written.keys() - COLUMNS.keys())}"
        num_tokens, num_reqs = len(tokens.input_ids), len(columns["rows"])
        for name, values in written.items():
            expected = batch_length(COLUMNS[name], num_tokens, num_reqs)
            assert len(values) == expected, f"staging column {name} has {len(values)} values, the batch needs {expected}"
            self._host_np[name][: len(values)] = values

    def to_device(self, num_tokens: int, num_reqs: int) -> DeviceInputs:
        """Runs on the engine stream: the read that the write-after-read wait protects."""
        on_device = {dtype: block.to(self.device, non_blocking=True) if self.device.type == "cuda" else block.clone()
                     for dtype, block in self.blocks.items()}

        def device_column(name: str) -> torch.Tensor:
            host = self.host[name]
            start = host.storage_offset()
            return on_device[host.dtype][start:start + batch_length(COLUMNS[name], num_tokens, num_reqs)]
        return DeviceInputs(**{name: device_column(name) for name in COLUMNS})


class StagingRing:
    def __init__(self, max_tokens: int, max_running_requests: int, device: torch.device,
                 mechanisms: Mechanisms) -> None:
        count = 2 if mechanisms.on("staging_double_buffer") else 1
        self.buffers = [StagingBuffer(max_tokens, max_running_requests, device) for _ in range(count)]
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
