"""Lesson 3: the overlap loop: deferred processing, the result queue, the last batch.

Runs the same demo prompts through normal_loop and overlap_loop with the same emulated
device time, and shows the order of launches and commits, both timelines, and that every
token is the same.
"""

from itertools import islice
from typing import Iterable

from common import (answers, best_of, busy_change, console, demo_pairs, figure, header, lesson_main, ms, notice,
                    parse_args, pct, run, section, side_by_side, timeline)

from minisgl import SamplingParams
from minisgl.observe.timeline import export_timelines, render_timeline
from minisgl.observe.trace import ideal_ratio
from minisgl.batch import InFlight
from minisgl.scheduler import Scheduler
from minisgl.tracer import SpanName


def event_string(events: Iterable[tuple[SpanName, int]], n: int = 14) -> str:
    """(LAUNCH, 7) -> L7, (COMMIT, 7) -> C7: the order the host did them in."""
    return " ".join(f"{kind[0].upper()}{bid}" for kind, bid in islice(events, n)) + " ..."


def max_in_flight(events: list[tuple[SpanName, int]]) -> int:
    """Most batches launched and not yet committed at any moment: the pipeline depth."""
    depth = best = 0
    for kind, _ in events:
        depth += 1 if kind == SpanName.LAUNCH else -1
        best = max(best, depth)
    return best


def main() -> None:
    args = parse_args(__doc__, delay_ms=3.0, extra=lambda ap: (
        ap.add_argument("--svg", metavar="FILE", help="also save both timelines as an SVG picture (for slides)"),
        ap.add_argument("--html", metavar="FILE", help="also save both timelines as an HTML page")))
    header(3, "the overlap loop: deferred processing, result queue, last batch",
           [Scheduler.normal_loop, Scheduler.overlap_loop, Scheduler.step, InFlight,
            "lessons/readings §3, §5, §11 (000 「Overlap Scheduler 的执行时间线」, 「在途批次：last_batch 与 "
            "result_queue」; 001 「关键设计：延迟处理」)"])
    pairs = demo_pairs(8 if args.quick else 16)
    prompts, params = [p for p, _ in pairs], SamplingParams(max_new_tokens=40)
    runs = best_of(1 if args.quick else 2, {loop: (f"{loop} loop", dict(loop=loop, delay_ms=args.delay_ms))
                                             for loop in ("normal", "overlap")}, prompts, params)
    normal, overlap = runs["normal"], runs["overlap"]

    section("1. the order of launches (L) and commits (C) on the host")
    for r in (normal, overlap):
        console.print(f"  {r.label:13} {event_string(r.stats.events)}")
        figure(f"max batches in flight ({r.label})", max_in_flight(r.stats.events), "{:d}")
    console.print("  overlap: L(n+1) comes before C(n). The batch in flight is the `last` that step() hands "
                  "to the next overlap_loop call (a result queue of depth one).")

    section("2. both timelines (same device delay)")
    timeline(normal)
    timeline(overlap)
    for path in (args.svg, args.html):
        if path:
            pictures = [render_timeline(r.spans, title=f"{r.label}, device delay {args.delay_ms:g} ms")
                        for r in (normal, overlap)]
            console.print(f"  saved {export_timelines(pictures, path)}")

    section("3. same tokens, less idle device")
    side_by_side(f"device delay {args.delay_ms:g} ms, {len(prompts)} requests", [normal, overlap], {
        "wall time": lambda r: ms(r.wall_s),
        "output tok/s": lambda r: f"{r.tok_per_s:.0f}",
        "device busy": lambda r: pct(r.metrics["device_busy_fraction"]),
        "device idle per forward": lambda r: ms(r.metrics["exposed_host_time_per_step_s"]),
        "host waiting (share of wall)": lambda r: pct(r.metrics["host_wait_fraction"]),
        "batches": lambda r: str(r.stats.batches),
        "late results dropped (lesson 6)": lambda r: str(r.stats.overshoot_tokens),
    })
    figure("device busy (normal)", normal.metrics["device_busy_fraction"])
    figure("device busy (overlap)", overlap.metrics["device_busy_fraction"])
    g, c = normal.metrics["device_time_per_forward_s"], normal.metrics["host_time_per_iteration_s"]
    figure("ideal overlap/normal", ideal_ratio(g, c), "{:.2f}", "(G+C)/max(G,C) from the normal run: the most "
           "the overlap could gain here")
    console.print("  The measured tok/s ratio of two runs this short moves by more than that gain on a busy "
                  "machine, so it is noise here and not a figure to read; lesson 8 measures it with repeats.")
    same = overlap.tokens == normal.tokens
    figure("outputs identical", int(same), "{:d}", "1 = every token of every request is the same")
    answers(pairs, overlap.outs, limit=4, title="overlap loop answers")
    notice("the overlap loop launches batch n+1 before it commits batch n, so the host's commit and schedule "
           f"sit under a forward ({busy_change(normal, overlap)}), and not one token changes.")


if __name__ == "__main__":
    lesson_main(main)
