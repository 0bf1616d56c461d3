"""Argument checks at the API boundary: one clear error that names the argument and its range.

Why so strict: anything that passes here is staged into int64/float32 host buffers and read
by the device later, one step after the call returned. A value those buffers cannot hold
(a seed of 2**63, a top_k of nan) would fail there, where no caller can be told which
argument was wrong, and would take every request in flight down with it. So a wrong *type*
is a TypeError and a wrong *value* a ValueError, raised before anything is queued; nothing
is coerced (a bool is not an int, a float is not truncated, 0 does not mean "default").
"""

from __future__ import annotations

import math
import operator
from numbers import Real
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# Upper bounds for the engine's sizes: slot and token ids travel as int32 in device kernels, and no
# device decodes a million requests at once (rows are allocated up front, before any memory check).
MAX_TOKENS = (1 << 31) - 2
MAX_RUNNING_REQUESTS = 1 << 20
MAX_DELAY_MS = 3_600_000.0  # an hour per step: any more is a typo, not a teaching aid


def shortened(value: Any, limit: int = 40) -> str:
    """A caller's value as an error message quotes it: a 4,000-digit number is not echoed whole."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_int(value: Any) -> bool:
    """A true integer (int, numpy/torch integer scalar), never a bool, float or string."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """An integer in [low, high]; returns it as a Python int."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_real(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    """A finite real number in [low, high] (or (low, high] with low_open); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_token_ids(name: str, ids: Any, vocab: int) -> list[int]:
    """A sequence of token ids, each an integer in [0, vocab)."""
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {type(ids).__name__}")
    out = []
    for t in ids:
        if not is_int(t):
            raise TypeError(f"{name} must hold integer token ids, got {type(t).__name__} {t!r}")
        t = operator.index(t)
        if not 0 <= t < vocab:
            raise ValueError(f"{name}: token ids must be in [0, {vocab}), got {t}")
        out.append(t)
    return out
