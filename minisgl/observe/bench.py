"""`python -m minisgl bench`: measure the two loops.

Figures are printed (and optionally written as JSON), never asserted: speed is measured by
benchmarks, correctness by tests.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..frontend.options import check_output_file
from ..sampling_params import SamplingParams
from .breakdown import ModelCost, breakdown, measure_ceilings
from .trace import ideal_ratio, pipeline_metrics, request_metrics, share_of_gain

# Piped into a log (tee, a file), Rich would assume 80 columns and cut the breakdown's columns.
console = Console(width=None if sys.stdout.isatty() else 150)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(p.max_new_tokens for p in self.params)


def offline_workload(num_requests: int = 256, vocab: int = 10001) -> Workload:
    """The mini-SGLang / nano-vllm offline benchmark: input and output lengths uniform in
    100..1024, token ids uniform in 0..10000, Python's random seeded with 0, ignore_eos.
    (256 requests: 142,827 input and 133,966 output tokens.)"""
    rng = random.Random(0)
    prompts = [[rng.randint(0, min(10000, vocab - 1)) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_requests)]
    params = [SamplingParams(max_new_tokens=rng.randint(100, 1024), ignore_eos=True) for _ in range(num_requests)]
    return Workload("offline", prompts, params)


def small_workload(vocab: int, num_requests: int = 16) -> Workload:
    """A CPU-sized workload: prompts of 16..64 tokens, 32..64 new tokens, ignore_eos, seed 0."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(num_requests)]
    params = [SamplingParams(max_new_tokens=rng.randint(32, 64), ignore_eos=True) for _ in range(num_requests)]
    return Workload("small", prompts, params)


def default_model(args: argparse.Namespace) -> Path:
    """--model, else the shipped demo model, else a tiny random model written to a temp dir."""
    if args.model:
        if not Path(args.model).is_dir():
            raise ValueError(f"model directory {args.model!r} does not exist")
        return Path(args.model)
    try:
        from ..demo.paths import demo_model_path

        return demo_model_path()
    except FileNotFoundError:
        from ..demo.tiny import make_tiny

        return make_tiny(Path(tempfile.mkdtemp(prefix="minisgl-tiny-")), "qwen3")


def measure(args: argparse.Namespace, workload: Workload, loop: str, delay_ms: float, trace: bool = True,
            **overrides) -> dict:
    """Run one configuration: warm up, then time the whole workload."""
    from ..frontend.options import build_llm

    llm = build_llm(args, loop=loop, device_delay_ms=delay_ms, trace=trace, **overrides)
    llm.generate([workload.prompts[0][:8]], SamplingParams(max_new_tokens=4))  # warm-up (and JIT, on GPU)
    llm.engine.tracer.clear()
    llm.scheduler.stats.events.clear()
    progress = _progress(f"{loop:>7} delay={delay_ms:g}ms", len(workload.prompts))
    allocator_before = _allocator_counts(llm.device)
    with progress or nullcontext():
        task = progress.add_task("run", total=len(workload.prompts)) if progress else None
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, workload.params,
                            on_step=(lambda n: progress.update(task, completed=n)) if progress else None)
        if llm.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    out_tokens = sum(len(o.token_ids) for o in outs)
    spans = llm.engine.tracer.resolve()
    result = {"loop": loop, "delay_ms": delay_ms, "wall_s": wall, "output_tokens": out_tokens,
              "input_tokens": workload.input_tokens, "output_tok_per_s": out_tokens / wall,
              "overshoot_steps": llm.stats.overshoot_steps, "overshoot_tokens": llm.stats.overshoot_tokens,
              "min_prefill_tokens": llm.config.min_prefill_tokens, "prefill_batches": llm.stats.prefill_batches,
              "prefill_tokens": llm.stats.prefill_tokens,
              **{f"pipe_{k}": v for k, v in pipeline_metrics(spans).items()},
              **{f"req_{k}": v for k, v in request_metrics(outs).items()}}
    result["token_ids"] = [o.token_ids for o in outs]
    result["_spans"] = spans
    if allocator_before:  # CUDA: what the caching allocator did during the run
        result["allocator"] = {k: v - allocator_before[k] for k, v in _allocator_counts(llm.device).items()}
    if getattr(args, "breakdown", False):
        hbm, flops = args.ceilings
        result["breakdown"] = breakdown(spans, llm.engine.tracer.batches, ModelCost.from_config(args.model), hbm, flops,
                                        llm.config.max_running_requests)
    llm.close()
    del llm
    _free_device_memory()
    return result


