"""Lesson 12: speculative decoding under the overlap: one step is no longer one token.

A verify step sends each request's bonus token and K draft tokens through the target at once and
keeps 1 to K+1 of them. In the overlap loop batch n+1 is planned before batch n's accept lengths
exist. We show that both drafters give the plain tokens in both loops, the steps of different
lengths, what each of Spec V2's protections prevents, and mixed chunk with its length correction.
"""

from common import console, demo_pairs, figure, header, lesson_main, notice, parse_args, run, section, side_by_side, \
    timeline

from minisgl import SamplingParams
from minisgl.features.mixed_chunk import MixedChunk
from minisgl.features.speculative import SpeculativeDecoding
from minisgl.features.speculative.relay import SpecRelay
from minisgl.features.speculative.verify import accept_greedy

K = 3


def speculation(prompts, delay_ms: float) -> dict:
    section("1. both drafters in both loops: exactly the plain tokens, several per step")
    params = SamplingParams(max_new_tokens=24)
    plain = run("normal, plain", prompts, params, loop="normal", delay_ms=delay_ms)
    runs = {"plain": plain, "overlap, plain": run("overlap, plain", prompts, params, delay_ms=delay_ms)}
    for algorithm in ("ngram", "standalone"):
        for loop in ("normal", "overlap"):
            runs[f"{loop}, {algorithm}"] = run(f"{loop}, {algorithm}", prompts, params, loop=loop, delay_ms=delay_ms,
                                               speculative_algorithm=algorithm, speculative_num_steps=K)
    side_by_side(f"{len(prompts)} demo prompts, K = {K} drafts per step, device {delay_ms} ms per forward",
                 list(runs.values()), {
                     "identical to plain": lambda r: str(r.tokens == plain.tokens),
                     "decode steps": lambda r: str(r.stats.decode_batches),
                     "tokens per verify": lambda r: f"{r.stats.spec_accepted_tokens / r.stats.spec_verify_rows:.2f}"
                     if r.stats.spec_verify_rows else "1 (plain)",
                     "tokens/s": lambda r: f"{r.tok_per_s:.0f}",
                 })
    for name in ("overlap, ngram", "overlap, standalone"):
        r = runs[name]
        figure(f"tokens per verify ({name})", r.stats.spec_accepted_tokens / r.stats.spec_verify_rows, "{:.2f}")
    figure("outputs differing from plain", sum(r.tokens != plain.tokens for r in runs.values()), "{:d}")
    return runs


def steps_of_different_lengths(r) -> None:
    section("2. a timeline of steps of different lengths (overlap, standalone draft)")
    spec = r.llm.scheduler.features.speculation
    console.print("  each verify batch, one bar per request: how many tokens it kept (1 = only the target's own)")
    for lengths in list(spec.accept_lengths)[:8]:
        console.print("  " + " ".join("█" * n + "·" * (K + 1 - n) for n in lengths))
    timeline(r, iterations=4)
    lengths = [n for batch in spec.accept_lengths for n in batch]
    figure("verify rows that kept every draft", sum(n == K + 1 for n in lengths), "{:d}")
    figure("verify rows that kept only the target's token", sum(n == 1 for n in lengths), "{:d}")


