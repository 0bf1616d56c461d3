"""What a speculative step relays to the next one on the device, and the host's mirror of it.

Without speculation a step adds exactly one token, so the host knows every request's length
when it plans the next step. A verify step adds 1 to K+1 tokens, a number that exists only on
the device after the verify. Spec V2's answer (SGLang's FutureMap, minisgl's `SpecRelay`):

- the verify publishes each row's new length (`new_seq_lens`, SGLang's `new_seq_lens_buf`) and
  its bonus token (the FutureMap's `tokens`) on the device; the next verify reads its positions
  and KV slots from there, never from the host (`resolve_positions`);
- the host keeps a mirror of the lengths (`mirror`), which the device writes right after the
  publish and marks with `publish_ready`. The attention metadata needs the lengths on the host,
  so the host reads the mirror, but only after that event (`host_lengths`, SGLang's
  `resolve_seq_lens_cpu`): it waits for the verify of the batch in flight, not for its whole
  stream (the draft work after the publish and the copy to the host still overlap).
- `history` holds every row's token ids by position, for the n-gram drafter.
"""

from __future__ import annotations

import threading

import torch

from ...mechanisms import Mechanisms


class PublishEvent:
    """Marks the point of the device work where the lengths were published (SGLang: publish_ready).
    Made on the host when the batch is planned, recorded by the device step itself."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.cuda.Event() if device.type == "cuda" else None
        self.done = threading.Event()

    def record(self) -> None:  # on the engine stream (CUDA: inside its context; CPU: its worker)
        # Only the first record counts: a step records again at its end (its `finally`, so that a
        # step that failed before its publish still lets the host go on), and a second CUDA record
        # would move the event there: the next plan would wait for the draft work after the publish.
        if self.done.is_set():
            return
        if self.cuda is not None:
            self.cuda.record()
        self.done.set()

    def synchronize(self) -> None:
        self.done.wait()  # CUDA: set at launch, when the record was queued
        if self.cuda is not None:
            self.cuda.synchronize()


class SpecRelay:
    def __init__(self, rows: int, width: int, device: torch.device, mechanisms: Mechanisms) -> None:
        self.device = device
        self.width = width
        self.mechanisms = mechanisms
        self.new_seq_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.mirror = torch.zeros(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
        # One column past the table: where record_tokens drops the positions past it. A boolean
        # mask would drop them too, but on CUDA a masked index is a nonzero(), a host wait.
        self._history = torch.zeros(rows, width + 1, dtype=torch.int64, device=device)
        self.history = self._history[:, :width]  # what the n-gram drafter reads
        self.publish_ready: PublishEvent | None = None  # the newest planned batch's publish

    def next_publish(self) -> PublishEvent:
        """A new event for the batch being planned: the next plan waits for it."""
        self.publish_ready = PublishEvent(self.device)
        return self.publish_ready

    def host_lengths(self, rows: list[int]) -> list[int]:
        """The host's view of each row's length after every launched batch (resolve_seq_lens_cpu)."""
        # >>> exercise 11: wait for the publish before reading the mirror
        if self.publish_ready is not None and self.mechanisms.on("spec_publish_wait"):
            self.publish_ready.synchronize()  # the batch in flight has published its lengths
        return self.mirror[rows].tolist()
        # <<< exercise 11

    def resolve_positions(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """On the device: [B, width] positions of a verify's tokens, from the published lengths."""
        return self.new_seq_lens[rows][:, None] + torch.arange(width, device=rows.device)[None, :]

    def publish(self, rows: torch.Tensor, new_lens: torch.Tensor, event: PublishEvent) -> None:
        """On the device, right after a forward: the new lengths, then the mirror, then the event."""
        self.new_seq_lens[rows] = new_lens
        self.mirror.copy_(self.new_seq_lens, non_blocking=self.device.type == "cuda")
        event.record()

    def record_tokens(self, rows: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """On the device: token ids at positions (a position past the table is dropped)."""
        self._history[rows, positions.clamp(max=self.width)] = ids
