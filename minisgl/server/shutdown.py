"""Shutting the server down on SIGTERM or Ctrl-C, and what the exit code says.

The first signal drains: the listening socket closes and idle keep-alive connections are closed,
so a new request (and a supervisor's /health check) fails to connect rather than getting a 503;
the requests in flight run to their end, for at most `--drain-timeout` seconds, and whatever is
still running then is aborted (its client gets finish_reason "abort"). Only a request that
arrived in the moment between the signal and the socket's closing gets a 503, and so does one
whose grammar is still being checked (its child is killed: a parse may run for a minute, and has
not reached the engine). The scheduler process
then checks that every KV slot and row is back (check_invariants), frees the engine and exits.
A second signal exits at once: everything in flight is aborted, the scheduler process gets a
few seconds to exit, then is killed.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Iterator

import uvicorn

EXIT_DRAINED = 0  # every request in flight finished
EXIT_ENGINE_FAILED = 1  # the scheduler process died or its engine failed, or its pools were not whole at the end
EXIT_ABORTED = 3  # the drain timed out: what was still running was aborted (its clients told)
# A second signal: 128 + its number, as a shell reports a process that signal ended (130, 143).


class Server(uvicorn.Server):
    """uvicorn's server, with this server's signals: the first one starts the drain, the second
    forces the exit (uvicorn's own handler re-raises them after serving, ending the process
    before the scheduler process is stopped)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.signals: list[int] = []

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        if len(self.signals) > 1:
            self.force_exit = True
        else:  # else a quiet drain of up to --drain-timeout seconds looks like a hang
            print(f"minisgl serve: {signal.Signals(sig).name}: finishing the requests in flight (at most "
                  f"--drain-timeout seconds); send it again to stop now", file=sys.stderr, flush=True)
        self.should_exit = True

    @property
    def forced(self) -> bool:
        return len(self.signals) > 1

    def exit_code(self, drained: bool, scheduler_code: int | None, engine_failed: bool) -> int:
        if self.forced:
            return 128 + self.signals[-1]
        if engine_failed or scheduler_code != 0:
            return EXIT_ENGINE_FAILED
        return EXIT_DRAINED if drained else EXIT_ABORTED
