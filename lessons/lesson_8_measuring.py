"""Lesson 8: measuring: throughput, TTFT, TPOT, idle gaps, scheduler CPU time, and the ideal.

Runs one workload through both loops at two device speeds, reads every figure the article
asks for, and sets the measured overlap/normal ratio next to the ideal (G+C)/max(G,C).
Then checks what a speed-up must never cost: identical tokens and a whole KV pool.
"""

from common import (console, demo_pairs, figure, header, lesson_main, median, median_run, ms, notice, parse_args, pct,
                    rounds, run, section, side_by_side, unwritten)

from minisgl import SamplingParams
from minisgl.frontend.options import count
from minisgl.observe.trace import ideal_ratio, pipeline_metrics, request_metrics, share_of_gain

MAX_REQUESTS = 128  # --requests: as many as the lessons' KV pool (make_llm: 8192 slots) holds at once


def pool_whole(r) -> bool:
    mem = r.llm.memory_report()
    return mem["kv_free"] + mem["kv_cached"] == mem["kv_total"] and mem["rows_free"] == mem["rows_total"]


def answers_right(r, pairs) -> int:
    """Answers checked on the text before the first EOS (the runs use ignore_eos, for a steady batch)."""
    eos = r.llm.eos_ids
    right = 0
    for (_, expected), out in zip(pairs, r.outs):
        ids = out.token_ids
        cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        right += r.llm.tokenizer.decode(ids[:cut]) == expected
    return right


def loops_at(delays, prompts, params, reps: int) -> dict:
    """Both loops at each delay, `reps` rounds; every request runs at once (a row each)."""
    configs = {(loop, delay): (f"{loop} {delay:g}ms",
                               dict(loop=loop, delay_ms=delay, max_running_requests=len(prompts)))
               for delay in delays for loop in ("normal", "overlap")}
    return rounds(reps, configs, prompts, params)


