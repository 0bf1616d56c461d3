"""Host staging buffers for one batch's metadata, and their write-after-read protection.

The scheduler writes a batch's metadata (input ids, positions, KV slots, sampling
parameters) into host buffers; the engine stream copies them to the device when it reaches
the batch. In the overlap loop the host is already writing batch n+1 while batch n may
not have been copied yet, so one buffer is not enough: buffers alternate, and before a
buffer is rewritten the host waits for the event recorded right after the device read it
(article 000: `_apply_war_barrier()` and the two-slot keep-alive buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .streams import Event

TOKEN_FIELDS = ("input_ids", "positions", "out_slots", "token_rows")
REQUEST_FIELDS = ("rows", "kv_lens", "top_k", "seeds", "sample_steps")
INDPTR_FIELDS = ("qo_indptr", "kv_indptr")
FLOAT_FIELDS = ("temperature", "top_p")


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
    """One set of host tensors, big enough for the largest batch."""

    def __init__(self, max_tokens: int, max_reqs: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        sizes = {**{f: max_tokens for f in TOKEN_FIELDS}, **{f: max_reqs for f in REQUEST_FIELDS},
                 **{f: max_reqs + 1 for f in INDPTR_FIELDS}}
        self.host = {f: torch.zeros(n, dtype=torch.int64, pin_memory=pin) for f, n in sizes.items()}
        self.host.update({f: torch.zeros(max_reqs, dtype=torch.float32, pin_memory=pin) for f in FLOAT_FIELDS})
        self.consumed: Event | None = None  # recorded on the engine stream after the device copy

    def write(self, **columns: list[int] | list[float]) -> None:
        for name, values in columns.items():
            self.host[name][: len(values)] = torch.tensor(values, dtype=self.host[name].dtype)

    def to_device(self, num_tokens: int, num_reqs: int) -> DeviceInputs:
        """Runs on the engine stream: the read that the write-after-read wait protects."""
        def copy(name: str) -> torch.Tensor:
            n = num_tokens if name in TOKEN_FIELDS else num_reqs + (name in INDPTR_FIELDS)
            src = self.host[name][:n]
            return src.to(self.device, non_blocking=True) if self.device.type == "cuda" else src.clone()
        return DeviceInputs(**{name: copy(name) for name in self.host})


class StagingRing:
    def __init__(self, max_tokens: int, max_reqs: int, device: torch.device, double_buffer: bool) -> None:
        self.buffers = [StagingBuffer(max_tokens, max_reqs, device) for _ in range(2 if double_buffer else 1)]
        self.double_buffer = double_buffer
        self._next = 0

    def acquire(self) -> StagingBuffer:
        buf = self.buffers[self._next]
        self._next = (self._next + 1) % len(self.buffers)
        # Write-after-read barrier: wait until the device has copied what this buffer held for
        # an earlier batch. Off ("staging_double_buffer" disabled) the single buffer is
        # rewritten at once, while the batch in flight may still be about to read it.
        if self.double_buffer and buf.consumed is not None:
            buf.consumed.synchronize()
        return buf
