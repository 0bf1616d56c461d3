"""The checks of `LLM`'s own arguments: device, dtype, sizes, prompts and sampling params.

Each bad value is one ValueError (or TypeError for a wrong type) that names the argument,
raised before the engine starts anything; `checks.py` has the building blocks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .checks import check_int, is_int
from .config import free_memory_bytes
from .request import SamplingParams

Prompt = str | Sequence[int]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a string or a torch.dtype, got {type(dtype).__name__}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """cpu, cuda or cuda:N (an existing GPU); None picks cuda when available."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cpu":
        return torch.device("cpu")  # 'cpu:0' is the same device, but safetensors refuses the spelling
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) present")
    return dev


def check_memory(device: torch.device, kv_tokens: int, bytes_per_token: int, rows: int, width: int,
                  chunk_size: int) -> None:
    """Refuse sizes the device cannot hold before allocating them: a KV cache larger than the
    host's memory is not an error on Linux, it is the out-of-memory killer, later."""
    free = free_memory_bytes(device)
    # KV cache, the int64 request table, and two staging buffers of about 8 int64 columns.
    need = (kv_tokens + 1) * bytes_per_token + rows * width * 8 + 2 * 8 * 8 * max(chunk_size, rows)
    if free is not None and need > free:
        raise ValueError(f"kv_tokens={kv_tokens}, max_running_requests={rows} and chunk_size={chunk_size} need "
                         f"{need / 2**30:.1f} GiB on {device}, {free / 2**30:.1f} GiB is free; lower them")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def optional_size(name: str, value: object, high: int) -> int | None:
    """A size that is either left out (None: the default) or a positive integer."""
    return None if value is None else check_int(name, value, 1, high)


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
