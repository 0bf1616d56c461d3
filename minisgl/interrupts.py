"""An error that escapes a step (a device error, a second Ctrl-C) may leave the scheduler half moved:
it is latched in `owner.error`, and every later step refuses. (frontend/guard.py holds Ctrl-C back.)"""


class atomic_step:
    def __init__(self, owner) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        if self.owner.error is not None:
            raise RuntimeError(f"the scheduler stopped after an error ({self.owner.error!r})") from self.owner.error

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.owner.error = exc
