"""Speculative decoding and mixed chunk on a GPU: exactness, then TPOT with and without a draft.

    python benchmarks/gpu_speculative.py DIR [--attention-backend auto|torch|flashinfer] [--device cuda]

1. bf16 with deterministic=True: for ngram, standalone (the target as its own draft) and mixed
   chunk, the overlap and normal loops give the tokens of plain decoding (16 prompts, 32 tokens).
2. TPOT (the mean over requests) at batch 1 and 16, overlap loop, plain against the standalone
   draft at K=3. Random weights accept no draft of another model, so the draft is the target itself:
   every draft is accepted, the upper bound of what speculation can give on this shape.
"""

from __future__ import annotations

import argparse

from minisgl import LLM, SamplingParams
from minisgl.observe.trace import request_metrics

K = 3


def prompts(n: int) -> list[list[int]]:
    return [[100 + 7 * i + j for j in range(24 + 3 * i)] for i in range(n)]


def run(model: str, device: str, batch: int, max_new_tokens: int, **settings) -> tuple[list[list[int]], float, dict]:
    with LLM(model, device=device, **settings) as llm:
        llm.generate(prompts(2), SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up (graphs, kernels)
        llm.reset_stats()
        outs = llm.generate(prompts(batch), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        return [o.token_ids for o in outs], request_metrics(outs)["tpot_mean_s"], vars(llm.stats).copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = ap.parse_args()
    common = dict(attention_backend=args.attention_backend)
    speculative = {"ngram": dict(speculative_algorithm="ngram", speculative_num_steps=K),
                   "standalone": dict(speculative_algorithm="standalone", speculative_num_steps=K,
                                      speculative_draft_model_path=args.model),
                   "mixed chunk": dict(enable_mixed_chunk=True, chunk_size=64)}
    plain, _, _ = run(args.model, args.device, 16, 32, deterministic=True, **common)
    exactness(args, plain, "standalone", speculative["standalone"])
    tpot(args, speculative["standalone"])
    for name in ("mixed chunk", "ngram"):
        exactness(args, plain, name, speculative[name])


def exactness(args, plain: list[list[int]], name: str, settings: dict) -> None:
    """bf16, deterministic=True: both loops against plain decoding (16 prompts x 32 tokens)."""
    for loop in ("overlap", "normal"):
        tokens, _, stats = run(args.model, args.device, 16, 32, deterministic=True, loop=loop,
                               attention_backend=args.attention_backend, **settings)
        same = sum(a == b for a, b in zip(tokens, plain))
        print(f"bf16 deterministic, 16 x 32 tokens: {name:12} {loop:8} {same}/16 identical to plain; "
              f"verify rows {stats.get('spec_verify_rows', 0)}, accepted {stats.get('spec_accepted_tokens', 0)}")


def tpot(args, standalone: dict) -> None:
    """TPOT, overlap loop, 128 tokens per request: plain against the standalone draft."""
    for batch in (1, 16):
        _, plain_tpot, _ = run(args.model, args.device, batch, 128, attention_backend=args.attention_backend)
        _, spec_tpot, stats = run(args.model, args.device, batch, 128, attention_backend=args.attention_backend,
                                  **standalone)
        per_verify = stats["spec_accepted_tokens"] / max(stats["spec_verify_rows"], 1)
        print(f"TPOT, overlap, 128 tokens, batch {batch:2}: plain {plain_tpot * 1e3:.2f} ms, standalone K={K} "
              f"(draft = target) {spec_tpot * 1e3:.2f} ms ({per_verify:.2f} tokens per verify row)")


if __name__ == "__main__":
    main()
