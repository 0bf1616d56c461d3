"""Where does a decode step's device time go? (H200; see benchmarks/RESULTS.md)

    python benchmarks/profile_decode.py MODEL_DIR [steps|run|attention|batches|gemm]

steps (default): FlashInfer decode attention alone on 256 requests with ~800-token contexts,
   with and without tensor cores, then torch.profiler over 10 steady decode steps of that
   batch, top kernels by CUDA time;
run: torch.profiler over the whole offline workload (`bench --workload offline`, overlap
   loop, graphs on): every kernel's total time, grouped by what it does, against the run's wall
   time: where the device time beyond the floor goes;
attention [KERNELS]: FlashInfer decode attention alone on batches like the offline run's tail
   (lengths drawn as its contexts, at several batch sizes), the 0.6B and 8B shapes, each decode
   kernel (DECODE_KERNELS, or KERNELS: "plain,fa3"), against the measured HBM bandwidth. Timed as
   eager calls: at the small batches the launch, not the kernel, may set the time;
batches [SIZES [VARIANTS]]: steady decode at 256, 192, 128, 64, 32, 8 and 1 requests (or
   SIZES, "256,64"; contexts like the run's tail): wall per step, then torch.profiler over 8
   steps each: kernel time and kernels per step by group, against the step's floor; VARIANTS
   ("-;fast_decode_plan=false": the defaults, then that setting; ',' between a variant's
   settings) are engines built in turn;
gemm [SHAPE [ROWS]]: the four layer GEMMs of the 0.6B (or SHAPE: 8b) shape, timed inside a CUDA graph
   (as the engine runs them) from 1 to 256 rows (or ROWS: "136,256"): cuBLAS, plain and with swapped
   operands, and cuBLASLt (torch's preferred_blas_library), against their floor (weights read or FLOPs).
   MODEL_DIR is not read.
"""

from __future__ import annotations

import random
import sys
import time

import torch
from gpu_checks import long_prompts, steady_decode, timed_steps  # benchmarks/ is on sys.path when run as a script
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


ATTENTION_SHAPES = {"0.6b": (16, 8, 128, 28), "8b": (32, 8, 128, 36)}  # query heads, KV heads, head_dim, layers
# The decode kernels FlashInfer can run for a batch: its plain decode kernel (CUDA cores), its
# prefill kernel with one query per request (tensor cores, "fa2"; with its KV split switched off),
# and the Hopper (SM90) prefill kernel ("fa3", tensor cores).
DECODE_KERNELS = {"plain": dict(use_tensor_cores=False), "fa2": dict(use_tensor_cores=True),
                  "fa2 no split": dict(use_tensor_cores=True, disable_split_kv=True),
                  "fa3": dict(use_tensor_cores=True, backend="fa3")}


def decode_seconds(lengths: list[int], kernel: dict, workspace: torch.Tensor, shape=ATTENTION_SHAPES["0.6b"]) -> float:
    """Seconds per call of FlashInfer's decode on one layer's KV: one request per length, page
    size 1, slots in random order (as a pool hands them out); the best of 5 rounds of `layers` calls."""
    import flashinfer

    heads, kv_heads, head_dim, layers = shape
    kernel = dict(kernel)
    disable_split_kv = kernel.pop("disable_split_kv", False)
    total = sum(lengths)
    k = torch.randn(total + 1, 1, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(len(lengths), heads, head_dim, dtype=torch.bfloat16, device="cuda")
    indptr = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).int()
    indices = (torch.randperm(total, device="cuda") + 1).int()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kernel)
    extra = {"disable_split_kv": True} if disable_split_kv else {}
    wrapper.plan(indptr, indices, torch.ones(len(lengths), dtype=torch.int32), heads, kv_heads, head_dim, 1,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **extra)
    return timed(lambda: wrapper.run(q, (k, v)), torch.device("cuda"), repeat=layers)


def kv_gbytes(lengths: list[int], kv_heads: int = 8, head_dim: int = 128) -> float:
    return sum(lengths) * kv_heads * head_dim * 2 * 2 / 1e9  # K and V, bf16


def attention_alone(tensor_cores: bool, batch: int = 256, kv_len: int = 820) -> None:
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    layers = ATTENTION_SHAPES["0.6b"][3]
    seconds = decode_seconds([kv_len] * batch, DECODE_KERNELS["fa2" if tensor_cores else "plain"], workspace)
    print(f"FlashInfer decode x{layers} layers, B={batch}, kv={kv_len}, tensor_cores={tensor_cores}: "
          f"{seconds * layers * 1000:.2f} ms, {kv_gbytes([kv_len] * batch) / seconds:.0f} GB/s")


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


