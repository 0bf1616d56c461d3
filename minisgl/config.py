"""The engine's configuration: one frozen `EngineConfig`, resolved and checked once.

`resolve_config(...)` turns `LLM(...)`'s keyword arguments (or the CLI's flags), the defaults
below and what the checkpoint's config.json says into final values: every size is a number,
`"auto"` is a concrete attention backend, the device exists, the memory check has passed.
`Engine` and `Scheduler` take the result and never re-check or re-default anything.

Each quantity has one name everywhere in minisgl:

- `max_running_requests`  the most requests decoding at once = the request table's rows
- `model_window`          the checkpoint's `max_position_embeddings`
- `max_seq_len`           the longest prompt + new tokens this engine holds
- `table_width`           positions per row of the request table

A bad value is one ValueError (TypeError for a wrong type) that names the argument, raised
before anything is allocated; given sizes are checked (0 is an error, not "use the default").
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import torch

from .checks import MAX_DELAY_MS, MAX_RUNNING_REQUESTS, MAX_TOKENS, check_bool, check_int, check_real
from .mechanisms import Mechanisms

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Loop = Literal["normal", "overlap"]
Admission = Literal["reserve", "optimistic"]  # optimistic: features/retraction.py
AttentionBackendChoice = Literal["auto", "torch", "flashinfer"]
AttentionBackendName = Literal["torch", "flashinfer"]  # what "auto" resolves to

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineDefaults:
    """Every number the engine chooses on its own, with the reason for it."""

    # The most requests decoding at once. A GPU decode step costs about the same for 1 or 256
    # requests (it reads the weights once), so batch wide; on the CPU every request costs
    # compute, and 64 already saturates a laptop core.
    max_running_requests_cuda: int = 256
    max_running_requests_cpu: int = 64
    # Prompt tokens per prefill batch (chunked prefill): large on a GPU to fill it, small on the
    # CPU so that a long prompt does not stall the decodes behind it for long.
    chunk_size_cuda: int = 8192
    chunk_size_cpu: int = 512
    # While requests decode, admit new ones only when their prefill reaches this many tokens
    # (admission.PrefillGate; issue 27). An eager prefill batch costs its Python-launched
    # kernels on the host whatever its size (an iteration that launched one took 18-26 ms of
    # host work at 4,096 requests with the Qwen3-0.6B shape), and about 2 us per token on the
    # H200's device: below ~5k tokens the launches set its time. Admitted as running requests finish, a few at a time, batches held ~900 tokens
    # (24% of their floor at 1,024 requests). On one H200, 4,096 requests: a 4,096-token gate
    # gave batches of ~4,650 tokens at 37% of their floor, 7,168 gave ~6,850 tokens at 60%, and
    # the run 26,724 against 24,949 tok/s (benchmarks/RESULTS.md). 7,168 leaves room for one more
    # request under the 8,192-token chunk, so a batch is seldom cut. On the CPU prefill is
    # compute-bound (a token costs the same in any batch) and the lessons count batches: 0,
    # the gate is off, requests are admitted as soon as they fit.
    min_prefill_tokens_cuda: int = 7168
    min_prefill_tokens_cpu: int = 0
    # KV pool on a GPU: this fraction of the memory free after loading the weights, minus a
    # headroom for activations, CUDA graphs and sampling (vocab-wide float32 rows per request).
    kv_memory_fraction: float = 0.8
    kv_headroom_bytes: int = 4 << 30
    # KV pool on the CPU: a fixed host-memory budget (a laptop shares it with everything else).
    kv_host_bytes: int = 2 << 30
    # Whatever the budget says, at least enough for a few demo requests, and at most what the
    # device tables index comfortably (slot ids are int32 in attention kernels).
    kv_tokens_min: int = 1024
    kv_tokens_max_cuda: int = 1 << 20
    kv_tokens_max_cpu: int = 65536

    def max_running_requests(self, device: torch.device) -> int:
        return self.max_running_requests_cuda if device.type == "cuda" else self.max_running_requests_cpu

    def chunk_size(self, device: torch.device) -> int:
        return self.chunk_size_cuda if device.type == "cuda" else self.chunk_size_cpu

    def min_prefill_tokens(self, device: torch.device) -> int:
        return self.min_prefill_tokens_cuda if device.type == "cuda" else self.min_prefill_tokens_cpu

    def kv_tokens(self, device: torch.device, kv_bytes_per_token: int, weight_bytes: int) -> int:
        """KV slots that fit the memory budget of `device` once the weights are loaded,
        clamped to [kv_tokens_min, max]."""
        if device.type == "cuda":
            free_after_weights = free_memory_bytes(device) - weight_bytes
            budget = int(free_after_weights * self.kv_memory_fraction) - self.kv_headroom_bytes
            cap = self.kv_tokens_max_cuda
        else:
            budget, cap = self.kv_host_bytes, self.kv_tokens_max_cpu
        return max(self.kv_tokens_min, min(budget // kv_bytes_per_token, cap))


DEFAULTS = EngineDefaults()


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from, final and checked (build it with `resolve_config`)."""

    model_path: Path
    device: torch.device
    dtype: torch.dtype
    loop: Loop
    admission: Admission  # "reserve" (promise everything) or "optimistic" (estimate, retract if short)
    mechanisms: Mechanisms  # the switches (minisgl.MECHANISMS describes them)
    attention_backend: AttentionBackendName
    deterministic: bool  # batch-invariant kernels: a request's tokens do not depend on its batch
    trace: bool
    device_delay_ms: float  # emulated extra device time per forward (teaching aid)
    host_delay_ms: float  # emulated extra scheduler work per step (the lab's knob)
    max_running_requests: int
    chunk_size: int  # prompt tokens per prefill batch
    min_prefill_tokens: int  # while requests decode, admit when the prefill reaches this (0: always); <= chunk_size
    kv_tokens: int  # usable KV slots (the pool has one more: slot 0 is reserved, see kv_pool.py)
    model_window: int
    kv_bytes_per_token: int  # K and V of one position, every layer, in `dtype`
    weight_bytes: int  # the model's weights in `dtype`

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + new tokens: the model's window, or the KV pool less the one slot
        an overshoot step may write. The same arithmetic as Scheduler.check_fits(), so a prompt
        shorter than this with one new token always fits."""
        return min(self.model_window, self.kv_tokens - 1)

    @property
    def table_width(self) -> int:
        """Request-table width: no request holds more positions than the pool has slots, nor
        more than the model's window plus the one overshoot position."""
        return min(self.model_window + 1, self.kv_tokens)


