"""What the CPU's batch-invariant forward costs: output tok/s with it (the default) and without
it (plain GEMMs and attention: the default before it), on the bench's small workload and the
demo model, both loops, at the lessons' device delays.

The two modes run in the same engine, alternately (ABBA) and many times, so that a shared
machine's slow phases land on both alike; the radix cache is flushed before every run, so both
do the same work. Prints the median tok/s of each and the change.

    python benchmarks/invariance_cost.py [--repeat 8] [--delays 0,3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from minisgl import LLM, SamplingParams, demo_model_path
from minisgl.models.decoder import CPU_INVARIANT_ROWS, set_fixed_rows
from minisgl.observe.bench import small_workload


def set_invariant(llm: LLM, on: bool) -> None:
    """Switch the engine's CPU forward between the invariant kernels and the plain ones."""
    set_fixed_rows(llm.engine.model, CPU_INVARIANT_ROWS if on else 0)
    llm.engine.backend.deterministic = on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=8, help="runs of each mode per configuration")
    ap.add_argument("--delays", default="0,3", help="comma-separated device_delay_ms values")
    args = ap.parse_args()
    workload = small_workload(512)
    print(f"small workload: {len(workload.prompts)} requests, {workload.input_tokens} input / "
          f"{workload.output_tokens} output tokens; {args.repeat} runs per mode, ABBA")
    print(f"{'loop':>8} {'delay':>6} {'plain tok/s':>12} {'invariant':>10} {'change':>8}")
    for delay in (float(d) for d in args.delays.split(",")):
        for loop in ("normal", "overlap"):
            with LLM(demo_model_path(), device="cpu", loop=loop, device_delay_ms=delay) as llm:
                llm.generate([workload.prompts[0][:8]], SamplingParams(max_new_tokens=4))  # warm-up
                rates: dict[bool, list[float]] = {False: [], True: []}
                tokens: dict[bool, list] = {}
                for rep in range(args.repeat):
                    for on in (False, True) if rep % 2 == 0 else (True, False):
                        set_invariant(llm, on)
                        llm.flush_cache()
                        start = time.perf_counter()
                        outs = llm.generate(workload.prompts, workload.params)
                        rates[on].append(workload.output_tokens / (time.perf_counter() - start))
                        tokens[on] = [o.token_ids for o in outs]
            plain, invariant = statistics.median(rates[False]), statistics.median(rates[True])
            print(f"{loop:>8} {delay:>6g} {plain:>12.0f} {invariant:>10.0f} {invariant / plain - 1:>+8.1%}"
                  f"   (same tokens: {tokens[False] == tokens[True]})")


if __name__ == "__main__":
    main()
