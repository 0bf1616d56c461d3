"""Streams and events: the device model of the articles, on CUDA and on a laptop CPU.

A *stream* is an ordered queue of device work the host does not wait for ("launch returned" only means
"queued", lessons/readings §3); an *event* marks a point in it. CUDA: gpu/cuda_stream.py; CPU: `CpuStream`."""

from __future__ import annotations

import queue
import sys
import threading
from typing import Callable, Protocol

import torch


class Event(Protocol):
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Stream(Protocol):
    name: str

    def launch(self, fn: Callable[[], None]) -> None: ...
    def record_event(self) -> Event: ...
    def wait_event(self, event: Event) -> None: ...
    def wait_stream(self, other: "Stream") -> None: ...
    def synchronize(self) -> None: ...


class DeviceError(RuntimeError):
    """Work queued on a CPU stream raised; re-raised on the host at the next wait."""


# --------------------------------------------------------------------------- CPU emulation


class CpuEvent:
    """Completes when the stream's worker thread reaches it (or at once if recorded on the host)."""

    def __init__(self, stream: "CpuStream | None" = None) -> None:
        self._done = threading.Event()
        self._stream = stream

    def _set(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._stream is not None and self._stream.error is not None:
            error = self._stream.error  # its own traceback is chained below; its message goes in the line
            raise DeviceError(f"work on stream {self._stream.name!r} failed: {type(error).__name__}: {error}") from error

    def query(self) -> bool:
        return self._done.is_set()


class CpuStream:
    """A worker thread that runs queued closures in order: a CUDA stream, emulated.

    The worker enters `inference_mode` itself (it is thread-local). torch kernels release the GIL, Python
    does not: at CPython's default 5 ms switch interval host and worker convoy and the overlap loses; at
    50 us the host runs while the worker is inside a kernel. torch's intra-op pool is held to 1 thread while
    a stream lives (one forward would take every core). Both settings are process-wide (`_HostSettings`)."""

    SWITCH_INTERVAL_S = 5e-5

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: BaseException | None = None
        self._closed = False
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        _HOST_SETTINGS.take(self.SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                fn = self._queue.get()
                if fn is None:
                    return
                if (self.error is not None or self._closed) and not isinstance(fn, _Marker):
                    # After a failure (or once closing) only events still complete, so no host
                    # waits forever and close() does not wait for work nobody will read.
                    continue
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - surfaced on the host at the next wait
                    self.error = exc

    def _put(self, fn: Callable[[], None]) -> None:
        if self._closed:
            # The worker is gone: queued work would never run and its events never complete.
            raise RuntimeError(f"stream {self.name!r} is closed")
        self._queue.put(fn)

    def launch(self, fn: Callable[[], None]) -> None:
        self._put(fn)

    def record_event(self) -> CpuEvent:
        event = CpuEvent(self)
        self._put(_Marker(event._set))
        return event

    def wait_event(self, event: Event) -> None:
        self._put(_Marker(event.synchronize))

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def close(self, wait: bool = True) -> None:
        """Stop the worker: it finishes the closure it is in and skips the rest; with `wait`, wait for that.
        Idempotent, never raises (an error of queued work was the host's to read earlier)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            _HOST_SETTINGS.give_back()
        if wait and threading.current_thread() is not self._thread:  # a finalizer may run on the worker itself
            self._thread.join()


class _HostSettings:
    """The process-wide settings a CPU stream needs, taken by the first live stream, restored by the last."""

    def __init__(self) -> None:
        self.streams = 0
        self.saved: tuple[int, float] | None = None

    def take(self, switch_interval_s: float) -> None:
        if self.streams == 0:
            self.saved = (torch.get_num_threads(), sys.getswitchinterval())
        self.streams += 1
        torch.set_num_threads(1)
        sys.setswitchinterval(switch_interval_s)

    def give_back(self) -> None:
        self.streams -= 1
        if self.streams == 0 and self.saved is not None:
            threads, interval = self.saved
            torch.set_num_threads(threads)
            sys.setswitchinterval(interval)


_HOST_SETTINGS = _HostSettings()


class _Marker:
    """A queue entry that must run even after a failure (event records and waits)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def __call__(self) -> None:
        self._fn()


class HostStream:
    """The CPU scheduler's own 'stream': work runs inline on the host, in program order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: BaseException | None = None

    def launch(self, fn: Callable[[], None]) -> None:
        fn()

    def record_event(self) -> CpuEvent:
        event = CpuEvent()
        event._set()
        return event

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def wait_stream(self, other: Stream) -> None:
        other.synchronize()

    def synchronize(self) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        pass


def make_device_stream(name: str, device: torch.device) -> Stream:
    """A stream the host does not wait for: a CUDA stream, or a worker thread on CPU."""
    if device.type == "cuda":
        from .gpu.cuda_stream import CudaStream

        return CudaStream(name, device)
    return CpuStream(name)


def make_host_stream(name: str, device: torch.device) -> Stream:
    """The scheduler's stream: a CUDA stream for its H2D copies, or inline host work on CPU."""
    if device.type == "cuda":
        from .gpu.cuda_stream import CudaStream

        return CudaStream(name, device)
    return HostStream(name)
