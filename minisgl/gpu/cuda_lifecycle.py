"""What a CUDA engine needs at birth and death beyond freeing its own tensors, and the emulated
device delay on a GPU (a spinning kernel)."""

from __future__ import annotations

import gc
import weakref

import torch

_LIVE_ENGINES: "weakref.WeakSet[object]" = weakref.WeakSet()  # CUDA engines not yet closed
_CYCLES_PER_S: dict[int, float] = {}  # torch.cuda._sleep's rate, per device, once calibrated


def before_engine_start() -> None:
    """An engine dropped without close() may sit in reference cycles: collect it now, at a safe
    point, not during the next engine's graph capture."""
    gc.collect()
    torch.cuda.empty_cache()


def engine_started(engine: object) -> None:
    _LIVE_ENGINES.add(engine)


def engine_closed(engine: object, device: torch.device, synchronized: bool) -> None:
    """After an engine dropped its tensors: collect the cycles that keep them alive, and give the
    memory back. `synchronized`: the device finished the engine's work (no failed kernel)."""
    gc.collect()
    if not synchronized:
        return
    torch.cuda.synchronize(device)
    _LIVE_ENGINES.discard(engine)
    if not _LIVE_ENGINES:
        # cuBLAS keeps a workspace per (handle, stream) in the caching allocator; captured graphs
        # hold those addresses, so they are dropped only when no engine's graphs may use them.
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def sleep_on_device(seconds: float, device: torch.device) -> None:
    """A kernel that spins for `seconds`, queued on the current stream."""
    torch.cuda._sleep(int(seconds * _cycles_per_s(device)))


def _cycles_per_s(device: torch.device) -> float:
    """Calibrate torch.cuda._sleep once per device: the second of two timed sleeps, after the
    clock ramped up from idle (the first runs slow and would make every delay too short)."""
    index = device.index or 0
    if index not in _CYCLES_PER_S:
        for _ in range(2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(50_000_000)
            end.record()
            end.synchronize()
            _CYCLES_PER_S[index] = 50_000_000 / (start.elapsed_time(end) / 1000.0)
    return _CYCLES_PER_S[index]
