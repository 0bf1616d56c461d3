"""One GPU kernel for everything between the q/k/v projection and attention (Triton).

After `qkv_proj`, each layer has to: split the output into q, k and v heads; RMS-normalise
every q and k head (Qwen3); rotate q and k by their positions (rotary); and write k and v
into the KV pool at the batch's slots. Done one step at a time that is seven small kernels
per layer (two reshaping copies, two norms, rotary, two pool writes), each a few microseconds
on a decode batch, i.e. about 200 launches per decode step of a 28-layer model.

Here one program handles one token: it reads the token's q, k and v heads once, does the
norms and the rotation in registers, and writes the results where attention reads them (q
into a fresh [T, Hq, D] tensor, k and v into the pool at the token's slot). The numbers are
the reference's (models/decoder.py, `Attention.forward` with the fused ops off), rounded where
it rounds:
the normalised head is rounded to the model dtype before the norm weight multiplies it, and
again after; the rotation is computed in float32 and rounded once, as FlashInfer's rotary
kernel does. tests/test_qkv_epilogue.py compares the kernel with the reference, within bf16
rounding (on the CPU in Triton's interpreter, and on the GPU).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: the reference path is the only one
    triton = None


def available(head_dim: int) -> bool:
    """Triton is installed and each half of a head is a power of two (tl.arange needs one)."""
    half = head_dim // 2
    return triton is not None and head_dim % 2 == 0 and half & (half - 1) == 0


if triton is not None:

    @triton.jit
    def _norm_and_rotate(src, dst, num_heads, weight_ptr, eps, cos, sin, heads, offs,
                         HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
        """Heads [heads, HEAD_DIM] at src: RMSNorm each (QK_NORM), rotate, store at dst."""
        HALF = HEAD_DIM // 2
        rows = heads[:, None] * HEAD_DIM
        mask = heads[:, None] < num_heads
        first = tl.load(src + rows + offs[None, :], mask=mask, other=0.0)
        second = tl.load(src + rows + HALF + offs[None, :], mask=mask, other=0.0)
        x1 = first.to(tl.float32)
        x2 = second.to(tl.float32)
        if QK_NORM:
            inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
            w1 = tl.load(weight_ptr + offs).to(tl.float32)[None, :]
            w2 = tl.load(weight_ptr + HALF + offs).to(tl.float32)[None, :]
            # rounded like the reference: norm -> model dtype, times the weight -> model dtype
            x1 = ((x1 * inv_rms).to(first.dtype).to(tl.float32) * w1).to(first.dtype).to(tl.float32)
            x2 = ((x2 * inv_rms).to(first.dtype).to(tl.float32) * w2).to(first.dtype).to(tl.float32)
        # rotate-half rotary: dim i pairs with dim i + HEAD_DIM/2, both at the same angle
        tl.store(dst + rows + offs[None, :], (x1 * cos - x2 * sin).to(first.dtype), mask=mask)
        tl.store(dst + rows + HALF + offs[None, :], (x2 * cos + x1 * sin).to(first.dtype), mask=mask)

    @triton.jit
    def _qkv_epilogue_kernel(qkv_ptr, qkv_row_stride, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, eps,
                             out_slots_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr,
                             NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             Q_HEADS_POW2: tl.constexpr, KV_HEADS_POW2: tl.constexpr, QK_NORM: tl.constexpr):
        """One program per token: its q heads, then its k heads, then its v heads."""
        token = tl.program_id(0).to(tl.int64)  # token * row stride may pass 2**31 in a long prefill
        offs = tl.arange(0, HEAD_DIM // 2)
        src = qkv_ptr + token * qkv_row_stride
        slot = tl.load(out_slots_ptr + token)
        angle_row = cos_sin_ptr + tl.load(positions_ptr + token) * HEAD_DIM
        cos = tl.load(angle_row + offs)[None, :]
        sin = tl.load(angle_row + HEAD_DIM // 2 + offs)[None, :]
        _norm_and_rotate(src, q_out_ptr + token * (NUM_Q_HEADS * HEAD_DIM), NUM_Q_HEADS, q_weight_ptr, eps, cos, sin,
                         tl.arange(0, Q_HEADS_POW2), offs, HEAD_DIM, QK_NORM)
        kv_heads = tl.arange(0, KV_HEADS_POW2)
        _norm_and_rotate(src + NUM_Q_HEADS * HEAD_DIM, k_pool_ptr + slot * (NUM_KV_HEADS * HEAD_DIM), NUM_KV_HEADS,
                         k_weight_ptr, eps, cos, sin, kv_heads, offs, HEAD_DIM, QK_NORM)
        # v: into the pool unchanged
        v_offs = kv_heads[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        v_mask = kv_heads[:, None] < NUM_KV_HEADS
        v = tl.load(src + (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM + v_offs, mask=v_mask)
        tl.store(v_pool_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + v_offs, v, mask=v_mask)


def qkv_epilogue(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 positions: torch.Tensor, cos_sin_cache: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, out_slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D] normed and rotated (into q_out if given); k (normed,
    rotated) and v written to k_pool / v_pool [slots, Hkv, D] at out_slots. q_weight None: no q/k norm."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(1) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous() and cos_sin_cache.is_contiguous()
    q = torch.empty(num_tokens, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    assert q.shape == (num_tokens, num_q_heads, head_dim) and q.is_contiguous()
    if num_tokens:
        qk_norm = q_weight is not None
        _qkv_epilogue_kernel[(num_tokens,)](
            qkv, qkv.stride(0), positions, cos_sin_cache, q_weight if qk_norm else qkv, k_weight if qk_norm else qkv,
            eps, out_slots, q, k_pool, v_pool, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            Q_HEADS_POW2=triton.next_power_of_2(num_q_heads), KV_HEADS_POW2=triton.next_power_of_2(num_kv_heads),
            QK_NORM=qk_norm, num_warps=4)
    return q
