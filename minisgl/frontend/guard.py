"""Ctrl-C and the public calls of `LLM`: every call completes, or leaves no trace.

Every public call runs under `@whole` (below), in one frame, the outermost of the call:
1. SIGINT is held back (`hold_back`: a handler that only counts), before anything is taken;
2. the LLM's lock is taken (one thread inside at a time) and the call is refused or run; what it
   hands its caller (a queued request's id, taken results) it registers in `guard.undo`;
3. the lock is given back and the handler put back (`let_go`), and only then a held-back Ctrl-C
   goes to it, so none can fall between the two. The default handler raises KeyboardInterrupt.
Any exception that leaves the call, including one that lands as the handler goes back and the
value is on its way to the caller, runs the undo list: the call completed or left no trace. A
handler of the user's that takes the Ctrl-C without raising lets the call complete.

The scheduler needs nothing of this: its state is only changed by its own step, and every step
runs inside a call, whole. A long call hands a held Ctrl-C on between two steps (`checkpoint`).
A second Ctrl-C within one call raises at once (the way out of a hung device), and the LLM then
refuses work. Signals reach the main thread only: on other threads the guard is the lock alone.
"""

from __future__ import annotations

import functools
import signal
import threading
from typing import Callable

SECOND_INTERRUPT = "second interrupt: the call was cut short"
IN_USE = "this LLM is in use by another thread; one LLM serves one thread at a time"
_held: list[int] | None = None  # the Ctrl-Cs held back by the outermost call on the main thread
_previous: object = None  # the handler they are held back from


class Guard:
    """One LLM's calls: the lock (re-entrant: on_step may add_request inside generate), and the
    innermost call's state: does it drive the scheduler, its undo list, its held Ctrl-Cs."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.driving = False
        self.undo: list[Callable[[], None]] = []
        self.held: list[int] | None = None


def hold_back() -> list[int] | None:
    """Hold SIGINT back: the list it is counted in, or None where there is nothing to hold back (not
    the main thread, a call inside a call: the outer one holds, Ctrl-C ignored or not Python's)."""
    global _held, _previous
    if _held is not None or threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        return None
    held: list[int] = []

    def count(signum: int, frame: object) -> None:
        if held:
            raise KeyboardInterrupt(SECOND_INTERRUPT)
        held.append(signum)

    _previous, _held = signal.signal(signal.SIGINT, count), held
    return held


def deliver() -> None:
    """Hand a held-back Ctrl-C to the handler it was held back from."""
    if callable(_previous):
        _previous(signal.SIGINT, None)
    else:
        raise KeyboardInterrupt  # SIG_DFL


def let_go(held: list[int] | None) -> None:
    """Put the handler back, then hand it what was held back (a Ctrl-C before the swap is in
    `held`, one after it goes to the handler itself)."""
    global _held
    if held is not None:
        _held = None
        signal.signal(signal.SIGINT, _previous)
        if held:
            deliver()


def checkpoint(guard: Guard) -> None:
    """A safe point of a long call (between two steps): a held-back Ctrl-C goes to its handler now."""
    if guard.held:
        guard.held.clear()
        deliver()


def whole(drives: bool = False, closing: bool = False) -> Callable:
    """Make a method of LLM a whole call (see above). `drives`: it runs the scheduler, and is refused
    inside a call that does (an on_step callback); `closing`: it runs after the engine failed."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(llm, *args, **kwargs):
            guard, undo = llm._guard, []
            held = hold_back()
            try:
                try:
                    if not guard.lock.acquire(blocking=False):
                        raise RuntimeError(IN_USE)
                    try:
                        llm._refuse(drives and guard.driving, closing)
                        outer = guard.driving, guard.undo, guard.held
                        guard.driving, guard.undo, guard.held = guard.driving or drives, undo, held
                        try:
                            value = method(llm, *args, **kwargs)
                        finally:
                            guard.driving, guard.undo, guard.held = outer
                    except BaseException as exc:  # still locked and held back: give back what it took
                        if exc.args == (SECOND_INTERRUPT,) and llm.scheduler.error is None:
                            llm.scheduler.error = exc  # state may be half moved: refuse further work
                        _run(undo)
                        raise
                    finally:
                        guard.lock.release()
                finally:
                    let_go(held)
                return value
            except BaseException:
                if undo:  # it completed, but the Ctrl-C came as it ended: its caller never sees the value
                    with guard.lock:
                        _run(undo)
                raise

        return call

    return decorate


def _run(undo: list[Callable[[], None]]) -> None:
    while undo:
        undo.pop()()
