"""A small-tile Triton GEMM, to test whether cuBLAS leaves time on the decode GEMMs.

(`python benchmarks/profile_decode.py MODEL gemm`; the figures are in benchmarks/RESULTS.md.)

In a CUDA graph, cuBLAS took 5-8 us for each of the four layer GEMMs of the Qwen3-0.6B shape
(12.8 us for o_proj at one row), from 1 to 256 rows, where reading the weights takes 1-3 us. A
1,024-wide projection in large tiles makes only a dozen or two thread blocks for 132 SMs, so the
guess was that most SMs sit idle. This kernel cuts the output columns into tiles as narrow as
16, so that every projection makes more thread blocks, and accumulates in float32 like cuBLAS.

It did not beat cuBLAS. Its best tile was never more than 0.5 us faster (apart from o_proj at
one row), and from 192 rows up it was slower for every shape. The engine keeps
`torch.nn.functional.linear`; this file stays with the benchmark that measured the question.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: the reference path is the only one
    triton = None

if triton is not None:

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[M, N] = x[M, K] @ w[N, K]^T; one program per (BLOCK_N columns, BLOCK_M rows)."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
        w_tile = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]  # w^T: [BLOCK_K, BLOCK_N]
        row_ok, col_ok = rows[:, None] < M, cols[None, :] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0: checked by the caller
            acc = tl.dot(tl.load(x_tile, mask=row_ok, other=0.0), tl.load(w_tile, mask=col_ok, other=0.0), acc)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        out = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok & col_ok)


def linear(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int, block_k: int,
           num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T with the given tiles (K % block_k == 0)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _linear_kernel[grid](x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                         num_stages=num_stages)
    return y
