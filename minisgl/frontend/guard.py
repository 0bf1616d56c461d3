"""Every public call of `LLM` completes or leaves no trace, whatever line a Ctrl-C lands on.

`@whole` runs a call in one frame: SIGINT held back (`Held`, a handler that only counts), the lock
taken (one thread inside), the method run, which lists in `guard.undo` how to give back what it
hands its caller (a request's id, results). Then the lock and the handler go back, and only then
does a held-back Ctrl-C reach that handler. Its default KeyboardInterrupt, like any exception
leaving the call (even one landing as it returns), runs the undo list. The scheduler needs no guard
of its own: only its step changes its state, always inside a call. A second Ctrl-C raises at once.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from typing import Callable

SECOND_INTERRUPT = "second interrupt: the call was cut short"


class Guard:
    """An LLM's lock (re-entrant: on_step may add_request) and its innermost call's undo list and Held;
    at interpreter exit, how the finalizer stops a call a daemon thread is still inside (`stop_calls`)."""

    def __init__(self) -> None:
        self.lock, self.undo, self.held = threading.RLock(), None, None
        self.stopping, self.parked = threading.Event(), threading.Event()

    def stop_calls(self, timeout_s: float) -> None:
        """The finalizer, before it stops the engine: every call's next step parks (`park`, called by
        _step), and this returns once no other thread is inside a call, or the one inside has
        parked, or timeout_s has passed. Only at interpreter exit can another thread be inside a
        call (a running call holds its LLM); after close() no call steps again (they refuse)."""
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        while not self.lock.acquire(timeout=0.01):  # at once if none is, or it is this thread's close()
            if self.parked.is_set() or time.monotonic() > deadline:
                return
        self.lock.release()

    def park(self) -> None:
        """Where a call's thread waits forever once the engine is stopped under it (`stop_calls`),
        outside any torch op, to end with the interpreter as daemon threads do. One still inside a
        torch op as the interpreter finishes is killed in C++ code when the op takes the GIL back:
        "terminate called without an active exception", SIGABRT."""
        self.parked.set()
        threading.Event().wait()


class Held(list):
    """SIGINT held back while a call runs: installed as the handler, it counts Ctrl-Cs (the second
    raises at once). Inert off the main thread (no signal reaches it), inside a call (the outer one
    holds) and under SIG_IGN."""

    def __init__(self) -> None:
        super().__init__()
        current, self.previous = signal.getsignal(signal.SIGINT), None
        if threading.current_thread() is threading.main_thread() and not isinstance(current, Held) and \
                current not in (signal.SIG_IGN, None):
            self.previous = signal.signal(signal.SIGINT, self)

    def __call__(self, signum: int, frame: object) -> None:
        if self:
            raise KeyboardInterrupt(SECOND_INTERRUPT)
        self.append(signum)

    def deliver(self) -> None:
        """Hand a held-back Ctrl-C to the handler it was held back from (also between two steps)."""
        if self:
            self.clear()
            (self.previous if callable(self.previous) else signal.default_int_handler)(signal.SIGINT, None)

    def let_go(self) -> None:
        """Put the handler back, then hand it a Ctrl-C held back before (one after goes to it directly)."""
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.deliver()


def whole(drives: bool = False, closing: bool = False) -> Callable:
    """Make a method of LLM a whole call. `drives`: it runs the scheduler (refused inside another
    call: from on_step); `closing`: it runs after the engine failed (LLM._refuse)."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(llm, *args, **kwargs):
            guard, undo = llm._guard, []
            held = Held()
            try:
                try:
                    if not guard.lock.acquire(blocking=False):
                        raise RuntimeError("this LLM is in use by another thread; one LLM serves one thread at a time")
                    try:
                        llm._refuse(drives and guard.undo is not None, closing)
                        outer, (guard.undo, guard.held) = (guard.undo, guard.held), (undo, held)
                        try:
                            value = method(llm, *args, **kwargs)
                        finally:
                            guard.undo, guard.held = outer
                    except BaseException as exc:  # still locked and held back: give back what it took
                        if exc.args == (SECOND_INTERRUPT,):  # state may be half moved: refuse further work,
                            llm.scheduler.error = llm.scheduler.error or exc
                            llm.engine.hung = True  # and let close() and the exit leave a hung device alone
                        while undo:
                            undo.pop()()
                        raise
                    finally:
                        guard.lock.release()  # while held back: a Ctrl-C cannot keep the lock
                finally:
                    held.let_go()  # from here a Ctrl-C raises, and the except below undoes the call
                return value
            except BaseException:
                if undo:  # it completed, but a Ctrl-C came as it ended: the caller never gets the value
                    with guard.lock:
                        while undo:
                            undo.pop()()
                raise

        return call

    return decorate
