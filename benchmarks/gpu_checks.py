"""GPU measurements that are not the offline benchmark (H200; see benchmarks/RESULTS.md).

    python benchmarks/gpu_checks.py MODEL_DIR batch1|eager|host|prefill|eager-ab|invariance|decode-plan [OUT_DIR]

batch1: TPOT of one request (256 prompt + 256 new tokens) in both loops, CUDA graphs on and
        off, against the weights-read floor (weight bytes / measured HBM bandwidth).
eager:  lesson 9's workload (64 requests x 64 tokens, graphs off) in both loops, each after two
        warm-up runs of it (one run per loop: for the loop comparison use eager-ab): tok/s, G, C,
        then torch.profiler over 10 decode steps: the host-side CUDA calls that can wait
        (synchronizations, copies, allocations) and kernel launches per step.
host:   256 requests with 800-token prompts at steady decode, graphs on: host ms per step by
        span (schedule, launch, commit, wait), and cProfile's top functions, for both loops.
prefill: one prefill batch at a time on an idle engine, 256 to 8,192 tokens of ~560-token
        prompts (the offline workload's mean): host ms to launch it, device ms of its forward,
        its floor (observe/breakdown.py) and floor / device; then cProfile's top functions over
        launches of 1,024-token batches. Where device ms stops following host ms is where a
        batch's compute covers its launches: the value for min_prefill_tokens (config.py).
        Two engines in turn, an A/B: the eager prefill, then piecewise_cuda_graph.
eager-ab: lesson 9's workload again, both loops built once and run in ABBA order (4 pairs, the
        first a warm-up), then one overlap run under torch's sync debug mode (every synchronizing
        CUDA call warns): is eager overlap's loss steady, and does any hidden synchronization remain?
invariance: the CUDA tests' mixed workload (tests/workloads.py) in both loops with
        deterministic=True, for three configurations (FlashInfer; the torch reference backend;
        FlashInfer with the fused ops off): identical sequences, and the first (request,
        position) whose logits differ bit for bit between the loops, with the two batches it
        was computed in. Names the part that is not batch-invariant.
decode-plan: FlashInfer's tensor-core decode kernel against its plain one, on one machine
        (the setting tensor_core_decode_min_batch): for 32..256 requests of uniform
        (820) or spread (100..1024) prompt lengths, the overlap loop's steady decode with graphs:
        host ms of the launch span (the plan and the replay), device ms per forward after its
        launch, wall ms per step. Prints the batch size from which tensor cores give the shorter
        step at every larger size measured.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams
from minisgl.observe.breakdown import ModelCost, measure_ceilings
from minisgl.observe.trace import pipeline_metrics
from minisgl.tracer import HOST_LANE, SpanName

WATCH = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
         "cudaMemcpy", "cudaStreamWaitEvent", "cudaEventQuery", "cudaHostAlloc", "cudaMalloc", "cudaFree",
         "aten::_local_scalar_dense", "aten::item", "aten::to", "aten::copy_", "aten::pin_memory",
         "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def steady_decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, warm_steps: int) -> None:
    """Add the requests, run until every prompt is prefilled, then warm_steps decode steps."""
    for prompt in prompts:
        llm.add_request(prompt, params)
    while llm.scheduler.waiting or llm.scheduler.prefilling:
        llm.step()
    for _ in range(warm_steps):
        llm.step()
    torch.cuda.synchronize()


def timed_steps(llm: LLM, steps: int) -> float:
    """Seconds per scheduler step over `steps` steps, device work included."""
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def long_prompts(num: int = 256, length: int = 800) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(length)] for _ in range(num)]


def batch1(model: str) -> None:
    hbm, _ = measure_ceilings(torch.device("cuda"))
    floor = ModelCost.from_config(model).weight_bytes / hbm
    print(f"weights-read floor per token: {floor * 1000:.3f} ms (HBM {hbm / 1e9:.0f} GB/s)")
    prompt = [(13 * j) % 9000 + 5 for j in range(256)]
    for graphs in (True, False):
        for loop in ("normal", "overlap"):
            llm = LLM(model, device="cuda", loop=loop, disable=() if graphs else ("cuda_graph",))
            llm.generate([prompt[:8]], SamplingParams(max_new_tokens=8, ignore_eos=True))
            out = llm.generate([prompt], SamplingParams(max_new_tokens=256, ignore_eos=True))[0]
            tpot = out.metrics["tpot"]
            print(f"batch 1, graphs {'on ' if graphs else 'off'}, {loop:>7}: TPOT {tpot * 1000:.3f} ms "
                  f"= {floor / tpot:.0%} of the floor; TTFT {out.metrics['ttft'] * 1000:.1f} ms")
            llm.close()


def eager(model: str, out_dir: Path) -> None:
    prompts, params = lesson9_workload()
    for loop in ("normal", "overlap"):
        llm = LLM(model, device="cuda", loop=loop, disable=("cuda_graph",), trace=True)
        for _ in range(2):  # a new engine's first two runs are slow (eager-ab, RESULTS.md 2026-12-01)
            llm.generate(prompts, params)
        llm.reset_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        m = pipeline_metrics(llm.engine.tracer.resolve())
        print(f"eager {loop:>7}: {sum(len(o.token_ids) for o in outs) / wall:.0f} tok/s, "
              f"G {m['device_time_per_forward_s'] * 1000:.2f} ms, C {m['host_time_per_iteration_s'] * 1000:.2f} ms, "
              f"busy {m['device_busy_fraction']:.1%}")
        host_spans(llm, f"eager {loop}")
        llm.engine.tracer.enabled = False
        steady_decode(llm, prompts, params, warm_steps=3)
        steps = 10
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            per_step = timed_steps(llm, steps)
        print(f"  profiled {steps} decode steps of 64 requests: {per_step * 1000:.2f} ms per step")
        rows = {e.key: e for e in prof.key_averages()}
        for key in WATCH:
            if key in rows:
                e = rows[key]
                print(f"  {key:<28} calls/step {e.count / steps:7.1f}  host ms/step {e.cpu_time_total / steps / 1000:7.3f}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
        prof.export_chrome_trace(str(out_dir / f"eager_{loop}.json"))
        while llm.has_unfinished():
            llm.step()
        llm.close()


def lesson9_workload() -> tuple[list[list[int]], SamplingParams]:
    return [[(7 * i + j) % 500 + 3 for j in range(16 + i % 32)] for i in range(64)], \
        SamplingParams(max_new_tokens=64, ignore_eos=True)


def eager_ab(model: str) -> None:
    import gc
    import os
    import statistics
    import warnings

    prompts, params = lesson9_workload()
    llms = {loop: LLM(model, device="cuda", loop=loop, disable=("cuda_graph",), trace=True, kv_tokens=1 << 16)
            for loop in ("normal", "overlap")}
    if os.environ.get("GC_OFF"):
        gc.disable()
    results: dict[str, list[tuple[float, float]]] = {"normal": [], "overlap": []}
    for rep in range(4):
        for loop in ("normal", "overlap") if rep % 2 else ("overlap", "normal"):
            llm = llms[loop]
            llm.engine.tracer.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            spans = [s for s in llm.engine.tracer.resolve() if s.lane == HOST_LANE and s.name == SpanName.LAUNCH]
            if rep:  # the first pair warms up
                results[loop].append((sum(len(o.token_ids) for o in outs) / wall,
                                      statistics.median(s.duration for s in spans) * 1000))
    for loop, runs in results.items():
        print(f"eager-ab {loop:>7}: tok/s {[round(r[0]) for r in runs]}, median launch ms {[round(r[1], 2) for r in runs]}")
    llms["normal"].close()
    llm = llms["overlap"]
    llm.engine.tracer.enabled = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        llm.generate(prompts[:16], SamplingParams(max_new_tokens=8, ignore_eos=True))
        torch.cuda.set_sync_debug_mode("default")
    where: dict[str, int] = {}
    for w in caught:
        key = f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"
        where[key] = where.get(key, 0) + 1
    print(f"sync debug mode, overlap loop, 16 requests x 8 tokens: {len(caught)} warnings")
    for key, count in sorted(where.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {count:5d}  {key}")
    llm.close()


def host_spans(llm: LLM, label: str) -> None:
    spans = [s for s in llm.engine.tracer.resolve() if s.lane == "host"]
    iterations = max(1, len({s.iteration for s in spans}))
    by_name: dict[str, float] = {}
    for s in spans:
        by_name[s.name] = by_name.get(s.name, 0.0) + s.duration
    parts = ", ".join(f"{k} {v / iterations * 1000:.2f}" for k, v in sorted(by_name.items()))
    print(f"  {label}: host ms per iteration: {parts}")


def host(model: str) -> None:
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for loop in ("normal", "overlap"):
        llm = LLM(model, device="cuda", loop=loop, trace=True)
        steady_decode(llm, long_prompts(), params, warm_steps=5)
        llm.engine.tracer.clear()
        steps = 20
        per_step = timed_steps(llm, steps)
        print(f"host, {loop}, 256 requests at steady decode (graphs on): {per_step * 1000:.2f} ms per step")
        host_spans(llm, f"host {loop}")
        llm.engine.tracer.enabled = False
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            llm.step()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-3000:])
        while llm.has_unfinished():
            llm.step()
        llm.close()


def prefill(model: str) -> None:
    for piecewise in (False, True):
        prefill_batches(model, piecewise)


def prefill_batches(model: str, piecewise: bool) -> None:
    hbm, flops = measure_ceilings(torch.device("cuda"))
    cost = ModelCost.from_config(model)
    rng = random.Random(0)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)  # the prefill's sample is the last token

    def prompts(tokens: int) -> list[list[int]]:
        lengths = [560] * (tokens // 560) + ([tokens % 560] if tokens % 560 else [])
        return [[rng.randint(0, 10000) for _ in range(n)] for n in lengths]

    started = time.perf_counter()
    llm = LLM(model, device="cuda", loop="overlap", trace=True, piecewise_cuda_graph=piecewise)
    print(f"engine start {time.perf_counter() - started:.1f} s (graph captures included), "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, {llm.engine.kv_pool.kv_tokens} KV slots")
    llm.generate(prompts(8192), one)  # warm-up: kernels and plans for every size below
    kind = "piecewise-graph" if piecewise else "eager"
    print(f"{kind} prefill batches on an idle engine (HBM {hbm / 1e9:.0f} GB/s, {flops / 1e12:.0f} TFLOP/s), "
          f"median of 5:")
    print(f"  {'tokens':>6} {'requests':>8} {'launch ms':>9} {'device ms':>9} {'floor ms':>8} {'floor/device':>12}")
    for tokens in (256, 512, 1024, 2048, 3072, 4096, 6144, 8192):
        launch, device, floor = [], [], []
        for _ in range(5):
            llm.engine.tracer.clear()
            llm.generate(prompts(tokens), one)
            torch.cuda.synchronize()
            spans = llm.engine.tracer.resolve()
            records = [r for r in llm.engine.tracer.batches if r.is_prefill]
            ids = {r.batch_id for r in records}
            launch.append(sum(sp.duration for sp in spans if sp.name == SpanName.LAUNCH and sp.batch_id in ids))
            device.append(sum(sp.duration for sp in spans
                              if sp.lane != HOST_LANE and sp.name == SpanName.FORWARD and sp.batch_id in ids))
            floor.append(sum(cost.prefill_floor(r.num_tokens, r.attention_pairs, r.attended_positions, hbm, flops)
                             for r in records))
        med = [sorted(v)[2] * 1000 for v in (launch, device, floor)]
        print(f"  {tokens:>6} {-(-tokens // 560):>8} {med[0]:>9.2f} {med[1]:>9.2f} {med[2]:>8.2f} "
              f"{med[2] / med[1]:>12.0%}")
    llm.engine.tracer.enabled = False
    batches = [prompts(1024) for _ in range(10)]
    prof = cProfile.Profile()
    prof.enable()
    for batch in batches:
        llm.generate(batch, one)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    print(f"cProfile ({kind}), 10 generate() calls of one 1,024-token prefill each:")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-3500:])
    llm.close()


def record_batches(llm: LLM) -> tuple[list[tuple[list[tuple[int, ...]], list[int], bool]], list[torch.Tensor]]:
    """(prompts, kv_lens, is_prefill) of every launched batch and the logits of every forward, both
    in launch order (eager engines only), filled as the engine runs: zip them after the run."""
    batches: list = []
    logits_seen: list[torch.Tensor] = []
    launch, forward = llm.scheduler.launch, llm.engine.model.forward

    def launch_and_note(planned):
        batches.append(([tuple(r.prompt_ids) for r in planned.view.reqs], list(planned.forward.kv_lens),
                         planned.forward.is_prefill))
        return launch(planned)

    def forward_and_keep(*args):
        logits = forward(*args)
        logits_seen.append(logits.clone())  # forwards run in launch order
        return logits

    llm.scheduler.launch, llm.engine.model.forward = launch_and_note, forward_and_keep
    return batches, logits_seen


def invariance(model: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.workloads import random_workload, run, with_stops

    def drive(loop: str, workload, **kwargs):
        index = {tuple(a.prompt): i for i, a in enumerate(workload)}  # a request is known by its prompt
        assert len(index) == len(workload)
        llm = LLM(model, device="cuda", loop=loop, chunk_size=16, deterministic=True, **kwargs)
        batches, logits_seen = record_batches(llm)
        outs = [tokens for tokens, _ in run(llm, workload)]
        llm.close()
        rows = {}  # (request, kv_len) -> (logits row, batch size, row, is_prefill)
        for (prompts, kv_lens, prefill), logits in zip(batches, logits_seen):
            for r, (prompt, kv_len) in enumerate(zip(prompts, kv_lens)):
                rows[(index[prompt], kv_len)] = (logits[r], len(prompts), r, prefill)
        return outs, rows

    for label, kwargs in (("flashinfer", {}), ("torch backend", {"attention_backend": "torch"}),
                          ("flashinfer, fused ops off", {"fused_kernels": False})):
        probe = LLM(model, device="cuda", loop="normal", chunk_size=16, **kwargs)
        base = random_workload(0, probe.engine.model.vocab_size)
        workload = with_stops(base, [o.token_ids for o in probe.generate([a.prompt for a in base],
                                                                          [a.params for a in base])], 0)
        probe.close()
        normal, rows_n = drive("normal", workload, **kwargs)
        again, _ = drive("normal", workload, **kwargs)
        overlap, rows_o = drive("overlap", workload, **kwargs)
        same = [k for k in rows_n if k in rows_o and torch.equal(rows_n[k][0], rows_o[k][0])]
        differ = [k for k in rows_n if k in rows_o and not torch.equal(rows_n[k][0], rows_o[k][0])]
        print(f"{label}: normal repeats itself {sum(a == b for a, b in zip(normal, again))}/{len(workload)}; "
              f"overlap == normal {sum(a == b for a, b in zip(normal, overlap))}/{len(workload)}; "
              f"logits rows identical {len(same)}, different {len(differ)}")
        for k in differ[:4]:
            (ln, bn, rn, pn), (lo, bo, ro, po) = rows_n[k], rows_o[k]
            print(f"  request {k[0]} at kv_len {k[1]}: normal batch of {bn} ({'prefill' if pn else 'decode'}, "
                  f"row {rn}), overlap batch of {bo} ({'prefill' if po else 'decode'}, row {ro}); "
                  f"max |diff| {(ln - lo).abs().max().item():.3g}")


def decode_plan(model: str, sizes: tuple[int, ...] = (32, 64, 128, 256), steps: int = 20) -> None:
    import statistics

    spreads = {"uniform 820": (820, 820), "spread 100..1024": (100, 1024)}
    rows: dict[tuple[str, int], dict[bool, tuple[float, float, float]]] = {}
    for tensor_cores in (False, True):
        llm = LLM(model, device="cuda", loop="overlap", trace=True,
                  tensor_core_decode_min_batch=1 if tensor_cores else None)
        for spread, (lo, hi) in spreads.items():
            for bs in sizes:
                rng = random.Random(bs)  # both kernels decode the same lengths
                prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(bs)]
                steady_decode(llm, prompts, SamplingParams(max_new_tokens=steps + 8, ignore_eos=True), warm_steps=3)
                llm.engine.tracer.clear()  # the device is idle: the trace's clock origin is exact
                per_step = timed_steps(llm, steps)
                spans = llm.engine.tracer.resolve()
                launch = statistics.median(s.duration for s in spans if s.lane == HOST_LANE and s.name == SpanName.LAUNCH)
                device = pipeline_metrics(spans)["forward_after_launch_s"]
                rows.setdefault((spread, bs), {})[tensor_cores] = (launch * 1e3, device * 1e3, per_step * 1e3)
                while llm.has_unfinished():
                    llm.step()
        llm.close()
    print("decode plan A/B, overlap loop, graphs on; ms: launch span (host) / device per forward after its launch / "
          "wall per step")
    print(f"{'lengths':>17} {'batch':>5} | {'plain: launch device step':>26} | {'tensor cores: launch device step':>33} "
          f"| shorter step")
    for (spread, bs), r in rows.items():
        (pl, pd, ps), (tl, td, ts) = r[False], r[True]
        print(f"{spread:>17} {bs:>5} | {pl:8.2f} {pd:8.2f} {ps:8.2f} | {tl:11.2f} {td:10.2f} {ts:10.2f} | "
              f"{'tensor cores' if ts < ps else 'plain'}")
    for spread in spreads:
        wins = [bs for bs in sizes if rows[(spread, bs)][True][2] < rows[(spread, bs)][False][2]]
        start = next((bs for bs in sizes if all(b in wins for b in sizes if b >= bs)), None)
        print(f"{spread}: tensor cores give the shorter step from batch {start} up" if start else
              f"{spread}: the plain kernel's step is as short or shorter at every size measured")


if __name__ == "__main__":
    model, what = sys.argv[1], sys.argv[2]
    out = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("/tmp")
    {"batch1": lambda: batch1(model), "eager": lambda: eager(model, out), "host": lambda: host(model),
     "prefill": lambda: prefill(model),
     "invariance": lambda: invariance(model), "eager-ab": lambda: eager_ab(model),
     "decode-plan": lambda: decode_plan(model)}[what]()
