"""Where does a decode step's device time go? (H200; see benchmarks/RESULTS.md)

    python benchmarks/profile_decode.py MODEL_DIR

1. torch.profiler over 10 steady decode steps of 256 requests with ~800-token contexts,
   top kernels by CUDA time;
2. FlashInfer decode attention alone on the same shapes, with and without tensor cores.
"""

from __future__ import annotations

import sys
import time

import torch
from gpu_checks import long_prompts, steady_decode  # benchmarks/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams


def profile_steps(model: str) -> None:
    llm = LLM(model, device="cuda")
    steady_decode(llm, long_prompts(), SamplingParams(max_new_tokens=40, ignore_eos=True), warm_steps=5)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(10):
            llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print(f"10 decode steps of 256 requests: {wall * 100:.2f} ms per step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


def attention_alone(tensor_cores: bool, batch: int = 256, kv_len: int = 820, layers: int = 28) -> float:
    import flashinfer

    heads, kv_heads, dim = 16, 8, 128
    slots = batch * kv_len + 1
    k = torch.randn(slots, 1, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32) * kv_len
    indices = torch.randperm(slots - 1, device="cuda")[: batch * kv_len].int() + 1
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, indices, torch.ones(batch, dtype=torch.int32), heads, kv_heads, dim, 1,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    for _ in range(3):
        wrapper.run(q, (k, v))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(layers):
        wrapper.run(q, (k, v))
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000
    gbytes = layers * batch * kv_len * kv_heads * dim * 2 * 2 / 1e9
    print(f"FlashInfer decode x{layers} layers, B={batch}, kv={kv_len}, tensor_cores={tensor_cores}: "
          f"{ms:.2f} ms, {gbytes / (ms / 1000):.0f} GB/s")
    return ms


if __name__ == "__main__":
    attention_alone(False)
    attention_alone(True)
    profile_steps(sys.argv[1])
