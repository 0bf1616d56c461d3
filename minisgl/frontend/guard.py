"""The per-call guard of `LLM`: every public call is entered and left whole.

A public call (add_request, step, generate, collect, abort, flush_cache, close...) takes the
LLM's lock, moves requests and results between the caller and the scheduler, and gives the
lock back. A KeyboardInterrupt landing between two of those moves would leave the lock held
forever, a request queued whose id never reached its caller, or finished outputs taken and
dropped. So the whole call runs with Ctrl-C held back (interrupts.Deferral), from the first
line of __enter__ to the last line of __exit__, and a held-back Ctrl-C is raised at one of two
places only:

- a safe point inside a long call (`Call.checkpoint()`, between two steps of generate()), or
- at the exit, after the call's hand-back was undone (`Call.on_failure`): the results go back
  to the LLM, the request leaves the queue. The call then either completed, or left no trace.

A second Ctrl-C during a call still raises at once (the way out of a hung device); state may
then be half moved, so the LLM refuses further work (`Call` reports it to `on_second_interrupt`).
Only the main thread receives signals: on other threads the guard is the lock alone.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar

from ..interrupts import SECOND_INTERRUPT, Deferral


class CallGuard:
    """One thread inside an LLM at a time; `driving`: a call that runs the scheduler is open."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: an on_step callback may add_request() inside generate()
        self.driving = False
        self.claims = threading.local()  # .box: where this thread's next Call made goes (see hands_back)


class Call:
    """One public call: `with Call(guard, drives, check, on_second_interrupt) as call: ...`."""

    def __init__(self, guard: CallGuard, drives: bool, check: Callable[[bool], None],
                 on_second_interrupt: Callable[[BaseException], None]) -> None:
        self.guard = guard
        self.drives = drives
        self.check = check  # raises if the LLM cannot take this call (closed, failed, re-entered)
        self.on_second_interrupt = on_second_interrupt
        self.undo: list[Callable[[], None]] = []  # what to give back if the call does not complete
        self.deferral = Deferral()
        self.outer_driving = False

    def __enter__(self) -> "Call":
        self.deferral.open()  # first: anything taken below is given back by __exit__
        try:
            if not self.guard.lock.acquire(blocking=False):
                raise RuntimeError(IN_USE)
            try:
                self.check(self.drives)
            except BaseException:
                self.guard.lock.release()
                raise
        except BaseException:
            if self.deferral.close():
                self.deferral.deliver()  # a Ctrl-C held back meanwhile wins over the refusal
            raise
        self.outer_driving, self.guard.driving = self.guard.driving, self.drives or self.guard.driving
        return self

    def on_failure(self, undo: Callable[[], None]) -> None:
        """Register how to give back what this call took, should it not complete."""
        self.undo.append(undo)

    def checkpoint(self) -> None:
        """A safe point of a long call: a held-back Ctrl-C goes to its handler here. The default
        raises KeyboardInterrupt (undone by __exit__); a handler of the user's may take it, and
        the call goes on."""
        if self.deferral.pending():
            self.deferral.deliver_held()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        delivered = None  # a held-back Ctrl-C, raised by its handler here
        if exc is None and self.deferral.pending():
            # Under the lock and the deferral: the handler it was held back from decides. The
            # default raises (the call did not complete: undone below); a handler of the user's
            # that takes it without raising lets the call complete, with its value.
            try:
                self.deferral.deliver_held()
            except BaseException as raised:
                exc = delivered = raised
        if exc is not None:
            self._give_back()
        if isinstance(exc, KeyboardInterrupt) and exc.args == (SECOND_INTERRUPT,):
            self.on_second_interrupt(exc)
        self.guard.driving = self.outer_driving
        self.guard.lock.release()  # before the handler is restored: a Ctrl-C after that must not keep it
        try:
            # Deferral.close() puts the handler back and says whether a Ctrl-C was held back since
            # the check above. If none was, the call is done: return (or raise what was delivered).
            # This is inside the `try` because the handler is back by then: a Ctrl-C on these lines
            # (or inside `signal.signal`, which runs Python code after installing the handler, and
            # pending handlers run there) raises here, and a completed call is then undone instead
            # of losing its id or its outputs (the every-line sweep, tests/test_ctrl_c_sweep.py,
            # and a real-signal attack found both).
            if not self.deferral.close():
                if delivered is not None:
                    raise delivered
                return False
        except KeyboardInterrupt:
            if exc is None:
                self.give_back_late()
            raise
        # A Ctrl-C came after the check above. Its handler decides again, now the previous handler
        # is back; should it raise, the call is undone first (a further Ctrl-C here is a second
        # one, which gets out at once, as anywhere).
        if exc is None:
            try:
                self.deferral.deliver()
            except BaseException:
                self.give_back_late()
                raise
        if delivered is not None:
            raise delivered
        return False

    def give_back_late(self) -> None:
        """The call completed, but a Ctrl-C reached Python in the public method's own frame,
        after __exit__ returned (see hands_back): undo it after all, under the lock. A call that
        did not complete was undone by __exit__ already, and this does nothing."""
        with self.guard.lock:
            self._give_back()

    def _give_back(self) -> None:
        undo, self.undo = self.undo, []
        for step in reversed(undo):
            step()


Method = TypeVar("Method", bound=Callable)


def hands_back(method: Method) -> Method:
    """For a public call that hands something back (an id, results): the last moment of the
    call is not covered by its guard. `__exit__` returns into the method's frame with the
    handler back, and the interpreter runs pending signal handlers right after a call returns
    (the GIL may have been handed to another thread at the last such point inside __exit__, so
    a Ctrl-C sent meanwhile is handled there). A KeyboardInterrupt raised there leaves a
    completed call whose caller never got its value: a queued request under an unknown id, or
    a step's outputs lost (a real-signal attack saw 14 in 1,649 SIGINTs). This wrapper catches
    it one frame up and undoes the call, as if it had not completed, before raising it.

    The method's own first Call is found through `guard.claims.box`: a box set here, filled by
    the `LLM._call()` that the method opens first (a nested call, from an on_step callback, sets
    its own box before its method runs; another thread has its own box)."""

    @functools.wraps(method)
    def call_that_hands_back(self, *args, **kwargs):
        box = self._guard.claims.box = []
        try:
            return method(self, *args, **kwargs)
        except KeyboardInterrupt:
            for call in box:
                call.give_back_late()
            raise

    return call_that_hands_back  # type: ignore[return-value]


IN_USE = "this LLM is in use by another thread; one LLM serves one thread at a time"
