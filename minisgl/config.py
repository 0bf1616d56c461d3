"""The engine's configuration: one frozen `EngineConfig`, resolved and checked once.

`resolve_config(...)` turns the settings (settings.py), their defaults and the checkpoint's config.json into
final values; `Engine` and `Scheduler` never re-check or re-default anything. One name per quantity: `kv_tokens`
(usable KV slots; the cache has one more, slot 0), `max_running_requests` (request-table rows), `model_window`
(the checkpoint's `max_position_embeddings`), `max_seq_len` (longest prompt + new tokens), `table_width`
(positions per row). A bad value is one ValueError/TypeError naming the argument, before any allocation."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .mechanisms import Mechanisms
from .settings import SETTING, SETTINGS, Admission, AttentionBackendName, Loop, SpeculativeAlgorithm

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class KVBudget:
    """How many KV slots `kv_tokens=None` gives: what fits the device's memory once the weights are loaded."""

    # On a GPU: this fraction of the memory free after loading the weights, minus a headroom for
    # activations, CUDA graphs and sampling (vocab-wide float32 rows per request).
    memory_fraction: float = 0.8
    headroom_bytes: int = 4 << 30
    # On the CPU: a fixed host-memory budget (a laptop shares it with everything else).
    host_bytes: int = 2 << 30
    # Whatever the budget says, at least enough for a few demo requests, and at most what the
    # device tables index comfortably (slot ids are int32 in attention kernels).
    min_tokens: int = 1024
    max_tokens_cuda: int = 1 << 20
    max_tokens_cpu: int = 65536

    def kv_tokens(self, device: torch.device, kv_bytes_per_token: int, weight_bytes: int) -> int:
        if device.type == "cuda":
            free_after_weights = free_memory_bytes(device) - weight_bytes
            budget = int(free_after_weights * self.memory_fraction) - self.headroom_bytes
            cap = self.max_tokens_cuda
        else:
            budget, cap = self.host_bytes, self.max_tokens_cpu
        return max(self.min_tokens, min(budget // kv_bytes_per_token, cap))


KV_BUDGET = KVBudget()


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from, final and checked (build it with `resolve_config`).
    The fields named in SETTINGS hold that setting's resolved value; the rest come from the checkpoint."""

    model_path: Path
    device: torch.device
    dtype: torch.dtype
    loop: Loop
    admission: Admission
    mechanisms: Mechanisms  # the switches, from `disable`
    attention_backend: AttentionBackendName
    deterministic: bool
    trace: bool
    device_delay_ms: float
    host_delay_ms: float
    max_running_requests: int
    chunk_size: int
    min_prefill_tokens: int  # <= chunk_size
    kv_tokens: int  # the pool has one more slot: slot 0 is reserved, see kv_pool.py
    speculative_algorithm: SpeculativeAlgorithm | None
    speculative_num_steps: int
    speculative_draft_model_path: Path | None
    enable_mixed_chunk: bool
    fused_kernels: bool
    tensor_core_decode_min_batch: int | None
    fast_decode_plan: bool
    piecewise_cuda_graph: bool
    model_window: int
    kv_bytes_per_token: int  # K and V of one position, every layer, in `dtype`
    weight_bytes: int  # the model's weights in `dtype`
    # a standalone draft: its cache has a row per slot of the target's pool, so each slot costs both
    draft_kv_bytes_per_token: int = 0
    draft_weight_bytes: int = 0

    @property
    def lookahead_slots(self) -> int:
        """KV positions a request may hold past its last committed token: the one slot an
        overshoot step writes, or with speculation two verify steps of K+1 tokens (the step in
        flight and the one planned before its accept lengths exist; SGLang: 2x the step's width)."""
        return 1 if self.speculative_algorithm is None else 2 * (self.speculative_num_steps + 1)

    @property
    def max_batch_tokens(self) -> int:
        """The most tokens one forward holds: a prefill chunk (plus one per running request when
        mixed), or a decode step of every running request (K+1 each when speculating)."""
        rows = self.max_running_requests
        step = rows * (self.speculative_num_steps + 1 if self.speculative_algorithm is not None else 1)
        return max(self.chunk_size + (rows if self.enable_mixed_chunk else 0), step)

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + new tokens: the model's window, or the KV pool less the one slot
        an overshoot step may write. The same arithmetic as Scheduler.check_fits(), so a prompt
        shorter than this with one new token always fits."""
        return min(self.model_window, self.kv_tokens - self.lookahead_slots)

    @property
    def table_width(self) -> int:
        """Request-table width: no request holds more positions than the pool has slots, nor
        more than the model's window plus the one overshoot position."""
        return min(self.model_window + self.lookahead_slots, self.kv_tokens)


def resolve_config(model_path: str | os.PathLike, settings: Mapping[str, Any]) -> EngineConfig:
    """`LLM(model_path, **settings)` -> one EngineConfig; reads config.json, not the weights.
    A setting left out takes its default."""
    if not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f"model_path must be a path, got {type(model_path).__name__}")
    unknown = sorted(settings.keys() - SETTING.keys())
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; the settings are {', '.join(SETTING)}")
    given = {s.name: s.check(settings.get(s.name, s.default)) for s in SETTINGS}
    mechanisms = Mechanisms(given["disable"])
    device = resolve_device(given["device"])
    dtype = resolve_dtype(given["dtype"], device)
    per_device = {s.name: s.default_for(device) for s in SETTINGS if s.per_device is not None and given[s.name] is None}
    chunk_size = per_device.get("chunk_size", given["chunk_size"])
    if given["min_prefill_tokens"] is None:  # the default, within the chunk size a user may have lowered
        per_device["min_prefill_tokens"] = min(per_device["min_prefill_tokens"], chunk_size)
    elif given["min_prefill_tokens"] > chunk_size:
        raise ValueError(f"min_prefill_tokens must be at most chunk_size ({chunk_size}): no prefill batch holds "
                         f"more tokens; got {given['min_prefill_tokens']}")
    check_speculation(given["speculative_algorithm"], given["speculative_draft_model_path"], Path(model_path),
                      given["enable_mixed_chunk"])

    from .models.checkpoint import load_config  # transformers: imported when an engine is built

    checkpoint, _ = load_config(Path(model_path), dtype)
    backend = resolve_attention_backend(given["attention_backend"], device, dtype, head_dim_of(checkpoint))
    kv_bytes_per_token, weight_bytes = model_bytes(checkpoint, dtype)
    draft_kv_bytes, draft_weight_bytes = draft_bytes(given["speculative_algorithm"],
                                                     given["speculative_draft_model_path"], dtype)
    if device.type == "cuda":
        # An earlier engine dropped without close() may still hold device memory in reference
        # cycles: collect it, so that the free memory measured below is what this engine gets.
        gc.collect()
        torch.cuda.empty_cache()
    kv_tokens = given["kv_tokens"] or KV_BUDGET.kv_tokens(device, kv_bytes_per_token + draft_kv_bytes,
                                                          weight_bytes + draft_weight_bytes)
    resolved = {**given, **per_device, "device": device, "dtype": dtype, "disable": mechanisms,
                "attention_backend": backend, "kv_tokens": kv_tokens}
    config = EngineConfig(**{s.field or s.name: resolved[s.name] for s in SETTINGS}, model_path=Path(model_path),
                          model_window=int(checkpoint.max_position_embeddings), kv_bytes_per_token=kv_bytes_per_token,
                          weight_bytes=weight_bytes, draft_kv_bytes_per_token=draft_kv_bytes,
                          draft_weight_bytes=draft_weight_bytes)
    check_memory(config, free_memory_bytes(device))
    return config


# ------------------------------------------------------------------------------ the parts


def check_speculation(algorithm: str | None, draft_model_path: Path | None, model_path: Path,
                      mixed_chunk: bool) -> None:
    """A draft model only for the standalone algorithm, and one that exists (only the demo model has
    a default draft); no mixed chunk with speculation (SGLang switches it off for STANDALONE and NGRAM)."""
    from .demo.paths import is_demo_model

    if algorithm is not None and mixed_chunk:
        raise ValueError(f"enable_mixed_chunk does not combine with speculative_algorithm={algorithm!r} "
                         f"(nor does it in SGLang); choose one")
    if algorithm == "standalone" and draft_model_path is None and not is_demo_model(model_path):
        raise ValueError("speculative_algorithm='standalone' needs speculative_draft_model_path (a small model with "
                         "the target's tokenizer); only the demo model has a default draft")
    if draft_model_path is None:
        return
    if algorithm != "standalone":
        raise ValueError(f"speculative_draft_model_path is read only by speculative_algorithm='standalone'; "
                         f"got speculative_algorithm={algorithm!r}")
    if not draft_model_path.is_dir():
        raise ValueError(f"speculative_draft_model_path {str(draft_model_path)!r} is not a directory")


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
        dtype = SETTING["dtype"].default_for(device)
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


def draft_bytes(algorithm: str | None, draft_model_path: Path | None, dtype: torch.dtype) -> tuple[int, int]:
    """The standalone draft's KV bytes per slot and its weight bytes, in `dtype`; (0, 0) without one."""
    if algorithm != "standalone":
        return 0, 0
    from .demo.paths import DEMO_DRAFT_DIR
    from .models.checkpoint import load_config

    draft, _ = load_config(Path(draft_model_path or DEMO_DRAFT_DIR), dtype)
    return model_bytes(draft, dtype)


def check_memory(config: EngineConfig, free: int | None) -> None:
    """Refuse sizes the device cannot hold (`free` bytes; None: unknown) before allocating them: a
    KV cache larger than the host's memory is not an error on Linux, it is the out-of-memory killer, later."""
    rows, chunk = config.max_running_requests, config.chunk_size
    # Weights and KV cache (a draft's too), the int64 request table, two staging buffers of about 8 int64 columns.
    need = (config.weight_bytes + config.draft_weight_bytes
            + (config.kv_tokens + 1) * (config.kv_bytes_per_token + config.draft_kv_bytes_per_token)
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
