"""GPU fast paths for the model's elementwise steps, from FlashInfer (the `cuda` extra).

In bf16 on an H200 a decode step of a 0.6B model spends as much time in tiny elementwise
kernels (RMSNorm's casts and reductions, rotary's chunk/cat/mul/add, SiLU-and-mul, the
residual adds) as in attention: hundreds of 2-3 us launches per step (measured:
benchmarks/RESULTS.md). These fused kernels do each step in one launch. Same math as the torch
code in models/decoder.py, which stays the reference and the only path on CPU and in float32.
One more comes from our own Triton kernel (qkv_epilogue.py): everything between the q/k/v
projection and attention, the K/V pool writes included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import qkv_epilogue as _epilogue
from .flashinfer_backend import flashinfer_available

if TYPE_CHECKING:  # models/decoder.py imports this module
    from ..models.decoder import Attention, Rotation

ENABLED = True  # tests flip this to compare against the torch reference
_AVAILABLE: bool | None = None


def active(x: torch.Tensor) -> bool:
    global _AVAILABLE
    if not (ENABLED and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)):
        return False
    if _AVAILABLE is None:
        _AVAILABLE = flashinfer_available()
    return _AVAILABLE


def qkv_epilogue_active(qkv: torch.Tensor, head_dim: int) -> bool:
    return active(qkv) and _epilogue.available(head_dim)


def qkv_epilogue(qkv: torch.Tensor, attn: Attention, rotation: Rotation, out_slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D] ready for attention, from the projection's output qkv of `attn` (a
    decoder `Attention`); its k and v are written into the pools at out_slots."""
    q_weight, k_weight = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    eps = attn.q_norm.eps if attn.qk_norm else 0.0
    return _epilogue.qkv_epilogue(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim, rotation.positions,
                                  rotation.cos_sin_cache, q_weight, k_weight, eps, out_slots, k_pool, v_pool)


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
