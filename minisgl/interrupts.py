"""A step that fails stops the scheduler: an exception that escapes a step (a device error, a
second Ctrl-C) may leave it half moved, so it is latched in `owner.error` and every later step
refuses. Ctrl-C itself is held back around every public call of the front end (frontend/guard.py),
and the scheduler's state is only changed inside a step: a first Ctrl-C lands after it."""

from __future__ import annotations

from typing import Protocol


class _Stoppable(Protocol):
    error: BaseException | None


class atomic_step:
    """`with atomic_step(scheduler):` around one step."""

    def __init__(self, owner: _Stoppable) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        if self.owner.error is not None:
            raise RuntimeError(f"the scheduler stopped after an error ({self.owner.error!r}); close this LLM "
                               "and create a new one") from self.owner.error

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.owner.error = exc
