"""The checks of what a caller hands `LLM` per call: prompts and sampling params.

Each bad value is one ValueError (or TypeError for a wrong type) that names the argument,
raised before anything is queued; `minisgl/checks.py` has the building blocks. The engine's
own arguments (device, dtype, sizes) are resolved in `minisgl/config.py`.
"""

from __future__ import annotations

from typing import Sequence

from ..checks import is_int
from ..sampling_params import SamplingParams

Prompt = str | Sequence[int]


def check_params(params: object, default_for_none: bool = True) -> SamplingParams:
    if params is None and default_for_none:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params


def prompt_list(prompts: object) -> list[Prompt]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and is_int(prompts[0])):
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string, a list of token ids or a list of those, "
                        f"got {type(prompts).__name__}")
    return list(prompts)


def params_list(params: object, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [check_params(params)] * n
    if not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
    params_list = [check_params(p, default_for_none=False) for p in params]  # a list spells each one out
    if len(params_list) != n:
        raise ValueError(f"{len(params_list)} SamplingParams for {n} prompts")
    return params_list