def device_kernels(prof) -> list:
    """The profiler's CUDA kernels that ran (key_averages rows)."""
    return [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]


def by_group(kernels: list) -> dict[str, list[float]]:
    """{group: [seconds, launches]} over the kernels, grouped by kernel_group."""
    groups: dict[str, list[float]] = {}
    for e in kernels:
        g = groups.setdefault(kernel_group(e.key), [0.0, 0])
        g[0] += e.self_device_time_total / 1e6
        g[1] += e.count
    return groups


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
    prefills, decodes = llm.stats.prefill_batches - warm_prefill, llm.stats.decode_batches - warm_decode
    steps = f"{prefills} prefill + {decodes} decode batches"
    llm.close()
    kernels = device_kernels(prof)
    groups = by_group(kernels)
    total = sum(secs for secs, _ in groups.values())
    print(f"whole offline run under the profiler: wall {wall:.2f} s, kernel time {total:.2f} s, {steps}")
    print(f"{'group':<26}{'s':>8}{'share':>8}{'launches':>10}{'us each':>9}")
    for name, (secs, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:<26}{secs:8.3f}{secs / total:8.1%}{count:10d}{secs / count * 1e6:9.1f}")
    print("top kernels:")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"  {e.self_device_time_total / 1e6:7.3f} s {e.count:8d} x {e.self_device_time_total / e.count:7.1f} us"
              f"  [{kernel_group(e.key)}] {e.key[:110]}")


def attention_like_the_run(kernels: list[str]) -> None:
    """Each decode kernel on batches like the offline run's tail, both shapes: us per layer call
    and its share of the KV-read floor at the measured HBM bandwidth (eager calls, queued back to
    back: at 16 requests the launch may set the time)."""
    hbm, _ = measure_ceilings(torch.device("cuda"))
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for name, shape in ATTENTION_SHAPES.items():
        rng = random.Random(0)
        for batch in (256, 192, 128, 64, 16):
            # a decode batch of the offline run's tail: prompt 100..1024 plus 0..1024 outputs so far
            lengths = [rng.randint(100, 1024) + rng.randint(0, 1024) for _ in range(batch)]
            cells = []
            for kernel in kernels:
                seconds = decode_seconds(lengths, DECODE_KERNELS[kernel], workspace, shape)
                share = kv_gbytes(lengths, shape[1], shape[2]) / seconds / (hbm / 1e9)
                cells.append(f"{kernel}: {seconds * 1e6:6.1f} us {share:4.0%}")
            print(f"{name} B={batch:3d} kv mean {sum(lengths) // batch:4d} max {max(lengths):4d}: " + "  ".join(cells),
                  flush=True)


def graph_seconds(fn, repeat: int = 10) -> float:
    """Seconds per replay of a CUDA graph of fn (kernel time plus in-graph launch gaps, no host)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return timed(graph.replay, torch.device("cuda"), repeat=repeat)


GEMM_SHAPES = {"0.6b": (1024, 3072), "8b": (4096, 12288)}  # hidden, intermediate (heads: ATTENTION_SHAPES)


def layer_gemms(shape: str) -> tuple[tuple[str, int, int], ...]:
    """(name, out, in) of the four layer GEMMs of a shape."""
    hidden, intermediate = GEMM_SHAPES[shape]
    heads, kv_heads, head_dim, _ = ATTENTION_SHAPES[shape]
    return (("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden), ("o_proj", hidden, heads * head_dim),
            ("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate))


def gemms_in_graph(shape: str, rows: tuple[int, ...]) -> None:
    """Each layer GEMM shape, 28 different weights (as 28 layers: no L2 reuse) in one graph:
    cuBLAS as x @ w^T and swapped (w @ x^T), cuBLASLt as x @ w^T, against the floor (the weights read at the measured HBM
    bandwidth, or the FLOPs at the measured matmul rate, whichever is longer). (A small-tile Triton
    kernel timed here too was never faster by more than 0.5 us and was removed: RESULTS.md, fifth
    session.)"""
    hbm, flops = measure_ceilings(torch.device("cuda"))
    for name, n, k in layer_gemms(shape):
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(28)]
        for m in rows:
            floor = max(2 * n * k / hbm, 2 * m * n * k / flops)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cublas = graph_seconds(lambda: [torch.nn.functional.linear(x, w) for w in weights]) / 28
            swapped = graph_seconds(lambda: [torch.mm(w, x.t()) for w in weights]) / 28
            torch.backends.cuda.preferred_blas_library("cublaslt")  # its own heuristics: another tiling or split
            lt = graph_seconds(lambda: [torch.nn.functional.linear(x, w) for w in weights]) / 28
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"{shape} {name:13s} M={m:3d} floor {floor * 1e6:.1f}us cublas {cublas * 1e6:.1f}us "
                  f"({floor / cublas:.0%}) swapped {swapped * 1e6:.1f}us ({floor / swapped:.0%}) "
                  f"cublaslt {lt * 1e6:.1f}us ({floor / lt:.0%})", flush=True)
        del weights


BATCHES = (256, 192, 128, 64, 32, 8, 1)


def setting_value(text: str) -> object:
    """A setting's value as the command line writes it: true, false, none or a number."""
    words = {"true": True, "false": False, "none": None}
    return words[text.lower()] if text.lower() in words else int(text)


