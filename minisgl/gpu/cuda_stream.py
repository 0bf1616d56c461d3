"""A CUDA stream behind the verbs of `minisgl/streams.py`: `launch` runs fn now, its kernels queue."""

from __future__ import annotations

from typing import Callable

import torch


class CudaStream:
    """`torch.cuda.Stream` behind the same verbs: `launch` runs fn now, its kernels queue."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.raw = torch.cuda.Stream(device=device)

    def launch(self, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(self.raw):
            fn()

    def record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.raw)
        return event

    def wait_event(self, event: torch.cuda.Event) -> None:
        self.raw.wait_event(event)

    def wait_stream(self, other: CudaStream) -> None:
        self.raw.wait_stream(other.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def close(self, wait: bool = True) -> None:
        pass
