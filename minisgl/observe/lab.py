"""`python -m minisgl lab`: predict the overlap loop's gain, then measure it, as host work grows.

The model of lesson 8: a serial step costs G + C, an overlapped one max(G, C), so overlap
gives (G+C)/max(G,C) times the throughput of the normal loop. The lab holds the device time
per forward G fixed and sweeps the host work per iteration C (the `host_delay_ms` knob) so
that C/G runs from 1/4 to 3: the gain rises to 2x at the crossover C = G, then falls as the
host caps it at (G+C)/C.

Each point runs the same decode-heavy workload through both loops, several times, in ABBA
order (normal, overlap, overlap, normal, ...) so that a slow phase of a shared machine hits
both loops alike; the point reports the median and range of the paired ratios. G and C are
measured from the same runs' trace spans (`pipeline_metrics`), never taken from the knobs:
C from the normal runs, G from the overlap runs, as each forward's device time after its own
launch returned. On a GPU the forward's span opens at its input copy and then waits for the
rest of the launch whenever the device has nothing else queued, as always in the normal
loop: that G holds launch work, which is C's, and an ideal built from it promised a gain
that no schedule can reach (benchmarks/RESULTS.md, the lab on the H200). The point's ideal
applies the model step by step, max(G_k, C_k) for each step of the runs (`Point.ideal`): near
C = G the two take turns being longer, and the mean of the maxima is above the larger mean.

On the CPU the device is a worker thread; `device_delay_ms` (a sleep on that thread, 20 ms by
default) makes G large and steady next to the Python of the tiny forward. On CUDA the same
command runs the real forward with no delay (`--model DIR --device cuda`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..frontend.options import DELAY_MS, MAX_CLI_REQUESTS, Number, NumberList, build_llm, check_output_file, count
from ..sampling_params import SamplingParams
from .bench import Workload, console, default_model
from .lab_report import report
from .trace import (forwards_after_launch, host_work_by_launch, ideal_ratio, pipeline_metrics, share_of_gain,
                    stepwise_ideal)

DEFAULT_POINTS = (0.2, 0.5, 1.0, 1.5, 2.0, 3.2)  # ends with a margin: G drifts
CPU_DEVICE_DELAY_MS = 20.0
MAX_STEPS = 400  # decode steps of one run, at most
MAX_POINT = 100.0  # the largest C/G: host work 100 times the device's, an overlap gain of 1%
MAX_RUN_S = 3600.0  # one normal run lasts at most an hour
MAX_REPEATS = 100  # paired runs per point


@dataclass
class LabRun:
    """One generate() of the workload: throughput and the trace figures of the lab."""

    tok_per_s: float
    g_s: float  # device time per forward after its launch returned (trace.py: forward_after_launch_s)
    g_span_s: float  # device time per forward, the whole span (on a GPU: with the end of its launch)
    c_s: float  # host work per iteration (S+L+C spans, waiting excluded)
    busy: float  # device busy fraction
    idle_s: float  # device idle per forward (the bubble)
    g_steps: list[float]  # each forward's G after launch, in batch order
    c_steps: list[float]  # C of each iteration that launched a batch, in launch order


@dataclass
class Point:
    """One C/G point: the paired runs of both loops."""

    host_delay_ms: float
    steps: int
    normal: list[LabRun] = field(default_factory=list)
    overlap: list[LabRun] = field(default_factory=list)

    @property
    def g_s(self) -> float:
        """G as the overlap loop sees it: its forwards after their launches (no launch work)."""
        return statistics.median(r.g_s for r in self.overlap)

    @property
    def c_s(self) -> float:
        return statistics.median(r.c_s for r in self.normal)

    @property
    def c_over_g(self) -> float:
        return self.c_s / self.g_s

    @property
    def ideal_of_means(self) -> float:
        """(G+C)/max(G,C) of the medians: the curve of the chart."""
        return ideal_ratio(self.g_s, self.c_s)

    @property
    def ideal(self) -> float:
        """The ideal built step by step (trace.stepwise_ideal), each overlap run's forwards G_k
        paired with its normal partner's iterations C_k; the median over the pairs of runs. An
        estimate from independent runs, not a bound: equal to the curve where one side is always
        the longer, lower where the two take turns (near C = G, or where C has a long tail)."""
        return statistics.median(stepwise_ideal(o.g_steps, n.c_steps) for n, o in zip(self.normal, self.overlap))

    @property
    def ratios(self) -> list[float]:
        """overlap/normal throughput of each repeat, paired run by run."""
        return [o.tok_per_s / n.tok_per_s for n, o in zip(self.normal, self.overlap)]

    @property
    def ratio_median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def share(self) -> float:
        """The share of the possible gain realised; NaN where the repeats' range hides it (trace.share_of_gain)."""
        return share_of_gain(self.ratios, self.ideal)[0]

    def to_json(self) -> dict:
        med = lambda runs, key: statistics.median(getattr(r, key) for r in runs)  # noqa: E731
        return {"c_over_g": self.c_over_g, "ideal": self.ideal, "ideal_of_means": self.ideal_of_means,
                "ratio_median": self.ratio_median,
                "ratio_min": min(self.ratios), "ratio_max": max(self.ratios),
                "busy_normal": med(self.normal, "busy"), "busy_overlap": med(self.overlap, "busy"),
                "idle_normal_ms": med(self.normal, "idle_s") * 1e3, "idle_overlap_ms": med(self.overlap, "idle_s") * 1e3,
                "g_ms": self.g_s * 1e3, "c_ms": self.c_s * 1e3, "g_normal_ms": med(self.normal, "g_span_s") * 1e3,
                "g_overlap_ms": med(self.overlap, "g_span_s") * 1e3, "c_overlap_ms": med(self.overlap, "c_s") * 1e3,
                "share": self.share, "ratios": self.ratios, "host_delay_ms": self.host_delay_ms, "steps": self.steps}


