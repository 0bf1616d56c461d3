"""GPU fast paths for the model's elementwise steps, from FlashInfer (the `cuda` extra).

Written in plain torch, each elementwise step of the decoder (RMSNorm's casts and reductions,
rotary's chunk/cat/mul/add, SiLU-and-mul, the residual adds) is several tiny kernels, and a
kernel costs a few microseconds however little it does: on a small model a decode step then
spends about as long in them as in attention (benchmarks/RESULTS.md). These fused kernels do
each step in one launch. `FusedKernels` computes
what models/decoder.py's `TorchKernels` does, which stays the reference and the only path on
CPU and in float32; the engine hands a model one or the other (`decoder_kernels`). One more
comes from our own Triton kernel (qkv_epilogue.py): everything between the q/k/v projection
and attention, the K/V pool writes included.
"""

from __future__ import annotations

import torch

from ..models.decoder import Attention, RMSNorm, RotaryEmbedding, TorchKernels
from . import qkv_epilogue as _epilogue
from .flashinfer_backend import flashinfer_available


def decoder_kernels(device: torch.device, dtype: torch.dtype, fused: bool) -> TorchKernels:
    """The kernels an engine hands its model: fused on CUDA in bf16/fp16 when FlashInfer is
    installed (and `fused`, the setting fused_kernels), the torch reference otherwise."""
    if fused and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashinfer_available():
        return FusedKernels()
    return TorchKernels()


def writes_kv_in_epilogue(model: torch.nn.Module) -> bool:
    """Does the model's qkv epilogue write the new K/V into the pool itself (the Triton kernel)?"""
    return isinstance(model.kernels, FusedKernels) and _epilogue.available(model.head_dim)


class FusedRotation:
    """Rotate-half ("neox") rotary of one batch's positions by FlashInfer's kernel, which reads
    the positions and the model's cos/sin table (the qkv epilogue reads them too)."""

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
        self.positions = positions
        self.cos_sin_cache = cos_sin_cache

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D], rotated in place on copies."""
        import flashinfer

        num_tokens, _, head_dim = q.shape
        q, k = q.contiguous(), k.contiguous()
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
            self.positions, q.view(num_tokens, -1), k.view(num_tokens, -1), head_dim, self.cos_sin_cache,
            is_neox=True)
        return q, k


class FusedKernels(TorchKernels):
    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        import flashinfer

        return flashinfer.norm.rmsnorm(x.reshape(-1, x.shape[-1]), norm.weight, norm.eps).view(x.shape)

    def add_rms_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel, in place: residual becomes the sum, x its norm."""
        import flashinfer

        flashinfer.norm.fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
        return residual, x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        import flashinfer

        return flashinfer.activation.silu_and_mul(gate_up)

    def rotation(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> FusedRotation:
        return FusedRotation(positions, rotary.cos_sin_cache())

    # `rotation` is always this object's own (CausalLM.forward makes it with the same kernels).
    def qkv_epilogue(self, attn: Attention, qkv: torch.Tensor, rotation: FusedRotation,  # type: ignore[override]
                     out_slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One Triton kernel for split, q/k norm, rotary and the K/V pool writes (seven otherwise),
        where it takes the head size; the new K/V are then in the pool already (k = v = None)."""
        if not _epilogue.available(attn.head_dim):
            return super().qkv_epilogue(attn, qkv, rotation, out_slots, k_pool, v_pool, q_out)
        q_weight, k_weight = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        eps = attn.q_norm.eps if attn.qk_norm else 0.0
        q = _epilogue.qkv_epilogue(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim, rotation.positions,
                                   rotation.cos_sin_cache, q_weight, k_weight, eps, out_slots, k_pool, v_pool, q_out)
        return q, None, None
