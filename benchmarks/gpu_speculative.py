"""Speculative decoding and mixed chunk on a GPU: exactness, then TPOT with and without a draft.

    python benchmarks/gpu_speculative.py DIR [--attention-backend auto|torch|flashinfer] [--device cuda]

1. bf16 with deterministic=True: for ngram, standalone (the target as its own draft) and mixed
   chunk, the overlap and normal loops give the tokens of plain decoding (16 prompts, 32 tokens).
2. TPOT (the mean over requests) at batch 1 and 16, overlap loop, plain against the standalone
   draft at K=3. Random weights accept no draft of another model, so the draft is the target itself:
   every draft is accepted, the upper bound of what speculation can give on this shape.
3. The cost of one verify step (K+1 tokens a request, ngram drafts, no draft model) against one
   plain decode step, at batch 1, 16 and 64: the median device time of a decode batch's forward
   (the tracer's forward spans, steady decode).
"""

from __future__ import annotations

import argparse
import statistics

from minisgl import LLM, SamplingParams
from minisgl.tracer import SpanName
from minisgl.observe.trace import request_metrics

K = 3


def prompts(n: int) -> list[list[int]]:
    """n distinct prompts of 24..24+3(n-1) tokens, ids in [50, 450) (any vocabulary of 512 and up)."""
    return [[50 + (7 * i + j) % 400 for j in range(24 + 3 * i)] for i in range(n)]


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
    verify_cost(args, speculative["ngram"])
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


def decode_forward_ms(args, batch: int, **settings) -> float:
    """Median device ms of one decode batch's forward (the tracer's spans), batch requests x 64 tokens."""
    with LLM(args.model, device=args.device, attention_backend=args.attention_backend, trace=True, **settings) as llm:
        llm.generate(prompts(2), SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        llm.engine.tracer.clear()
        llm.generate(prompts(batch), SamplingParams(max_new_tokens=64, ignore_eos=True))
        tracer = llm.engine.tracer
        decode_ids = {b.batch_id for b in tracer.batches if not b.is_prefill and b.num_reqs == batch}
        spans = [s.duration for s in tracer.resolve() if s.name is SpanName.FORWARD and s.batch_id in decode_ids]
    return statistics.median(spans) * 1e3


def verify_cost(args, ngram: dict) -> None:
    """One verify step of K+1 tokens a request against one plain decode step, device ms per forward."""
    for batch in (1, 16, 64):
        plain_ms = decode_forward_ms(args, batch)
        verify_ms = decode_forward_ms(args, batch, **ngram)
        print(f"verify step (ngram, {K + 1} tokens a request) against a decode step, batch {batch:2}: "
              f"{verify_ms:.3f} / {plain_ms:.3f} ms device per forward ({verify_ms / plain_ms:.2f}x)")


if __name__ == "__main__":
    main()
