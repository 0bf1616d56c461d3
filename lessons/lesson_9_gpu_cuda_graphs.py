"""Lesson 9 (GPU): CUDA graphs and the overlap, on a real device.

Needs an NVIDIA GPU: without one it says so and exits 0. On a GPU the device is fast, so
the host becomes the bottleneck: CUDA graphs shrink the launch cost, the overlap hides the
rest, and pinned_copy shows what a blocking device-to-host copy does to both.
"""

import sys
import tempfile
from pathlib import Path

import torch
from common import (answers, console, demo_pairs, figure, header, lesson_main, ms, notice, parse_args, pct, run,
                    section, side_by_side, timeline)

from minisgl import SamplingParams
from minisgl.tracer import SpanName

GPU_MESSAGE = "Lesson 9 needs an NVIDIA GPU (torch.cuda.is_available() is False here): nothing to run, exiting."


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def launch_ms(r) -> float:
    """Median host time inside launch(): queueing the forward (and, pinned_copy off, waiting for it)."""
    return median([s.duration for s in r.spans if s.name == SpanName.LAUNCH]) * 1e3


def correctness(quick: bool) -> None:
    section("1. the demo model on the GPU (float32, torch attention): same answers, both loops")
    pairs = demo_pairs(8 if quick else 16)
    prompts, params = [p for p, _ in pairs], SamplingParams(max_new_tokens=40)
    normal = run("normal", prompts, params, loop="normal", device="cuda", dtype="float32")
    overlap = run("overlap", prompts, params, device="cuda", dtype="float32")
    answers(pairs, overlap.outs, limit=4, title="overlap loop on CUDA")
    figure("outputs identical (GPU)", int(normal.tokens == overlap.tokens), "{:d}")


def graphs_and_copies(quick: bool) -> None:
    from minisgl.gpu.flashinfer_backend import flashinfer_available
    from minisgl.demo.tiny import make_tiny

    # A Qwen3-0.6B-shaped model (random bf16 weights): a decode step long enough (G) to hide the
    # host's work (C) under. --quick: the 2-layer "small" preset, where C > G and nothing can hide.
    preset = "small" if quick else "qwen3-0.6b"
    section(f"2. a bf16 model, preset {preset!r} (random weights): graphs, overlap, pinned copies")
    if not flashinfer_available():
        console.print("  FlashInfer is not installed: attention runs on the torch backend and CUDA graphs are off "
                      "(they capture FlashInfer's decode). Install the `cuda` extra to see them.")
    model = make_tiny(Path(tempfile.mkdtemp(prefix="minisgl-l9-")), "qwen3", preset=preset, seed=3)
    n, new = (16, 32) if quick else (64, 64)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16 + i % 32)] for i in range(n)]
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    common = dict(model=model, device="cuda")
    runs = [run("overlap, graphs", prompts, params, **common),
            run("normal, graphs", prompts, params, loop="normal", **common),
            run("overlap, eager", prompts, params, disable=("cuda_graph",), **common),
            run("normal, eager", prompts, params, loop="normal", disable=("cuda_graph",), **common)]
    copy = [run("pinned_copy on, 5 ms", prompts[:4], params, delay_ms=5.0, **common),
            run("pinned_copy off, 5 ms", prompts[:4], params, disable=("pinned_copy",), delay_ms=5.0, **common)]
    side_by_side(f"{n} requests x {new} tokens", runs + copy, {
        "graphs captured": lambda r: str(r.llm.engine.graphs is not None),
        "output tok/s": lambda r: f"{r.tok_per_s:.0f}",
        "G: device time per forward": lambda r: ms(r.metrics["device_time_per_forward_s"]),
        "C: host work per iteration": lambda r: ms(r.metrics["host_time_per_iteration_s"]),
        "launch() median": lambda r: f"{launch_ms(r):.2f} ms",
        "device busy": lambda r: pct(r.metrics["device_busy_fraction"]),
    })
    timeline(runs[1])
    timeline(runs[0])
    by = {r.label: r for r in runs + copy}
    figure("device busy (normal, graphs)", by["normal, graphs"].metrics["device_busy_fraction"])
    figure("device busy (overlap, graphs)", by["overlap, graphs"].metrics["device_busy_fraction"])
    figure("overlap/normal tok/s (graphs)", by["overlap, graphs"].tok_per_s / by["normal, graphs"].tok_per_s, "{:.2f}")
    figure("graphs/eager tok/s (overlap)", by["overlap, graphs"].tok_per_s / by["overlap, eager"].tok_per_s, "{:.2f}")
    for r in copy:
        figure(f"launch/forward ({r.label})", launch_ms(r) / (r.metrics["device_time_per_forward_s"] * 1e3), "{:.2f}",
               "near 1: launch() waited for the whole forward")


def main() -> None:
    args = parse_args(__doc__, delay_ms=0.0)
    if not torch.cuda.is_available():
        print(GPU_MESSAGE)
        sys.exit(0)
    header(9, "CUDA graphs and the overlap on a GPU",
           ["minisgl/gpu/cuda_graph.py CudaGraphRunner (capture per batch size, replay)",
            "minisgl/engine.py Engine._forward_and_sample (graphs.run, non_blocking copy into pinned memory)",
            "minisgl/gpu/cuda_stream.py CudaStream", "lessons/readings §11, §3 (001 「Overlap Scheduler 的解法」: two streams; "
            "000 「Overlap Scheduler 的执行时间线」: copy_done, and no copy stream here)"])
    console.print(f"device: {torch.cuda.get_device_name()}  (FlashInfer compiles its kernels on first use: "
                  f"the first run on a fresh machine can take a minute or more)")
    correctness(args.quick)
    graphs_and_copies(args.quick)
    notice("eager, the host spends a whole forward just launching kernels; graphs cut that to one replay, so "
           "G outlasts C and the overlap hides the rest (device busy to ~99%); a blocking copy (pinned_copy off) "
           "turns launch() back into a wait.")


if __name__ == "__main__":
    lesson_main(main)