# --------------------------------------------------------------------------- the workload


def decode_workload(vocab: int, requests: int, steps: int, prompt_len: int = 8) -> Workload:
    """Decode-heavy: a few short prompts, `steps` new tokens each (ignore_eos), so that one
    prefill is followed by `steps` decode steps of the same batch: every step has the same G."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    return Workload("decode", prompts, [SamplingParams(max_new_tokens=steps, ignore_eos=True)] * requests)


def prefill_workload(vocab: int, requests: int, prompt_len: int = 120) -> Workload:
    """Prefill-heavy: many long prompts and 2 new tokens each: most forwards are prefills,
    and with prefill_sync on the first of two prefills in a row is committed before the
    second is launched (the device waits for that commit and launch)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    return Workload("prefill", prompts, [SamplingParams(max_new_tokens=2, ignore_eos=True)] * requests)


def make_workload(kind: str, vocab: int, requests: int, steps: int) -> Workload:
    return prefill_workload(vocab, requests * 32) if kind == "prefill" else decode_workload(vocab, requests, steps)


# --------------------------------------------------------------------------- measuring


class Runner:
    """Builds one engine per loop for the whole lab, and runs the workload on them.

    The engines are built once (on CUDA each one captures its graphs: seconds), with room for
    the longest workload; each point only sets their host delay."""

    def __init__(self, args: argparse.Namespace, device_delay_ms: float, kv_tokens: int) -> None:
        self.llms = {loop: build_llm(args, loop=loop, device_delay_ms=device_delay_ms, trace=True,
                                     kv_tokens=args.kv_tokens or kv_tokens) for loop in ("normal", "overlap")}
        for llm in self.llms.values():
            llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4))  # warm-up (and JIT on GPU)

    def set_host_delay(self, host_delay_ms: float) -> None:
        for llm in self.llms.values():
            llm.scheduler.host_delay_s = host_delay_ms / 1000.0  # the knob LLM(host_delay_ms=) sets

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()

    def run(self, loop: str, workload: Workload) -> LabRun:
        llm = self.llms[loop]
        llm.flush_cache()  # every repeat prefills the same way (no radix hits from the last one)
        llm.reset_stats()
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, workload.params)
        if llm.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        spans = llm.engine.tracer.resolve()
        m = pipeline_metrics(spans)
        return LabRun(sum(len(o.token_ids) for o in outs) / wall, m["forward_after_launch_s"],
                      m["device_time_per_forward_s"],
                      m["host_time_per_iteration_s"], m["device_busy_fraction"], m["exposed_host_time_per_step_s"],
                      forwards_after_launch(spans), host_work_by_launch(spans))


def kv_tokens_for(workload: Workload) -> int:
    need = sum(len(p) + sp.max_new_tokens + 2 for p, sp in zip(workload.prompts, workload.params))
    return max(1024, 2 * need)


def measure_point(runner: Runner, workload: Workload, host_delay_ms: float, repeats: int) -> Point:
    """Both loops on the same workload, `repeats` pairs in ABBA order."""
    point = Point(host_delay_ms, max(sp.max_new_tokens for sp in workload.params))
    runner.set_host_delay(host_delay_ms)
    for rep in range(repeats):
        for loop in ("normal", "overlap") if rep % 2 == 0 else ("overlap", "normal"):
            getattr(point, loop).append(runner.run(loop, workload))
    return point


def host_delay_for(g_s: float, c0_s: float, target: float) -> float:
    """The host_delay_ms that brings C = c0 + delay to the target C/G (0 where c0 alone is more)."""
    return max(0.0, target * g_s - c0_s) * 1e3


def steps_for(g_s: float, c_s: float, run_s: float, min_steps: int, max_steps: int) -> int:
    """Decode steps so that one normal run lasts about run_s: short steps get more of them."""
    return max(min_steps, min(max_steps, round(run_s / (g_s + c_s))))


# --------------------------------------------------------------------------- the command


