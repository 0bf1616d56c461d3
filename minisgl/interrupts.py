"""A scheduler step is atomic: Ctrl-C inside it is delivered when it ends.

A step moves tokens, KV slots and rows between owners (launch records a batch as in flight;
commit appends tokens, releases requests, frees rows). A KeyboardInterrupt raised halfway
through would leave a launched batch with no record of it, or a batch half committed: its
requests would never finish and their slots and rows would leak. So while a step runs on the
main thread, SIGINT only sets a flag, and the KeyboardInterrupt is raised once the step has
left the scheduler whole. A second Ctrl-C during the same step raises at once (a way out of a
hung device); the scheduler then refuses further work rather than run on half-moved state.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Protocol


class _Stoppable(Protocol):
    error: BaseException | None


class atomic_step:
    """Run one step with interrupts deferred. An exception that escapes it anyway (a second
    Ctrl-C, an error on the device) may leave state half moved: it is latched in
    `owner.error`, and every later step refuses to run.

    A class, not a generator: a generator-based context manager whose __exit__ is cut short
    by a second Ctrl-C stays suspended, and closing it later latched a bogus GeneratorExit."""

    def __init__(self, owner: _Stoppable) -> None:
        self.owner = owner
        self.deferred = interrupts_deferred()

    def __enter__(self) -> None:
        if self.owner.error is not None:
            raise RuntimeError(f"the scheduler stopped after an error ({self.owner.error!r}); close this LLM "
                               "and create a new one") from self.owner.error
        self.deferred.__enter__()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if exc is not None:
            self.owner.error = exc
        return bool(self.deferred.__exit__(exc_type, exc, tb))


_deferring = False  # an interrupts_deferred() block is active: a nested one leaves it in charge


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside the block is raised when the block ends; a second one raises at once.
    Nested blocks are one block: the outermost one defers (and counts) every Ctrl-C."""
    global _deferring
    if threading.current_thread() is not threading.main_thread() or _deferring:
        yield  # signals are only ever delivered to the main thread
        return
    previous = signal.getsignal(signal.SIGINT)
    pending: list[int] = []

    def defer(signum: int, frame: object) -> None:
        if pending:
            raise KeyboardInterrupt("second interrupt during a scheduler step")
        pending.append(signum)

    signal.signal(signal.SIGINT, defer)
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        signal.signal(signal.SIGINT, previous)
    if pending:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt
