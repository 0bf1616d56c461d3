"""GPU fast paths for the model's elementwise steps, from FlashInfer (the `cuda` extra).

In bf16 on an H200 a decode step of a 0.6B model spends as much time in tiny elementwise
kernels (RMSNorm's casts and reductions, rotary's chunk/cat/mul/add, SiLU-and-mul, the
residual adds) as in attention: hundreds of 2-3 us launches per step (measured:
benchmarks/RESULTS.md). These fused kernels do each step in one launch. Same math as the torch
code in models/decoder.py, which stays the reference and the only path on CPU and in float32.
"""

from __future__ import annotations

import torch

from .flashinfer_backend import flashinfer_available

ENABLED = True  # tests flip this to compare against the torch reference
_AVAILABLE: bool | None = None


def active(x: torch.Tensor) -> bool:
    global _AVAILABLE
    if not (ENABLED and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)):
        return False
    if _AVAILABLE is None:
        _AVAILABLE = flashinfer_available()
    return _AVAILABLE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import flashinfer

    return flashinfer.norm.rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm of it) in one kernel, in place: residual becomes the sum, x its norm."""
    import flashinfer

    flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)
    return residual, x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    import flashinfer

    return flashinfer.activation.silu_and_mul(gate_up)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half ("neox") rotary on q [T, Hq, D] and k [T, Hkv, D], in place on copies."""
    import flashinfer

    num_tokens, _, head_dim = q.shape
    q, k = q.contiguous(), k.contiguous()
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
        positions, q.view(num_tokens, -1), k.view(num_tokens, -1), head_dim, cos_sin_cache, is_neox=True)
    return q, k