def protections(prompts, delay_ms: float, plain) -> None:
    section("3. what Spec V2's protections prevent (overlap loop, standalone draft)")
    params = SamplingParams(max_new_tokens=24)
    runs = [run("all on", prompts, params, delay_ms=delay_ms, speculative_algorithm="standalone"),
            run("spec_publish_wait off", prompts, params, delay_ms=delay_ms, speculative_algorithm="standalone",
                disable=("spec_publish_wait",)),
            run("spec_alloc_reserve off", prompts, params, delay_ms=delay_ms, speculative_algorithm="standalone",
                disable=("spec_alloc_reserve",)),
            run("release_allocated off", prompts, params, delay_ms=delay_ms, speculative_algorithm="standalone",
                disable=("release_allocated",))]
    side_by_side("each switch off in turn", runs, {
        "outputs differing from plain": lambda r: str(sum(a != b for a, b in zip(r.tokens, plain.tokens))),
        "verify rows past their slots": lambda r: str(r.llm.scheduler.features.speculation.unallocated_writes),
        "KV slots held after the drain": lambda r: str(held_after_flush(r)),
    })
    figure("outputs differing (publish wait off)", sum(a != b for a, b in zip(runs[1].tokens, plain.tokens)), "{:d}",
           "the host read last step's lengths: attention over too few positions",
           needs=(11, "wait for the publish before reading the mirror"))
    figure("verify rows past their slots (reserve off)", runs[2].llm.scheduler.features.speculation.unallocated_writes,
           "{:d}", "the verify in flight moved the start of the next one by up to K+1",
           needs=(11, "allocate for the most a step can accept"))
    figure("KV slots leaked (release_allocated off)", held_after_flush(runs[3]), "{:d}",
           "the rejected drafts' slots and the reserve stay with finished requests",
           needs=(4, "release by allocated length"))


def held_after_flush(r) -> int:
    r.llm.flush_cache()
    mem = r.llm.memory_report()
    return mem["kv_total"] - mem["kv_free"]


def mixed_chunk(prompts, delay_ms: float) -> None:
    section("4. mixed chunk: a prefill chunk and the running decodes in one forward")
    params = SamplingParams(max_new_tokens=16)
    common = dict(delay_ms=delay_ms, chunk_size=16, max_running_requests=4)
    runs = [run("normal, plain", prompts, params, loop="normal", **common),
            run("overlap, mixed", prompts, params, enable_mixed_chunk=True, **common),
            run("normal, mixed", prompts, params, loop="normal", enable_mixed_chunk=True, **common),
            run("overlap, mixed, committed - 1", prompts, params, enable_mixed_chunk=True,
                disable=("mixed_prefix_from_launched",), **common)]
    side_by_side("chunks of 16 prompt tokens, at most 4 requests running", runs, {
        "identical to plain": lambda r: str(r.tokens == runs[0].tokens),
        "forwards": lambda r: str(r.stats.batches),
        "decode rows in prefill batches": lambda r: str(mixed_rows(r)),
    })
    figure("decode rows mixed into prefill batches", mixed_rows(runs[1]), "{:d}")
    figure("outputs differing (mixed, launched length)", sum(a != b for a, b in zip(runs[1].tokens, runs[0].tokens)),
           "{:d}")
    figure("outputs differing (mixed, committed - 1 under the overlap)",
           sum(a != b for a, b in zip(runs[3].tokens, runs[0].tokens)), "{:d}",
           "SGLang's serial formula without the overlap's delta: every decode row one position early",
           needs=(12, "the decode row"))


def mixed_rows(r) -> int:
    mixed = r.llm.scheduler.features.mixed_chunk
    return mixed.decode_rows if mixed is not None else 0


def main() -> None:
    args = parse_args(__doc__, delay_ms=5.0)
    header(12, "speculative decoding under the overlap, and mixed chunk",
           [SpeculativeDecoding.plan_decode, SpecRelay.host_lengths, accept_greedy, SpeculativeDecoding.accepted,
            MixedChunk.mix, "lessons/readings §18"])
    prompts = [p for p, _ in demo_pairs(6 if args.quick else 12)]
    runs = speculation(prompts, args.delay_ms)
    steps_of_different_lengths(runs["overlap, standalone"])
    protections(prompts, args.delay_ms, runs["plain"])
    mixed_chunk(prompts, args.delay_ms)
    notice("a verify step keeps 1 to K+1 tokens, known only on the device: the next step is planned with KV for the "
           "most it may need, reads its positions from the relay, and its host lengths only after the publish event.")


if __name__ == "__main__":
    lesson_main(main)
