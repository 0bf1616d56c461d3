"""Host work per iteration as the queue grows (issue 27): the same running bound, more requests.

    python benchmarks/host_vs_queue.py MODEL_DIR [--rows 64] [--scales 1,4,16] [--lengths 20,200] [--loop normal]
                                       [--kv-tokens N]

An offline workload (prompt and output lengths uniform in --lengths, seed 0) of rows x scale
requests runs through one loop with `max_running_requests = rows`. After every step
(`generate`'s on_step) the main thread's CPU time since the previous step is taken
(`time.thread_time`: the host's own work, whatever else loads the machine; waiting on the
device costs none) and filed under what the step launched: a prefill, or a decode step of
B requests. Printed per scale: CPU ms per step for each kind, per decode row, and overall.

If a step's work grew with the queue, decode ms per row would grow with the scale. What does
grow with the scale is the mix: the queue keeps the decode batch full (a short queue lets it
drain in a long tail), and every finish admits a new request with a prefill step of its own.
On the CPU the launch only queues closures; on a GPU it also runs the eager prefill's kernel
launches and the decode plan, so the mix weighs more there. CPU only: on a GPU the host's wait
for copy_done may spin, and CPU time would count it; there `bench --breakdown` prints C per
iteration by phase from the trace's spans (`bash benchmarks/h200.sh scale`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minisgl import LLM, SamplingParams


def offline(num: int, lo: int, hi: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [[rng.randint(3, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(num)]
    params = [SamplingParams(max_new_tokens=rng.randint(lo, hi), ignore_eos=True) for _ in range(num)]
    return prompts, params


def measure(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[float]]:
    """CPU ms of every step, by kind: 'prefill', 'decode' (and 'decode_rows': its batch size), 'none'."""
    sched = llm.scheduler
    by_kind: dict[str, list[float]] = {"prefill": [], "decode": [], "decode_rows": [], "none": []}
    stats = sched.stats
    last = {"cpu": time.thread_time(), "prefill": stats.prefill_batches, "decode": stats.decode_batches,
            "rows": stats.decode_rows}

    def on_step(_done: int) -> None:
        now = time.thread_time()
        ms = (now - last["cpu"]) * 1000
        if stats.prefill_batches > last["prefill"]:
            by_kind["prefill"].append(ms)
        elif stats.decode_batches > last["decode"]:
            by_kind["decode"].append(ms)
            by_kind["decode_rows"].append(stats.decode_rows - last["rows"])
        else:
            by_kind["none"].append(ms)
        last.update(prefill=stats.prefill_batches, decode=stats.decode_batches, rows=stats.decode_rows)
        last["cpu"] = time.thread_time()  # the callback's own bookkeeping is left out

    llm.generate(prompts, params, on_step=on_step)
    return by_kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--loop", default="normal", choices=["normal", "overlap"])
    ap.add_argument("--rows", type=int, default=64, help="max_running_requests")
    ap.add_argument("--scales", default="1,4,16", help="requests = rows x scale, for each scale")
    ap.add_argument("--lengths", default="20,200", help="prompt and output lengths: uniform in LO,HI")
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help="KV pool size (default: 4 full batches of the longest requests)")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lengths.split(","))
    scales = [int(x) for x in args.scales.split(",")]
    # A pool of 4 full batches of the longest requests: the radix cache fills (and evicts) at the
    # larger scales, as the H200's did at 1,024 requests and more.
    llm = LLM(args.model, device="cpu", loop=args.loop, max_running_requests=args.rows,
              kv_tokens=args.kv_tokens or 4 * args.rows * 2 * hi)
    vocab = llm.engine.model.vocab_size
    llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4))  # warm-up
    print(f"main-thread CPU ms per step, {args.loop} loop, cpu, rows {args.rows}, lengths {lo}..{hi}")
    print(f"{'requests':>8} {'steps':>6} {'all':>6} {'prefill':>8} {'decode':>7} {'rows':>6} {'us/row':>7} {'prefill%':>8}")
    for scale in scales:
        prompts, params = offline(args.rows * scale, lo, hi, vocab)
        llm.flush_cache()
        k = measure(llm, prompts, params)
        steps = len(k["prefill"]) + len(k["decode"]) + len(k["none"])
        every = k["prefill"] + k["decode"] + k["none"]
        mean = statistics.mean
        print(f"{len(prompts):>8} {steps:>6} {mean(every):6.3f} {mean(k['prefill']):8.3f} {mean(k['decode']):7.3f} "
              f"{mean(k['decode_rows']):6.1f} {1000 * sum(k['decode']) / sum(k['decode_rows']):7.1f} "
              f"{len(k['prefill']) / steps:8.1%}")
    llm.close()


if __name__ == "__main__":
    main()