def profile_batch_sizes(model: str, batches: tuple[int, ...] = BATCHES, variants: tuple[dict, ...] = ({},)) -> None:
    """Steady decode at several batch sizes, contexts like the offline run's tail: per step, the
    wall time unprofiled (the loop's own: host and device overlapped), then under the profiler
    the kernel time by group, the number of kernels by group, against the step's floor. Each
    variant (engine settings, e.g. {"fast_decode_plan": False}) is its own engine, built in turn
    on the same machine: an A/B."""
    from minisgl.observe.breakdown import ModelCost

    cost = ModelCost.from_config(model)
    hbm, flops = measure_ceilings(torch.device("cuda"))
    for settings in variants:
        rng = random.Random(0)
        llm = LLM(model, device="cuda", **settings)
        label = ",".join(f"{k}={v}" for k, v in settings.items()) or "default"
        for batch in batches:
            prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024) + rng.randint(0, 1024))]
                       for _ in range(batch)]
            steady_decode(llm, prompts, SamplingParams(max_new_tokens=40, ignore_eos=True), warm_steps=4)
            steps = 8
            wall = timed_steps(llm, steps)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    llm.step()
                torch.cuda.synchronize()
            while llm.scheduler.has_work():
                llm.step()
            attended_positions = sum(len(p) for p in prompts) + batch * 16  # mid-window context
            floor = cost.decode_floor(batch, attended_positions, hbm, flops)
            groups = by_group(device_kernels(prof))
            kernel_ms = sum(secs for secs, _ in groups.values()) * 1e3 / steps
            launches = sum(count for _, count in groups.values()) / steps
            parts = " | ".join(f"{name.split(',')[0].split(' ')[0]} {secs * 1e3 / steps:.3f} ms x{count / steps:.0f}"
                               for name, (secs, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]))
            print(f"[{label}] B={batch:3d} wall {wall * 1e3:.3f} ms/step, kernels {kernel_ms:.3f} ms "
                  f"({launches:.0f} per step), floor {floor * 1e3:.3f} ms ({floor / wall:.0%} of wall) | {parts}",
                  flush=True)
        llm.close()


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "steps"
    if mode == "run":
        profile_run(sys.argv[1])
    elif mode == "attention":
        attention_like_the_run(sys.argv[3].split(",") if len(sys.argv) > 3 else list(DECODE_KERNELS))
    elif mode == "gemm":  # optional: shape ("0.6b", "8b") and rows ("1,64,256")
        gemms_in_graph(sys.argv[3] if len(sys.argv) > 3 else "0.6b",
                       tuple(int(m) for m in sys.argv[4].split(",")) if len(sys.argv) > 4 else (1, 8, 32, 64, 128, 192, 256))
    elif mode == "batches":
        # optional: sizes ("256,64") and variants, ';' between variants, ',' between a variant's
        # settings ("-" for the defaults): "-;fast_decode_plan=false"
        sizes = tuple(int(b) for b in sys.argv[3].split(",")) if len(sys.argv) > 3 else BATCHES
        variants = tuple({} if v == "-" else {k: setting_value(x) for k, x in (kv.split("=") for kv in v.split(","))}
                         for v in sys.argv[4].split(";")) if len(sys.argv) > 4 else ({},)
        profile_batch_sizes(sys.argv[1], sizes, variants)
    else:
        attention_alone(False)
        attention_alone(True)
        profile_steps(sys.argv[1])
