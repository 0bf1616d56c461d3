"""Speculative decoding on the CPU: tokens per verify step and tok/s, with and without a drafter.

    python benchmarks/speculative.py [--requests 32] [--max-new-tokens 48] [--repeat 3] [--model DIR]

The demo model's held-out prompts, greedy, in the overlap loop; each configuration runs `--repeat`
times on a fresh engine after a warm-up, and the best wall time is printed (a shared machine
slows runs down, it never speeds them up). Every configuration must give the plain tokens.
"""

from __future__ import annotations

import argparse
import time

from minisgl import LLM, SamplingParams, demo_model_path
from minisgl.demo.tasks import demo_prompts

CONFIGS = {"plain": {}, "ngram, K=3": dict(speculative_algorithm="ngram", speculative_num_steps=3),
           "standalone, K=3": dict(speculative_algorithm="standalone", speculative_num_steps=3),
           "standalone, K=5": dict(speculative_algorithm="standalone", speculative_num_steps=5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default=str(demo_model_path()))
    args = ap.parse_args()
    prompts = [p for p, _ in demo_prompts(args.requests, seed=0)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    plain_tokens = None
    print(f"{args.requests} demo prompts, max_new_tokens {args.max_new_tokens}, overlap loop, CPU, best of {args.repeat}")
    print(f"{'configuration':18} {'tok/s':>8} {'tokens/verify':>14} {'decode steps':>13} {'same tokens':>12}")
    for name, settings in CONFIGS.items():
        best, stats, tokens = float("inf"), None, None
        for _ in range(args.repeat):
            with LLM(args.model, device="cpu", **settings) as llm:
                llm.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
                llm.reset_stats()
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - start
                if wall < best:
                    best, stats, tokens = wall, llm.stats, [o.token_ids for o in outs]
        plain_tokens = plain_tokens or tokens
        per_verify = f"{stats.spec_accepted_tokens / stats.spec_verify_rows:.2f}" if stats.spec_verify_rows else "1"
        print(f"{name:18} {sum(map(len, tokens)) / best:8.1f} {per_verify:>14} {stats.decode_batches:13d} "
              f"{str(tokens == plain_tokens):>12}")


if __name__ == "__main__":
    main()