def _allocator_counts(device) -> dict[str, int]:
    """CUDA caching allocator counters ({} elsewhere). A cudaFree, and a retry (frees the cache
    to retry a failed cudaMalloc), make the host wait for the device: host time that looks
    like scheduling work in C."""
    if device.type != "cuda":
        return {}
    import torch

    stats = torch.cuda.memory_stats(device)
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    return {key: stats[key] for key in keys} if all(key in stats for key in keys) else {}  # older torch: none


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _progress(label: str, total: int) -> Progress | None:
    if total < 32 or not console.is_terminal:
        return None
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=True)


def run_bench(args: argparse.Namespace) -> int:
    check_output_file(args.json, "--json")
    delays = args.delays
    model = default_model(args)
    args.model = str(model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    n = args.num_requests
    workload = small_workload(vocab, n or 16) if args.workload == "small" else offline_workload(n or 256, vocab)
    if getattr(args, "breakdown", False):
        import torch

        args.ceilings = measure_ceilings(torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if args.workload == "online":
        return run_online_bench(args, workload)
    console.print(f"[bold]minisgl bench[/] {model.name}, workload {workload.name}: {len(workload.prompts)} requests, "
                  f"{workload.input_tokens} input / {workload.output_tokens} output tokens")
    if args.compare_loops:
        if delays is None:
            probe = measure(args, workload, "normal", 0.0)
            c_ms = probe["pipe_host_time_per_iteration_s"] * 1000
            # a delay of at least 1.5 C, so that G > C: the regime the overlap loop is built for
            delays = [0.0, float(max(2, math.ceil(1.5 * c_ms)))]
        configs = [(loop, d) for d in delays for loop in ("normal", "overlap")]
    else:
        configs = [(args.loop, args.device_delay_ms)]
    results = []
    for rep in range(args.repeat):
        # Interleaved, and every other round in reverse (ABBA), so that a slow phase of a
        # shared machine lands on every configuration alike.
        for loop, delay in configs if rep % 2 == 0 else configs[::-1]:
            results.append({**measure(args, workload, loop, delay), "repeat": rep})
    if args.hf:
        results.append(measure_hf(model, workload, args))
    print_results(results)
    for r in results:
        if "breakdown" in r:
            print_breakdown(r)
    if args.workload == "offline":
        floor = roofline(model, workload, args)
        results.append({"loop": "roofline floor", "delay_ms": 0.0, **floor})
        console.print(f"roofline floor: {floor['wall_s']:.2f} s = {floor['output_tok_per_s']:.0f} output tok/s "
                      f"(HBM {floor['hbm_gb_per_s']:.0f} GB/s, bf16 matmul {floor['matmul_tflops']:.0f} TFLOP/s, "
                      f"decode {floor['decode_s']:.2f} s, prefill {floor['prefill_flops'] / 1e15:.2f} PFLOP)")
        bytes_only = floor["wall_s"] - floor["decode_s"] + floor["decode_bytes_only_s"]
        console.print(f"the same counting the decode steps' bytes alone (the roofline before its GEMMs' FLOPs "
                      f"counted): {floor['output_tokens'] / bytes_only:.0f} output tok/s")
    if args.compare_loops:
        print_ratios(results)
        identical = len({json.dumps(r["token_ids"]) for r in results if "token_ids" in r}) == 1
        console.print(f"outputs identical across every run: [bold]{identical}[/]")
    if args.json:
        Path(args.json).write_text(json.dumps([_public(r) for r in results], indent=2))
    return 0


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_") and k != "token_ids"}


def _groups(results: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """Runs of the same configuration (loop, device delay), in run order."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in results:
        groups.setdefault((r["loop"], r["delay_ms"]), []).append(r)
    return groups


def _median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else float("nan")


def _range(values: list[float]) -> str:
    return f"{min(values):.0f}–{max(values):.0f}" if len(values) > 1 else "–"


def print_results(results: list[dict], out: Console = console) -> None:
    """One row per configuration, medians over its repeats. Device busy and idle come first:
    they show the bubble directly and barely move with the machine's load; throughput does."""
    table = Table(title="where the time goes (medians over the repeats)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("loop", "delay\nms", "device\nbusy", "idle ms\n/step", "G\nms", "C\nms", "tok/s", "tok/s\nrange",
                "TTFT\nms", "TPOT\nms"):
        table.add_column(col, justify="right", no_wrap=True)
    for (loop, delay), runs in _groups(results).items():
        ms = lambda key, digits=2: f"{_median(runs, key) * 1000:.{digits}f}"  # noqa: E731
        busy = _median(runs, "pipe_device_busy_fraction")
        table.add_row(loop, f"{delay:g}", "–" if math.isnan(busy) else f"{busy:.1%}",
                      ms("pipe_exposed_host_time_per_step_s"), ms("pipe_device_time_per_forward_s"),
                      ms("pipe_host_time_per_iteration_s"), f"{_median(runs, 'output_tok_per_s'):.0f}",
                      _range([r["output_tok_per_s"] for r in runs]), ms("req_ttft_mean_s", 1), ms("req_tpot_mean_s", 1))
    out.print(table)
    out.print("G: device time per forward.  C: host work per iteration (schedule, launch and\n"
                  "commit spans; waiting excluded).  idle/step: device idle per forward (bubble).",
                  style="dim",
                  highlight=False)


def print_breakdown(result: dict, out: Console = console) -> None:
    table = Table(title=f"where the device time went: {result['loop']} loop (observe/breakdown.py)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("phase", "batches", "tokens\nor slots", "device\ns", "share", "floor\ns", "floor\n/dev",
                "C ms\n/iter", "schedule\n/launch\n/commit"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in result["breakdown"]:
        ratio = f"{row['floor_s'] / row['device_s']:.0%}" if row["floor_s"] and row["device_s"] else ""
        n = row.get("iterations")
        c_ms = f"{row['host_s'] / n * 1000:.2f}" if n else ""
        by_span = row.get("host_by_span", {})
        parts = " / ".join(f"{by_span.get(name, 0.0) / n * 1000:.2f}" for name in ("schedule", "launch", "commit")) \
            if by_span else ""
        table.add_row(row["phase"], str(row["batches"] or ""), str(row["tokens"]), f"{row['device_s']:.3f}",
                      f"{row['share']:.1%}", f"{row['floor_s']:.3f}" if row["floor_s"] else "", ratio, c_ms, parts)
    out.print(table)
    out.print("C ms/iter: host work per iteration that launched a batch of the phase, then its schedule,\n"
                  "launch and commit spans (a grammar's delayed sampling is in C, not in the three); the\n"
                  "total's is the run's C, a mean over the mix of phases.",
                  style="dim", highlight=False)
    if "allocator" in result:
        a = result["allocator"]
        out.print(f"CUDA caching allocator during the run: {a['num_device_alloc']} cudaMalloc, "
                      f"{a['num_device_free']} cudaFree, {a['num_alloc_retries']} retries (each waits for the device)",
                      highlight=False)


def run_online_bench(args: argparse.Namespace, workload: Workload) -> int:
    """Poisson arrivals at each rate in --rate, for one loop or both (--compare-loops)."""
    from ..frontend.options import build_llm
    from .online import run_online

    rates = args.rate
    loops = ["normal", "overlap"] if args.compare_loops else [args.loop]
    results = []
    for loop in loops:
        llm = build_llm(args, loop=loop, trace=True)
        llm.generate([workload.prompts[0][:8]], SamplingParams(max_new_tokens=4))  # warm-up (and JIT, on GPU)
        for rate in rates:
            results.append({"loop": loop, **run_online(llm, workload.prompts, workload.params, rate, seed=0)})
        llm.close()
    table = Table(title=f"online: {len(workload.prompts)} requests, Poisson arrivals (seed 0)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("loop", "rate\nreq/s", "tok/s", "TTFT p50\nms", "TTFT p99\nms", "ITL p50\nms", "ITL p99\nms",
                "device\nbusy"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        table.add_row(r["loop"], f"{r['rate']:g}", f"{r['output_tok_per_s']:.0f}",
                      *(f"{r[k] * 1000:.1f}" for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")),
                      f"{r['device_busy']:.1%}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_ratios(results: list[dict], out: Console = console) -> None:
    """overlap/normal per delay: median and range over paired repeats, next to the ideal
    (G+C)/max(G,C), and the share of the gain realised where the repeats can show it
    (trace.share_of_gain; else a line says why not). C is measured in the normal runs, G in the
    overlap runs as the forward after its launch (trace.py: forward_after_launch_s)."""
    table = Table(title="overlap vs normal (G from the overlap runs, C from the normal runs)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("delay\nms", "G\nms", "C\nms", "ideal", "overlap/\nnormal", "range", "share of\nthe gain"):
        table.add_column(col, justify="right", no_wrap=True)
    groups = _groups(results)
    not_computed = []
    for (loop, delay), normal in groups.items():
        overlap = groups.get(("overlap", delay))
        if loop != "normal" or not overlap:
            continue
        g = _median(overlap, "pipe_forward_after_launch_s")
        c = _median(normal, "pipe_host_time_per_iteration_s")
        ideal = ideal_ratio(g, c)
        ratios = [o["output_tok_per_s"] / n["output_tok_per_s"] for n, o in zip(normal, overlap)]
        share, why = share_of_gain(ratios, ideal)
        span = f"{min(ratios):.2f}–{max(ratios):.2f}" if len(ratios) > 1 else "–"
        table.add_row(f"{delay:g}", f"{g * 1000:.2f}", f"{c * 1000:.2f}", f"{ideal:.2f}x",
                      f"{statistics.median(ratios):.2f}x", span, "–" if why else f"{share:.0%}")
        if why:
            not_computed.append(f"delay {delay:g} ms: share of the gain not computed; {why}")
    out.print(table)
    out.print("share of the gain: (overlap/normal - 1) / (ideal - 1); 100%: all the host work\n"
                  "was hidden. Computed only where the range of the ratios is narrower than the\n"
                  "possible gain (ideal - 1): elsewhere it would be noise.", style="dim",
                  highlight=False)
    for line in not_computed:
        out.print(line, highlight=False)


def roofline(model: Path, workload: Workload, args: argparse.Namespace) -> dict:
    """Lower bound on the workload's time on this device: every decode step reads the weights
    and every active request's KV once at the measured HBM bandwidth, or does its GEMMs' FLOPs at
    the measured bf16 matmul rate where that is longer (ModelCost.decode_floor); prefill does its
    FLOPs at the matmul rate. All requests decode together (they all fit in the pool)."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cost = ModelCost.from_config(model)
    hbm, flops = getattr(args, "ceilings", None) or measure_ceilings(device)

    in_lens = [len(p) for p in workload.prompts]
    out_lens = [p.max_new_tokens for p in workload.params]
    decode_s = bytes_only_s = 0.0
    for step in range(1, max(out_lens) + 1):
        active = [i + step for i, o in zip(in_lens, out_lens) if o >= step]
        decode_s += cost.decode_floor(len(active), sum(active), hbm, flops)
        bytes_only_s += (cost.weight_bytes + sum(active) * cost.kv_bytes_per_token) / hbm
    prefill_flops = sum(2 * cost.matmul_params * n + 2 * cost.layers * cost.q_size * n * n for n in in_lens)
    wall = decode_s + prefill_flops / flops
    return {"wall_s": wall, "output_tokens": sum(out_lens), "output_tok_per_s": sum(out_lens) / wall,
            "hbm_gb_per_s": hbm / 1e9, "matmul_tflops": flops / 1e12, "decode_s": decode_s,
            "decode_bytes_only_s": bytes_only_s, "prefill_flops": prefill_flops}


def measure_hf(model: Path, workload: Workload, args: argparse.Namespace, batch_size: int = 64) -> dict:
    """Hugging Face `generate` on the same requests (greedy, batches of 64, left padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..config import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=resolve_dtype(args.dtype, device)).to(device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    limit = args.hf_requests if getattr(args, "hf_requests", None) else len(workload.prompts)
    start, produced = time.perf_counter(), 0
    for i in range(0, limit, batch_size):
        prompts, params = workload.prompts[i:i + batch_size], workload.params[i:i + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        new = max(p.max_new_tokens for p in params)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        pad_token_id=pad)
        produced += sum(p.max_new_tokens for p in params)  # tokens the requests asked for
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"loop": f"HF generate ({min(limit, len(workload.prompts))} req)", "delay_ms": 0.0, "wall_s": wall,
            "output_tokens": produced, "output_tok_per_s": produced / wall}
