"""The shape of a constraint on a request's output (`SamplingParams.grammar`), a seam of the core:
the teaching FSM (features/grammar.py) is one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

REJECTED = -1  # the state of a request whose output already broke its constraint: no longer constrained


class Constraint(ABC):
    """What a request's output must follow (`SamplingParams.grammar`): a state machine over token
    ids. Its state advances when a token is committed, never earlier (lesson 11)."""

    @abstractmethod
    def initial_state(self) -> Any: ...

    @abstractmethod
    def advance(self, state: Any, token: int) -> Any:
        """The state after `token`; REJECTED if the token was not allowed."""

    @abstractmethod
    def is_final(self, state: Any) -> bool: ...

    @abstractmethod
    def validate(self, vocab: int) -> None:
        """Raise ValueError if the constraint names a token outside [0, vocab)."""