def resolve_config(model_path: str | os.PathLike, *, device: str | torch.device | None, loop: str,
                   disable: object, device_delay_ms: float, dtype: str | torch.dtype | None,
                   max_running_requests: int | None, chunk_size: int | None, kv_tokens: int | None, trace: bool,
                   attention_backend: str, host_delay_ms: float, deterministic: bool, admission: str,
                   min_prefill_tokens: int | None) -> EngineConfig:
    """`LLM(...)`'s arguments -> one EngineConfig; reads config.json, not the weights."""
    if not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f"model_path must be a path, got {type(model_path).__name__}")
    mechanisms = Mechanisms(disable)
    check_choice("loop", loop, get_args(Loop))
    check_choice("admission", admission, get_args(Admission))
    check_choice("attention_backend", attention_backend, get_args(AttentionBackendChoice))
    device_delay_ms = check_real("device_delay_ms", device_delay_ms, 0.0, MAX_DELAY_MS)
    host_delay_ms = check_real("host_delay_ms", host_delay_ms, 0.0, MAX_DELAY_MS)
    check_bool("trace", trace)
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    max_running_requests = optional_size("max_running_requests", max_running_requests, MAX_RUNNING_REQUESTS)
    chunk_size = optional_size("chunk_size", chunk_size, MAX_TOKENS)
    min_prefill_tokens = optional_size("min_prefill_tokens", min_prefill_tokens, MAX_TOKENS, low=0)
    # The smallest request: a one-token prompt, one new token, and the slot an overshoot step writes.
    kv_tokens = optional_size("kv_tokens", kv_tokens, MAX_TOKENS, low=3)
    check_bool("deterministic", deterministic)

    from .models.checkpoint import load_config  # transformers: imported when an engine is built

    checkpoint, _ = load_config(Path(model_path), resolved_dtype)
    backend = resolve_attention_backend(attention_backend, resolved_device, resolved_dtype, head_dim_of(checkpoint))
    kv_bytes_per_token, weight_bytes = model_bytes(checkpoint, resolved_dtype)
    if resolved_device.type == "cuda":
        # An earlier engine dropped without close() may still hold device memory in reference
        # cycles: collect it, so that the free memory measured below is what this engine gets.
        gc.collect()
        torch.cuda.empty_cache()
    chunk_size = chunk_size or DEFAULTS.chunk_size(resolved_device)
    if min_prefill_tokens is None:  # the default, within the chunk size a user may have lowered
        min_prefill_tokens = min(DEFAULTS.min_prefill_tokens(resolved_device), chunk_size)
    elif min_prefill_tokens > chunk_size:
        raise ValueError(f"min_prefill_tokens must be at most chunk_size ({chunk_size}): no prefill batch holds "
                         f"more tokens; got {min_prefill_tokens}")
    config = EngineConfig(
        model_path=Path(model_path), device=resolved_device, dtype=resolved_dtype, loop=loop,  # type: ignore[arg-type]
        admission=admission, mechanisms=mechanisms, attention_backend=backend,  # type: ignore[arg-type]
        deterministic=deterministic, trace=trace,
        device_delay_ms=device_delay_ms, host_delay_ms=host_delay_ms,
        max_running_requests=max_running_requests or DEFAULTS.max_running_requests(resolved_device),
        chunk_size=chunk_size, min_prefill_tokens=min_prefill_tokens,
        kv_tokens=kv_tokens or DEFAULTS.kv_tokens(resolved_device, kv_bytes_per_token, weight_bytes),
        model_window=int(checkpoint.max_position_embeddings), kv_bytes_per_token=kv_bytes_per_token,
        weight_bytes=weight_bytes)
    check_memory(config)
    return config


