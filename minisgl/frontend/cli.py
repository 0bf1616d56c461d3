"""Command line: `python -m minisgl generate|bench|lab|trace|demo|serve|make-tiny|train-demo ...`
(minisgl/__main__.py is the entry point).

Exit codes, each with one line `error: ...` on stderr and no traceback:
  2    bad input (missing model directory, bad sampling parameter, unknown mechanism...);
  1    a switched-off mechanism's symptom was detected (`--disable skip_finished`: a double free);
  130  interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Sequence

from ..checks import MAX_TOKENS
from ..sampling_params import FLOAT32_MAX, TOP_K_MAX
from .options import (DELAY_MS, MAX_CLI_REQUESTS, MAX_DEMO_PROMPTS, SEED, Number, NumberList, OneLineParser,
                      add_engine_args, build_llm, count)


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    with build_llm(args) as llm:
        prompts = args.prompt or [p for p, _ in _demo_pairs(args.num_demo_prompts)]
        outs = _generate_with_progress(llm, prompts, params)
    table = Table(title=f"minisgl generate ({args.loop} loop, {llm.device})")
    table.add_column("prompt", overflow="fold")
    table.add_column("output", overflow="fold", style="green")
    table.add_column("tokens", justify="right")
    table.add_column("finish")
    for prompt, out in zip(prompts, outs):
        table.add_row(prompt, out.text, str(len(out.token_ids)), out.finish_reason)
    Console().print(table)
    return 0


def _generate_with_progress(llm, prompts: list[str], params):
    """A progress bar for long runs (a handful of prompts finishes before it would show)."""
    from rich.progress import Progress

    if len(prompts) < 16:
        return llm.generate(prompts, params)
    with Progress(transient=True) as progress:
        task = progress.add_task("generating", total=len(prompts))
        return llm.generate(prompts, params, on_step=lambda done: progress.update(task, completed=done))


def _demo_pairs(n: int) -> list[tuple[str, str]]:
    from ..demo.tasks import demo_prompts

    return demo_prompts(n, seed=0)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from ..demo.tiny import make_tiny

    path = make_tiny(args.out, args.arch, preset=args.preset, seed=args.seed, device=args.device)
    print(f"wrote {args.arch} ({args.preset}) checkpoint to {path}")
    return 0


def cmd_train_demo(argv: Sequence[str]) -> int:
    from ..demo.train_demo import main

    return main(list(argv)) or 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..observe.bench import run_bench

    return run_bench(args)


def cmd_lab(args: argparse.Namespace) -> int:
    from ..observe.lab import run_lab

    return run_lab(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from ..observe.record import run_trace

    return run_trace(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..observe.record import run_demo

    return run_demo(args)


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="minisgl", description="A minimal LLM engine that explains overlap scheduling.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable; default: demo prompts)")
    g.add_argument("--num-demo-prompts", type=count(MAX_DEMO_PROMPTS), default=3,
                   help="without --prompt: how many demo prompts")
    g.add_argument("--max-new-tokens", type=count(MAX_TOKENS), default=32)
    g.add_argument("--temperature", type=Number(float, 0.0, FLOAT32_MAX), default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=Number(int, 1, TOP_K_MAX, special=(-1,)), default=-1, help="-1: off")
    g.add_argument("--top-p", type=Number(float, 0.0, 1.0, low_open=True), default=1.0)
    g.add_argument("--seed", type=SEED, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure throughput (and compare the two loops)")
    add_engine_args(b)
    b.add_argument("--compare-loops", action="store_true", help="run normal and overlap, with and without delay")
    b.add_argument("--workload", default="small", choices=["small", "offline", "online"],
                   help="small: CPU-sized; offline: 256 requests, lengths uniform in 100..1024 (GPU); "
                        "online: the offline lengths arriving at --rate")
    b.add_argument("--num-requests", type=count(MAX_CLI_REQUESTS), default=None)
    b.add_argument("--delays", type=NumberList(DELAY_MS), default=None,
                   help="comma-separated device_delay_ms values for --compare-loops")
    b.add_argument("--hf", action="store_true", help="also time Hugging Face generate on the same requests")
    b.add_argument("--hf-requests", type=count(MAX_CLI_REQUESTS), default=None, help="time HF on only the first N requests")
    b.add_argument("--repeat", type=count(MAX_REPEATS), default=1,
                   help="run every configuration N times, interleaved (median, range)")
    b.add_argument("--json", default=None, help="also write the figures to this JSON file")
    # An online run lasts about requests / rate: below 0.001 req/s one request arrives every 17 minutes;
    # above 10**6 req/s every request has arrived before the first step ends (the offline workload).
    b.add_argument("--rate", type=NumberList(Number(float, 1e-3, 1e6)), default="8",
                   help="--workload online: arrival rate(s) in requests/s, comma-separated")
    b.add_argument("--breakdown", action="store_true",
                   help="attribute the run's device time to prefill, decode by batch size, padding, idle")
    b.set_defaults(func=cmd_bench)

    from ..observe.lab import add_lab_args

    lab = sub.add_parser("lab", help="sweep host work C against device time G: overlap/normal vs the ideal")
    add_engine_args(lab)
    add_lab_args(lab)
    lab.set_defaults(func=cmd_lab)

    t = sub.add_parser("trace", help="record a run and write a Chrome trace JSON (Perfetto, chrome://tracing)")
    add_engine_args(t)
    t.add_argument("--out", default="trace.json")
    t.add_argument("--num-requests", type=count(MAX_DEMO_PROMPTS), default=8)
    t.set_defaults(func=cmd_trace)

    d = sub.add_parser("demo", help="generate with the demo model and show both loops' timelines")
    add_engine_args(d)
    d.set_defaults(func=cmd_demo)

    m = sub.add_parser("make-tiny", help="write a tiny random checkpoint plus a trained BPE tokenizer")
    m.add_argument("out")
    m.add_argument("--arch", default="qwen3", choices=["llama", "qwen2", "qwen3"])
    m.add_argument("--preset", default="tiny", choices=["tiny", "small", "qwen3-0.6b", "qwen3-8b"])
    m.add_argument("--seed", type=SEED, default=0)
    m.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the random weights are drawn (cuda for qwen3-8b: 16 GB)")
    m.set_defaults(func=cmd_make_tiny)

    from ..server.cli import add_serve_args, cmd_serve

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (python -m minisgl serve --help)")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    sub.add_parser("train-demo", help="train the demo model (python -m minisgl train-demo --help)", add_help=False)
    sub.add_parser("course", help="lessons, exercises, hints, student edition, grading (python -m minisgl course --help)",
                   add_help=False)
    return ap


MAX_REPEATS = 100  # bench --repeat: runs of every configuration
SYMPTOM_EXIT = 1  # a switched-off mechanism showed its symptom: not bad input, not a bug of the engine


def run_command(args: argparse.Namespace) -> int:
    """args.func(args). With mechanisms switched off (--disable), a run that fails has shown their
    symptom (a double free, lost requests, a DeviceError from overwritten metadata: the switch table
    in docs/usage.md): one line and exit 1, and the warnings of the failed run's clean-up are dropped.
    With every mechanism on, a failure is a bug and keeps its traceback."""
    disabled = getattr(args, "disable", [])
    if not disabled:
        return args.func(args)
    with warnings.catch_warnings(record=True) as caught:
        try:
            code = args.func(args)
        except (ValueError, TypeError, OSError, KeyboardInterrupt):
            raise  # bad input, or Ctrl-C: handled in main()
        except Exception as exc:  # noqa: BLE001 - the symptom, whatever raised it
            print(f"error: {type(exc).__name__}: {' '.join(str(exc).split())}; detected: the symptom of "
                  f"--disable {','.join(disabled)} (see 'The overlap mechanisms in detail' in docs/usage.md)",
                  file=sys.stderr)
            return SYMPTOM_EXIT
    for w in caught:  # a run that succeeded shows its warnings
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "train-demo":  # its own parser (demo/train_demo.py), same error handling
            return cmd_train_demo(argv[1:])
        if argv and argv[0] == "course":  # passes its arguments on to the lessons' scripts (frontend/course.py)
            from .course import main as course

            return course(argv[1:])
        args = parser().parse_args(argv)  # a bad flag exits with 2 here (OneLineParser)
        return run_command(args)
    except (ValueError, TypeError, OSError) as exc:  # OSError: transformers on an unreadable model directory
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130  # the shell's code for "ended by SIGINT"
