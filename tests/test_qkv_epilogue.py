"""The fused q/k/v epilogue (minisgl/gpu/qkv_epilogue.py) against the torch reference.

The kernel replaces split + q/k RMSNorm + rotary + the K/V pool writes. It is compared with the
reference modules of models/decoder.py on random heads, for a Qwen3-like attention (q/k norm)
and a Llama-like one (none), in bf16 and fp16: q and k close, v bit for bit, and no pool slot
other than the batch's own written. On the CPU the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess: the switch is read when the kernel is defined); on the
GPU (tests marked cuda) it is compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl.gpu import qkv_epilogue
from minisgl.models.decoder import RMSNorm, RotaryEmbedding

ROOT = Path(__file__).resolve().parent.parent


def compare(device: str) -> None:
    """Raise AssertionError if the kernel and the reference disagree on any case."""
    torch.manual_seed(0)
    cases = [(16, 8, 128, True, torch.bfloat16), (16, 8, 128, False, torch.bfloat16),
             (28, 4, 128, True, torch.bfloat16), (12, 6, 64, True, torch.bfloat16),  # head counts no power of two
             (4, 2, 64, True, torch.float16), (8, 8, 64, False, torch.float16)]
    for num_q, num_kv, head_dim, qk_norm, dtype in cases:
        tokens, slots = 7, 40
        qkv = (3 * torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, device=device)).to(dtype)
        positions = torch.tensor([0, 1, 5, 17, 300, 2047, 9], device=device)
        out_slots = torch.tensor([3, 39, 11, 12, 1, 25, 30], device=device)
        rotary = RotaryEmbedding(head_dim, {"rope_theta": 1e6, "rope_type": "default"}, 2048).to(device)
        norms = [RMSNorm(head_dim, 1e-6).to(device=device, dtype=dtype) for _ in range(2)]
        for norm in norms:
            norm.weight.data = (1 + 0.5 * torch.randn(head_dim, device=device)).to(dtype)
        k_pool = torch.full((slots, num_kv, head_dim), 7.0, dtype=dtype, device=device)
        v_pool = k_pool.clone()

        q = qkv_epilogue.qkv_epilogue(qkv, num_q, num_kv, head_dim, positions, rotary.cos_sin_cache(),
                                      norms[0].weight if qk_norm else None, norms[1].weight if qk_norm else None,
                                      1e-6, out_slots, k_pool, v_pool)

        # the reference: the model's own modules, plain torch
        ref_q, ref_k, ref_v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
        ref_q = ref_q.reshape(tokens, num_q, head_dim)
        ref_k = ref_k.reshape(tokens, num_kv, head_dim)
        if qk_norm:
            ref_q, ref_k = norms[0](ref_q), norms[1](ref_k)
        ref_q, ref_k = rotary(positions, dtype)(ref_q, ref_k)

        case = f"(Hq {num_q}, Hkv {num_kv}, D {head_dim}, qk_norm {qk_norm}, {dtype})"
        # A few units in the last place of a value of ~6: the reference rounds rotary's
        # products to the model dtype one by one, the kernel rounds once.
        torch.testing.assert_close(q.float(), ref_q.float(), atol=0.07, rtol=0.02, msg=lambda m: f"q {case}: {m}")
        torch.testing.assert_close(k_pool[out_slots].float(), ref_k.float(), atol=0.07, rtol=0.02,
                                   msg=lambda m: f"k {case}: {m}")
        assert torch.equal(v_pool[out_slots], ref_v.reshape(tokens, num_kv, head_dim)), f"v not copied exactly {case}"
        untouched = torch.ones(slots, dtype=torch.bool, device=device)
        untouched[out_slots] = False
        assert (k_pool[untouched] == 7).all() and (v_pool[untouched] == 7).all(), f"wrote outside out_slots {case}"


def test_epilogue_matches_reference_in_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed: `python install.py --triton` adds it")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", "from tests.test_qkv_epilogue import compare; compare('cpu')"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.cuda
def test_epilogue_matches_reference_on_gpu():
    compare("cuda")


def test_head_dims_the_kernel_takes():
    if qkv_epilogue.triton is None:
        pytest.skip("triton not installed")
    assert qkv_epilogue.available(128) and qkv_epilogue.available(64)
    assert not qkv_epilogue.available(80)  # half of it (40) is no power of two: the reference path runs
