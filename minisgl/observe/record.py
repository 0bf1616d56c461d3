"""`python -m minisgl trace | demo`: record a run, then show it as a timeline (and a Chrome trace).

`demo` answers held-out prompts with both loops and shows their timelines one above the
other; `trace` records one loop and writes the spans for Perfetto / chrome://tracing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from ..frontend.options import check_output_file
from ..sampling_params import SamplingParams
from .bench import Workload, console, default_model, measure, print_results, small_workload
from .trace import pipeline_metrics, write_chrome_trace


def run_trace(args: argparse.Namespace) -> int:
    from .timeline import render_timeline

    check_output_file(args.out, "--out")
    model = default_model(args)
    args.model = str(model)
    workload = _demo_workload(model, args.num_requests)
    r = measure(args, workload, args.loop, args.device_delay_ms)
    write_chrome_trace(r["_spans"], args.out)
    console.print(render_timeline(r["_spans"], title=f"{args.loop} loop, device delay {args.device_delay_ms:g} ms"))
    console.print(f"wrote {args.out} ({len(r['_spans'])} spans): open it in https://ui.perfetto.dev or chrome://tracing")
    print_results([r])
    return 0


def _demo_workload(model: Path, n: int) -> Workload:
    """Held-out demo prompts, tokenized for `model` (random ids if it has no tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    from ..demo.tasks import demo_prompts

    params = [SamplingParams(max_new_tokens=48)] * n
    if (model / "tokenizer.json").exists() or (model / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(model)
        return Workload("demo", [tok.encode(p) for p, _ in demo_prompts(n, seed=0)], params)
    return small_workload(AutoConfig.from_pretrained(model).vocab_size, n)


def run_demo(args: argparse.Namespace) -> int:
    """Answer a few held-out demo prompts with both loops, then show both timelines."""
    from ..frontend.options import build_llm
    from ..demo.tasks import demo_prompts
    from .timeline import render_timeline

    pairs = demo_prompts(8, seed=0)
    delay = args.device_delay_ms or 4.0
    timelines, tokens, busy = [], {}, {}
    for loop in ("normal", "overlap"):
        llm = build_llm(args, loop=loop, device_delay_ms=delay, trace=True)
        outs = llm.generate([p for p, _ in pairs], SamplingParams(max_new_tokens=48))
        spans = llm.engine.tracer.resolve()
        metrics = pipeline_metrics(spans)
        tokens[loop] = [o.token_ids for o in outs]
        busy[loop] = metrics["device_busy_fraction"]
        if loop == "normal":
            table = Table(title=f"demo model, {loop} loop")
            for col in ("prompt", "expected", "generated", "ok", "finish"):
                table.add_column(col, overflow="fold")
            for (prompt, expected), out in zip(pairs, outs):
                ok = "[green]yes[/]" if out.text == expected else "[red]no[/]"
                table.add_row(prompt, expected, out.text, ok, out.finish_reason)
            console.print(table)
        timelines.append(render_timeline(spans, title=f"{loop} loop: device busy "
                                         f"{metrics['device_busy_fraction']:.0%}, device delay {delay:g} ms"))
        llm.close()
    for timeline in timelines:
        console.print(timeline)
    same = sum(a == b for a, b in zip(tokens["normal"], tokens["overlap"]))
    verdict = "[green]identical[/]" if same == len(pairs) else f"[red]different in {len(pairs) - same} of {len(pairs)}[/]"
    console.print(f"Tokens of the two loops: {verdict} ({len(pairs)} prompts, token ids compared).")
    # The notice follows this run's figures: on a loaded machine one short run can invert them.
    if busy["overlap"] > busy["normal"]:
        console.print("Notice: in the normal loop the device lane has a gap after every forward while the host "
                      f"works; in the overlap loop the host's work sits under the device's forward (device busy "
                      f"{busy['normal']:.0%} -> {busy['overlap']:.0%}).")
    else:
        console.print(f"Notice: in this run the overlap loop's device was not busier ({busy['normal']:.0%} normal, "
                      f"{busy['overlap']:.0%} overlap): other programs on this machine took the CPU from the emulated "
                      "device and the host in turns, more than the bubble costs. Run it again on a quieter machine.")
    return 0