# ------------------------------------------------------------------------------ the parts


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def optional_size(name: str, value: object, high: int, low: int = 1) -> int | None:
    """A size that is either left out (None: the default) or an integer in [low, high]."""
    return None if value is None else check_int(name, value, low, high)


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


def resolve_attention_backend(choice: str, device: torch.device, dtype: torch.dtype,
                              head_dim: int) -> AttentionBackendName:
    """"auto": FlashInfer on CUDA in bf16/fp16 when installed and the heads are large enough for its
    kernels, else the torch reference."""
    from .gpu.flashinfer_backend import FLASHINFER_MIN_HEAD_DIM, flashinfer_available

    if choice == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer backend needs a CUDA device")
    if choice == "flashinfer" and head_dim < FLASHINFER_MIN_HEAD_DIM:
        raise ValueError(f"the flashinfer backend needs head_dim >= {FLASHINFER_MIN_HEAD_DIM}; this model has "
                         f"{head_dim} (use attention_backend='torch' or 'auto')")
    half = dtype in (torch.float16, torch.bfloat16)
    usable = device.type == "cuda" and half and head_dim >= FLASHINFER_MIN_HEAD_DIM and flashinfer_available()
    if choice == "flashinfer" or (choice == "auto" and usable):
        return "flashinfer"
    return "torch"


def head_dim_of(checkpoint: PretrainedConfig) -> int:
    return getattr(checkpoint, "head_dim", None) or checkpoint.hidden_size // checkpoint.num_attention_heads


def model_bytes(checkpoint: PretrainedConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(K and V of one position in every layer, the weights) in bytes of `dtype`, from the
    checkpoint's sizes. Norms and biases, a few thousand values, are left out of the weights:
    this sizes memory budgets, not a file."""
    hidden, layers, vocab = checkpoint.hidden_size, checkpoint.num_hidden_layers, checkpoint.vocab_size
    head_dim = head_dim_of(checkpoint)
    q_size = checkpoint.num_attention_heads * head_dim
    kv_size = (checkpoint.num_key_value_heads or checkpoint.num_attention_heads) * head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * checkpoint.intermediate_size
    tied = bool(getattr(checkpoint, "tie_word_embeddings", False))
    element_bytes = torch.finfo(dtype).bits // 8
    weights = layers * per_layer + vocab * hidden * (1 if tied else 2)  # embedding, and lm_head unless tied
    return 2 * layers * kv_size * element_bytes, weights * element_bytes


def check_memory(config: EngineConfig) -> None:
    """Refuse sizes the device cannot hold before allocating them: a KV cache larger than the
    host's memory is not an error on Linux, it is the out-of-memory killer, later."""
    free = free_memory_bytes(config.device)
    rows, chunk = config.max_running_requests, config.chunk_size
    # Weights, KV cache, the int64 request table, and two staging buffers of about 8 int64 columns.
    need = (config.weight_bytes + (config.kv_tokens + 1) * config.kv_bytes_per_token
            + rows * config.table_width * 8 + 2 * 8 * 8 * max(chunk, rows))
    if free is not None and need > free:
        raise ValueError(f"kv_tokens={config.kv_tokens}, max_running_requests={rows} and chunk_size={chunk} need "
                         f"{need / 2**30:.1f} GiB on {config.device} with the weights, {free / 2**30:.1f} GiB "
                         f"is free; lower them")


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory an engine on `device` may still allocate: free GPU memory, or the host's
    MemAvailable on Linux; None where the host does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