def sweep(runner: Runner, args: argparse.Namespace, workload_of: Callable[[int], Workload], targets: list[float],
          fixed: list[float] | None) -> tuple[LabRun, list[dict]]:
    """The probe (G and the host's own work C0, no knob), then one measured point per target."""
    probe = measure_point(runner, workload_of(40), 0.0, 1).normal[0]
    console.print(f"probe, normal loop, no host delay: G {probe.g_s * 1e3:.2f} ms, C {probe.c_s * 1e3:.2f} ms "
                  f"(lowest C/G: {probe.c_s / probe.g_s:.2f})")
    g_seen = [probe.g_s]  # G drifts with the machine's load: each point aims with the median so far
    points = []
    for i in range(len(fixed) if fixed else len(targets)):
        g_est = statistics.median(g_seen)
        host_delay = fixed[i] if fixed else host_delay_for(g_est, probe.c_s, targets[i])
        if not fixed and host_delay == 0 and any(p["host_delay_ms"] == 0 for p in points):
            continue  # a target below the host's own C/G: the no-delay point is already measured
        steps = steps_for(g_est, probe.c_s + host_delay / 1e3, args.run_s, args.min_steps, MAX_STEPS)
        measured = measure_point(runner, workload_of(steps), host_delay, args.repeats)
        g_seen += [r.g_s for r in measured.overlap]
        points.append(measured.to_json())
        console.print(f"  host_delay_ms {host_delay:6.2f}, {steps:3d} steps: C/G {points[-1]['c_over_g']:.2f}, "
                      f"ovl/norm {points[-1]['ratio_median']:.2f} (ideal {points[-1]['ideal']:.2f}, "
                      f"(G+C)/max(G,C) {points[-1]['ideal_of_means']:.2f})")
    return probe, points


def run_lab(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    check_output_file(args.json, "--json")
    targets, fixed = args.points, args.host_delays
    model = default_model(args)
    args.model = str(model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    cuda = _device_type(args) == "cuda"
    delay = args.device_delay_ms if args.device_delay_ms is not None else (0.0 if cuda else CPU_DEVICE_DELAY_MS)
    requests = args.requests or (64 if cuda else 2)
    console.print(f"[bold]minisgl lab[/] {model.name}, {'cuda' if cuda else 'cpu'}, device_delay_ms={delay:g}, "
                  f"{args.workload} workload, {requests} requests, {args.repeats} repeats")
    _warn_if_loaded()
    runner = Runner(args, delay, kv_tokens_for(make_workload(args.workload, vocab, requests, MAX_STEPS)))
    console.print(f"both engines built and warmed up in {time.perf_counter() - started:.0f} s")
    try:
        probe, points = sweep(runner, args, lambda steps: make_workload(args.workload, vocab, requests, steps),
                              targets, fixed)
    finally:
        runner.close()
    runtime = time.perf_counter() - started
    report(points, runtime)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"model": str(model), "device": "cuda" if cuda else "cpu", "device_delay_ms": delay,
                       "workload": args.workload, "requests": requests, "repeats": args.repeats,
                       "probe_g_ms": probe.g_s * 1e3, "probe_c_ms": probe.c_s * 1e3},
            "points": points, "runtime_s": runtime}, indent=2))
    return 0


def _warn_if_loaded() -> None:
    """Other processes on the CPU stretch the forward and the hand-offs unevenly: say so."""
    if not hasattr(os, "getloadavg"):  # Windows has no load average: nothing to warn about
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        console.print(f"[yellow]load average {load:.1f} on {cores} cores: other processes compete for the CPU, "
                      f"expect noisy ratios (best run on an idle machine)[/]")


def _device_type(args: argparse.Namespace) -> str:
    import torch

    return "cuda" if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") else "cpu"


def add_lab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--points", type=NumberList(Number(float, 0.0, MAX_POINT, low_open=True)),
                   default=",".join(f"{x:g}" for x in DEFAULT_POINTS),
                   help="target C/G values, comma-separated (default: %(default)s)")
    p.add_argument("--host-delays", type=NumberList(DELAY_MS), default=None, metavar="MS,...",
                   help="sweep these host_delay_ms values instead of aiming at --points (e.g. one C for two workloads)")
    p.add_argument("--repeats", type=count(MAX_REPEATS), default=3, help="paired runs per point (default: %(default)s)")
    p.add_argument("--workload", default="decode", choices=["decode", "prefill"],
                   help="decode: a few requests, many steps; prefill: many long prompts, 2 tokens each")
    p.add_argument("--requests", type=count(MAX_CLI_REQUESTS), default=None, help="requests in the decode batch (default 2; 64 on CUDA)")
    p.add_argument("--run-s", type=Number(float, 0.0, MAX_RUN_S, low_open=True), default=2.0, help="about how long one normal run lasts (sets the steps)")
    p.add_argument("--min-steps", type=count(MAX_STEPS), default=60, help="fewest decode steps per run")
    p.add_argument("--json", default=None, help="also write the points to this JSON file")
    p.set_defaults(device_delay_ms=None)  # unset: CPU_DEVICE_DELAY_MS on the CPU, 0 on CUDA