def main() -> None:
    args = parse_args(__doc__, delay_ms=2.0, extra=lambda ap: ap.add_argument(
        "--requests", type=count(MAX_REQUESTS), metavar="N",
        help=f"requests (default 64, 32 with --quick; at most {MAX_REQUESTS}); section 1 runs them all at once"))
    header(8, "measuring the two loops",
           [pipeline_metrics, request_metrics, ideal_ratio, share_of_gain,
            "minisgl/observe/lab.py (the lab: sweep C/G, `make lab`)",
            "lessons/readings §10, §2 (000 「性能数字应该怎样读」, 「串行调度为什么会让 GPU 等 CPU」: the formulas)"])
    pairs = demo_pairs(args.requests or (32 if args.quick else 64))
    prompts = [p for p, _ in pairs]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)  # every request decodes the same number of steps
    delays = (0.0, args.delay_ms)
    reps = 1 if args.quick else 3
    all_runs = loops_at(delays, prompts, params, reps)
    runs = {key: median_run(rs) for key, rs in all_runs.items()}

    section(f"1. every figure, {len(prompts)} requests x 32 tokens, both loops, two device speeds")
    side_by_side(f"each configuration: its run of median throughput, of {reps}", list(runs.values()), {
        "output tok/s": lambda r: f"{r.tok_per_s:.0f}",
        "TTFT mean": lambda r: ms(r.latency["ttft_mean_s"]),
        "TPOT (= ITL) mean": lambda r: ms(r.latency["tpot_mean_s"]),
        "G: device time per forward": lambda r: ms(r.metrics["device_time_per_forward_s"]),
        "C: host work per iteration": lambda r: ms(r.metrics["host_time_per_iteration_s"]),
        "device busy": lambda r: pct(r.metrics["device_busy_fraction"]),
        "idle gaps: total / median": lambda r: f"{ms(r.metrics['idle_gap_total_s'])} / "
                                               f"{ms(r.metrics['idle_gap_median_s'])}",
        "device idle per forward": lambda r: ms(r.metrics["exposed_host_time_per_step_s"]),
        "scheduler CPU time": lambda r: ms(r.host_cpu_s),
        "host waiting (share of wall)": lambda r: pct(r.metrics["host_wait_fraction"]),
    })

    section("2. measured speed-up against the ideal (G+C)/max(G,C), G and C from the normal run")
    console.print("  C is the host work per iteration (schedule + launch + commit spans, no waiting), as everywhere "
                  "in minisgl. The normal loop's device idle per forward (the bubble) is C plus the hand-off "
                  "between the threads.")
    for delay in delays:
        normal, overlap = runs["normal", delay], runs["overlap", delay]
        g = normal.metrics["device_time_per_forward_s"]
        c = normal.metrics["host_time_per_iteration_s"]
        # One ratio per round: the two loops of a round ran side by side, under the same load.
        ratios = [o.tok_per_s / n.tok_per_s for n, o in zip(all_runs["normal", delay], all_runs["overlap", delay])]
        ideal = ideal_ratio(g, c)
        console.print(f"  delay {delay:g} ms: G {ms(g)}, C {ms(c)}, "
                      f"bubble {ms(normal.metrics['exposed_host_time_per_step_s'])}")
        figure(f"ideal (delay {delay:g} ms)", ideal, "{:.2f}")
        figure(f"overlap/normal (delay {delay:g} ms)", median(ratios), "{:.2f}",
               f"median of {len(ratios)} rounds, range {min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1
               else "one round (--quick): a single, noisy ratio")
        share, why = share_of_gain(ratios, ideal)  # the rule bench --compare-loops and the lab print by
        console.print(f"  share of the possible gain: not computed; {why}" if why
                      else f"  share of the possible gain realised: {share:.0%}")

    section("3. what a speed-up must never cost (「不能只用平均 tokens/s 判断正确性」)")
    every = list(runs.values())
    same = all(r.tokens == every[0].tokens for r in every)
    finish = all([o.finish_reason for o in r.outs] == [o.finish_reason for o in every[0].outs] for r in every)
    figure("outputs identical", int(same and finish), "{:d}", "token ids and finish reasons, all runs")
    figure("pools whole", int(all(pool_whole(r) for r in every)), "{:d}",
           "kv_free + kv_cached == kv_total and every row free, after every run")
    figure("answers right", answers_right(every[0], pairs), "{:d}", f"of {len(pairs)}, text before the first EOS")

    section("4. prefill_sync: commit a prefill before launching the next prefill (the TTFT boundary)")
    chunked = dict(chunk_size=16, delay_ms=args.delay_ms)
    sync_on = run("prefill_sync on", prompts, params, **chunked)
    sync_off = run("prefill_sync off", prompts, params, disable=("prefill_sync",), **chunked)
    for r in (sync_on, sync_off):
        console.print(f"  {r.label:17} {' '.join(f'{k[0].upper()}{b}' for k, b in list(r.stats.events)[:12])} ...")
    side_by_side("chunk_size 16: a prompt queue that takes several prefill batches to drain", [sync_on, sync_off], {
        "prefill batches": lambda r: str(r.stats.prefill_batches),
        "commits forced before a launch": lambda r: str(r.stats.early_commits),
        "TTFT p50": lambda r: ms(r.latency["ttft_p50_s"]),
        "output tok/s": lambda r: f"{r.tok_per_s:.0f}",
        "device busy": lambda r: pct(r.metrics["device_busy_fraction"]),
    })
    figure("early commits (prefill_sync on)", sync_on.stats.early_commits, "{:d}", "prefill batches - 1",
           needs=(1, "overlap_loop"))
    figure("early commits (prefill_sync off)", sync_off.stats.early_commits, "{:d}")
    if not unwritten(1, "overlap_loop"):  # its stub never commits a prefill early: the line above says so
        console.print("  On, a prefill's first tokens are committed before the next prefill is launched (C2 before "
                      "L3). The TTFT gain is the host time of scheduling one prefill: tiny here, next to the noise of "
                      "a shared machine; with long prompts and radix matching it is not.")
    notice("read busy fraction and idle per forward first: they show the bubble directly; throughput follows "
           "about as far as (G+C)/max(G,C), an estimate from the normal run (the overlap run's own G differs, so "
           "it can be exceeded), and on this CPU the emulated device shares the GIL.")


if __name__ == "__main__":
    lesson_main(main)
