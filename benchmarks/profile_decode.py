"""Where does a decode step's device time go? (H200; see benchmarks/RESULTS.md)

    python benchmarks/profile_decode.py MODEL_DIR [steps|run|attention]

steps (default): FlashInfer decode attention alone on 256 requests with ~800-token contexts,
   with and without tensor cores, then torch.profiler over 10 steady decode steps of that
   batch, top kernels by CUDA time;
run: torch.profiler over the whole offline workload (`bench --workload offline`, overlap
   loop, graphs on): every kernel's total time, grouped by what it does, against the run's wall
   time: where the device time beyond the floor goes;
attention: FlashInfer decode attention alone on batches like the offline run's tail (lengths
   drawn as its contexts, at several batch sizes), with and without tensor cores, in the order
   drawn and longest first, against the measured HBM bandwidth. Timed as eager calls: at the
   small batches the launch, not the kernel, may set the time.
"""

from __future__ import annotations

import random
import sys
import time

import torch
from gpu_checks import long_prompts, steady_decode  # benchmarks/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams
from minisgl.observe.breakdown import measure_ceilings, timed


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


KERNEL_GROUPS = (  # first match wins: (group, substrings of the kernel's name, lower case)
    # One group for both: tensor-core decode runs FlashInfer's prefill kernel, so the kernel's
    # name does not tell a decode batch from a prefill one.
    ("attention, decode and prefill", ("batchdecode", "decodewithpagedkv", "variablelengthmergestates",
                                       "batchprefill", "prefillwithkvcache", "prefillwithpagedkv")),
    ("fused q/k/v epilogue (Triton)", ("qkv_epilogue",)),
    ("rmsnorm", ("rmsnorm", "norm_kernel")),
    ("rotary", ("rope",)),
    ("silu-and-mul", ("act_and_mul", "silu")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "splitk")),
    ("argmax / reductions", ("reduce",)),
    ("index, gather, scatter", ("index", "gather", "scatter")),
    ("copies, casts, cat", ("copy", "cat", "convert", "memcpy", "memset", "fill")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other elementwise")


def profile_run(model: str) -> None:
    from minisgl.observe.bench import offline_workload

    workload = offline_workload()
    llm = LLM(model, device="cuda")
    llm.generate([workload.prompts[0][:8]], SamplingParams(max_new_tokens=4))
    torch.cuda.synchronize()
    warm_prefill, warm_decode = llm.stats.prefill_batches, llm.stats.decode_batches
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(workload.prompts, workload.params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    steps = f"{llm.stats.prefill_batches - warm_prefill} prefill + {llm.stats.decode_batches - warm_decode} decode batches"
    llm.close()
    groups: dict[str, list[float]] = {}
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels) / 1e6
    print(f"whole offline run under the profiler: wall {wall:.2f} s, kernel time {total:.2f} s, {steps}")
    for e in kernels:
        g = groups.setdefault(kernel_group(e.key), [0.0, 0])
        g[0] += e.self_device_time_total / 1e6
        g[1] += e.count
    print(f"{'group':<26}{'s':>8}{'share':>8}{'launches':>10}{'us each':>9}")
    for name, (secs, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:<26}{secs:8.3f}{secs / total:8.1%}{count:10d}{secs / count * 1e6:9.1f}")
    print("top kernels:")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"  {e.self_device_time_total / 1e6:7.3f} s {e.count:8d} x {e.self_device_time_total / e.count:7.1f} us"
              f"  [{kernel_group(e.key)}] {e.key[:110]}")


def attention_like_the_run(layers: int = 28) -> None:
    import flashinfer

    heads, kv_heads, dim = 16, 8, 128
    hbm, _ = measure_ceilings(torch.device("cuda"))
    rng = random.Random(0)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for tensor_cores in (False, True):  # tensor cores last: their kernel compiles for a minute
        for batch in (256, 192, 160, 128, 64, 16):
            # a decode batch of the offline run's tail: prompt 100..1024 plus 0..1024 outputs so far
            lengths = [rng.randint(100, 1024) + rng.randint(0, 1024) for _ in range(batch)]
            total = sum(lengths)
            k = torch.randn(total + 1, 1, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
            cells = []
            for order in ("as drawn", "longest first"):
                if order == "longest first":
                    lengths = sorted(lengths, reverse=True)
                indptr = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).int()
                indices = (torch.randperm(total, device="cuda") + 1).int()
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
                wrapper.plan(indptr, indices, torch.ones(batch, dtype=torch.int32), heads, kv_heads, dim, 1,
                             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                seconds = timed(lambda: wrapper.run(q, (k, v)), torch.device("cuda"), repeat=layers)
                gbytes = total * kv_heads * dim * 2 * 2 / 1e9
                cells.append(f"{order}: {seconds * 1e6:6.1f} us {gbytes / seconds / (hbm / 1e9):4.0%}")
            print(f"tensor cores {int(tensor_cores)} B={batch:3d} kv mean {total // batch:4d} max {max(lengths):4d}: "
                  + "  ".join(cells), flush=True)


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "steps"
    if mode == "run":
        profile_run(sys.argv[1])
    elif mode == "attention":
        attention_like_the_run()
    else:
        attention_alone(False)
        attention_alone(True)
        profile_steps(sys.argv[1])
