"""A scheduler step is atomic: Ctrl-C inside it is delivered when it ends.

An interrupt halfway through a step would leave a batch unrecorded or half committed (slots and rows
leaked, requests that never finish). A second Ctrl-C raises at once (the way out of a hung device)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Protocol


class _Stoppable(Protocol):
    error: BaseException | None


class atomic_step:
    """Run one step with interrupts deferred. An exception that escapes anyway (a second Ctrl-C,
    a device error) is latched in `owner.error`, and every later step refuses to run. A class:
    a generator's __exit__ cut short by a second Ctrl-C stays suspended (a bogus GeneratorExit)."""

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


_outermost: "Deferral | None" = None  # the open outermost Deferral (main thread), or None


class Deferral:
    """SIGINT held back on the main thread between open() and close(). Nested deferrals are one: the
    outermost installs the handler and counts every Ctrl-C, an inner one only reports them. A second
    Ctrl-C raises at once; off the main thread, or where Ctrl-C is ignored, nothing is held back."""

    def __init__(self) -> None:
        self.outermost = False
        self.joined = False  # an inner deferral: the outermost one holds back for it
        self.previous: object = None  # (outermost) the handler it replaced
        self.held: list[int] = []  # (outermost) the Ctrl-Cs held back

    def open(self) -> None:
        global _outermost
        if threading.current_thread() is not threading.main_thread():
            return  # signals are only ever delivered to the main thread
        if _outermost is not None:
            self.joined = True  # an outer deferral is in charge
            return
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return  # Ctrl-C is ignored: there is nothing to hold back
        held = self.held

        def defer(signum: int, frame: object) -> None:
            if held:
                raise KeyboardInterrupt(SECOND_INTERRUPT)
            held.append(signum)

        self.previous = signal.signal(signal.SIGINT, defer)  # one call: there is no moment with no handler
        _outermost, self.outermost = self, True

    def pending(self) -> bool:
        """A Ctrl-C is being held back for this deferral (by it or by the outer one)."""
        outer = _outermost
        return (self.outermost or self.joined) and outer is not None and bool(outer.held)

    def close(self) -> bool:
        """Stop deferring (outermost only); True if a Ctrl-C was held back. The handler goes back in the
        last line, with the answer (a Ctrl-C landing inside `signal.signal` is the caller's to catch)."""
        global _outermost
        if not self.outermost:
            return self.pending()
        held, _outermost, self.outermost = self.held, None, False
        signal.signal(signal.SIGINT, self.previous); return bool(held)  # noqa: E702 - see above

    def deliver_held(self) -> None:
        """Hand the held-back Ctrl-C to the handler it was held back from, now; a user's handler may
        take it without raising, and the caller then carries on as if no Ctrl-C had come."""
        outer = _outermost
        if outer is None or not outer.held or not (self.outermost or self.joined):
            return
        outer.held.clear()
        outer.deliver()

    def deliver(self) -> None:
        """Raise the held-back Ctrl-C the way the previous handler would have (inner deferral: the outer's)."""
        if self.joined:
            self.deliver_held()
        elif callable(self.previous):
            self.previous(signal.SIGINT, None)
        elif self.previous != signal.SIG_IGN:
            raise KeyboardInterrupt


SECOND_INTERRUPT = "second interrupt: the call was cut short"


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside the block is raised when it ends; a second one raises at once. Nested blocks are one."""
    deferral = Deferral()
    deferral.open()
    try:
        yield
    finally:
        pending = deferral.close()  # also when the block is never left (closed by the collector)
    if pending and deferral.previous is not None:
        deferral.deliver()
