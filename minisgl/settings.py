"""The engine's settings: one table of knobs, each an `LLM(...)` keyword, a CLI flag and an `EngineConfig`
field, with its default, range and help (nothing else repeats them). Free of torch, so that the command
line builds its flags without importing it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from .checks import MAX_DELAY_MS, MAX_RUNNING_REQUESTS, MAX_TOKENS, check_bool, check_int, check_real

if TYPE_CHECKING:
    import torch

Loop = Literal["normal", "overlap"]
Admission = Literal["reserve", "optimistic"]  # optimistic: features/retraction.py
AttentionBackendChoice = Literal["auto", "torch", "flashinfer"]
AttentionBackendName = Literal["torch", "flashinfer"]  # what "auto" resolves to
SpeculativeAlgorithm = Literal["ngram", "standalone"]

MAX_SPECULATIVE_STEPS = 64  # drafted tokens per verify: each is one draft forward, more is a typo


@dataclass(frozen=True)
class Setting:
    """One knob: an `LLM(...)` keyword, a CLI flag and an `EngineConfig` field, with its range and help."""

    name: str
    default: Any  # LLM's default; None stands for `per_device`, or for what `none` says
    help: str
    # int, float, bool, str (one of `choices`), Path; tuple: names (Mechanisms checks them);
    # object: resolve_config resolves it (a device, a dtype)
    kind: type = int
    low: float = 0
    high: float = 0
    choices: tuple[str, ...] = ()
    per_device: tuple[Any, Any] | None = None  # (cpu, cuda): what None becomes
    none: str = ""  # what None means, where it is accepted and is not the per-device default
    field: str = ""  # the EngineConfig field, where it is not `name`
    cli: bool = True  # False: no engine flag (the command that needs it sets it)

    @property
    def accepts_none(self) -> bool:
        return self.default is None or bool(self.none)

    def check(self, value: Any) -> Any:
        """`value` if it has the right type and lies in range (TypeError / ValueError naming the setting)."""
        if value is None and self.accepts_none:
            return None
        if self.kind is int:
            return check_int(self.name, value, int(self.low), int(self.high))
        if self.kind is float:
            return check_real(self.name, value, self.low, self.high)
        if self.kind is bool:
            return check_bool(self.name, value)
        if self.choices:
            if value not in self.choices:
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}; got {value!r}")
        elif self.kind is Path:
            if not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{self.name} must be a path, got {type(value).__name__}")
            return Path(value)
        return value

    def default_for(self, device: torch.device) -> Any:
        return self.default if self.per_device is None else self.per_device[device.type == "cuda"]


# In the order of LLM's keywords (LLM.__init__ lists them again, and a test holds the two together).
SETTINGS: tuple[Setting, ...] = (
    Setting("device", None, "cpu, cuda or cuda:N", kind=object, none="cuda if available, else cpu"),
    Setting("loop", "overlap", "overlap: plan batch n+1 while the device runs batch n; normal: one after the other",
            kind=str, choices=get_args(Loop)),
    Setting("disable", (), "overlap mechanisms to switch off (minisgl.MECHANISMS)", kind=tuple, field="mechanisms"),
    Setting("device_delay_ms", 0.0, "emulated extra device time per forward (CPU teaching aid)", kind=float,
            high=MAX_DELAY_MS),
    Setting("dtype", None, "float32 | bfloat16 | float16", kind=object, per_device=("float32", "bfloat16")),
    # A GPU decode step costs about the same for 1 or 256 requests (it reads the weights once), so
    # batch wide; on the CPU every request costs compute, and 64 already saturates a laptop core.
    Setting("max_running_requests", None, "the most requests decoding at once (the request table's rows)",
            low=1, high=MAX_RUNNING_REQUESTS, per_device=(64, 256)),
    # Large on a GPU to fill it, small on the CPU so that a long prompt does not stall the decodes behind it.
    Setting("chunk_size", None, "prompt tokens per prefill batch (chunked prefill)", low=1, high=MAX_TOKENS,
            per_device=(512, 8192)),
    # The smallest pool: a one-token prompt, one new token, and the slot an overshoot step writes.
    Setting("kv_tokens", None, "usable KV cache slots", low=3, high=MAX_TOKENS,
            none="what fits the device's memory budget (config.KV_BUDGET)"),
    Setting("trace", False, "record host and device spans for a timeline", kind=bool, cli=False),
    Setting("attention_backend", "auto", "auto: flashinfer on CUDA in bf16/fp16 where it has kernels, else torch",
            kind=str, choices=get_args(AttentionBackendChoice)),
    Setting("host_delay_ms", 0.0, "emulated extra scheduler (host) work per loop iteration (the lab's knob)",
            kind=float, high=MAX_DELAY_MS),
    Setting("deterministic", False, "batch-invariant kernels on CUDA (the CPU always runs them): a request's "
            "tokens do not depend on its batch", kind=bool),
    Setting("admission", "reserve", "reserve: promise prompt + max_new_tokens per request; optimistic: estimate "
            "what running requests still need (new-token ratio) and retract when a decode step runs short",
            kind=str, choices=get_args(Admission)),
    # The prefill gate: on a GPU a small eager prefill batch is launch-bound, so the gate waits for about one
    # chunk of prompt tokens (benchmarks/RESULTS.md). On the CPU prefill is compute-bound and the lessons
    # count batches: 0, the gate is off.
    Setting("min_prefill_tokens", None, "while requests decode, admit new ones only when their prefill reaches "
            "this many tokens (0: as soon as they fit; at most chunk_size)", low=0, high=MAX_TOKENS,
            per_device=(0, 7168)),
    Setting("speculative_algorithm", None, "ngram: drafts from the request's own tokens; standalone: a small draft "
            "model (features/speculative/)", kind=str, choices=get_args(SpeculativeAlgorithm),
            none="no speculation"),
    Setting("speculative_num_steps", 3, "drafted tokens per verify step: one chain, top-k 1", low=1,
            high=MAX_SPECULATIVE_STEPS),
    Setting("speculative_draft_model_path", None, "the draft model's checkpoint directory (standalone)", kind=Path,
            none="no draft model given"),
    Setting("enable_mixed_chunk", False, "a prefill chunk and the running decodes in one forward "
            "(features/mixed_chunk.py)", kind=bool),
    Setting("fused_kernels", True, "FlashInfer's fused norm, rotary and activation kernels and the Triton qkv "
            "epilogue on CUDA in bf16/fp16 (False: the torch reference kernels)", kind=bool),
    # The tensor-core kernel serves a KV head's query group in one pass: in the offline runs it was faster at
    # every batch size on both model shapes, most where the group is large (benchmarks/RESULTS.md).
    Setting("tensor_core_decode_min_batch", 1, "FlashInfer decodes batches of this many requests and more "
            "with its tensor-core kernel (grouped heads)", low=1, high=MAX_RUNNING_REQUESTS,
            none="never (the deterministic mode always does)"),
    # FlashInfer's plan() takes Python's max over the lengths element by element, host work that grows with
    # the batch (benchmarks/RESULTS.md); the fast plan skips it and schedules the same work.
    Setting("fast_decode_plan", True, "plan decode attention with FlashInfer's fast_decode_plan after each "
            "wrapper's first plan() (False: plan() every time)", kind=bool),
    # On where it can run (the decode graphs on, the qkv epilogue fused, no speculation; else
    # Engine.prefill_graphs_off says why): an A/B on the H200 took the prefill's launch from 15-17 to
    # 5 ms of host per iteration and its device time down 12% at 4,096 requests (benchmarks/RESULTS.md).
    Setting("piecewise_cuda_graph", True, "prefill and other forwards outside the decode graphs from CUDA "
            "graphs cut at attention, which runs eagerly between them (gpu/piecewise_graph.py)", kind=bool),
)
SETTING = {s.name: s for s in SETTINGS}

