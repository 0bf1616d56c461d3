"""Lesson 11: constrained decoding: the mask needs a token the host does not have yet.

A grammar allows, at each step, only the tokens its current state permits. In the overlap loop
batch n+1 is planned while batch n's token is still on the device, so the state is one token
behind at planning. minisgl (like SGLang) launches n+1's forward, commits n, and only then builds
n+1's masks and launches its sampling. We show the outputs, the naive mask's symptom, the cost in
the timeline, and logprobs with their launch snapshot.
"""

from common import (console, demo_pairs, figure, header, lesson_main, notice, parse_args, run, section,
                    side_by_side, timeline, unwritten)

from minisgl import SamplingParams
from minisgl.features.grammar import DelayedSampling, Grammar, build_mask, launch_sample
from minisgl.features.logprobs import plan_logprobs

SPACE, DIGITS, EOS = 223, range(18, 28), 1  # the demo tokenizer's " ", "0".."9" and EOS
DIGITS_THEN_STOP = Grammar.sequence_of([[SPACE], DIGITS], repeat_last=True, end=[EOS])


def broken(r) -> int:
    return sum(not DIGITS_THEN_STOP.accepts_prefix(t) for t in r.tokens)


def outputs_and_symptom(prompts, delay_ms: float) -> None:
    section("1. a grammar in both loops, and the naive mask (grammar_delayed_sample off)")
    params = SamplingParams(max_new_tokens=6, grammar=DIGITS_THEN_STOP)
    runs = [run("normal", prompts, params, loop="normal", delay_ms=delay_ms),
            run("overlap", prompts, params, delay_ms=delay_ms),
            run("overlap, naive mask", prompts, params, disable=("grammar_delayed_sample",), delay_ms=delay_ms)]
    side_by_side(f"{len(prompts)} add/count/reverse prompts, grammar: ' ' digits... EOS", runs, {
        "first answer": lambda r: repr(r.outs[0].text),
        "outputs breaking the grammar": lambda r: str(broken(r)),
        "delayed samplings": lambda r: str(r.stats.delayed_samples),
        "identical to normal": lambda r: str(r.tokens == runs[0].tokens),
    })
    if not unwritten(10, "delay the sampling"):  # its stub never builds the naive mask: the figure below says so
        console.print(f"  naive mask, first output ids: {runs[2].tokens[0]}  (the state at planning still "
                      "expected the space: it allowed a second one)")
    figure("outputs breaking the grammar (overlap)", broken(runs[1]), "{:d}")
    figure("outputs breaking the grammar (naive mask)", broken(runs[2]), "{:d}", needs=(10, "delay the sampling"))


def cost(prompts, delay_ms: float, host_ms: float) -> None:
    section("2. the cost: how much of the overlap survives when the sampling waits for the commit")
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=8, ignore_eos=True,
                                 grammar=Grammar.sequence_of([DIGITS], repeat_last=True))
    runs = {(loop, g is not None): run(f"{loop}{', grammar' if g else ''}", prompts, p, loop=loop,
                                       delay_ms=delay_ms, host_delay_ms=host_ms)
            for loop in ("normal", "overlap") for g, p in ((None, plain), (True, constrained))}
    side_by_side(f"device {delay_ms} ms and host {host_ms} ms per step", list(runs.values()), {
        "wall": lambda r: f"{r.wall_s * 1e3:.0f} ms",
        "tokens/s": lambda r: f"{r.tok_per_s:.0f}",
        "delayed samplings": lambda r: str(r.stats.delayed_samples),
    })
    timeline(runs["overlap", True], iterations=4)
    saved = runs["normal", False].wall_s - runs["overlap", False].wall_s
    saved_grammar = runs["normal", True].wall_s - runs["overlap", True].wall_s
    figure("overlap speed-up without grammar", runs["normal", False].wall_s / runs["overlap", False].wall_s, "{:.2f}")
    figure("overlap speed-up with grammar", runs["normal", True].wall_s / runs["overlap", True].wall_s, "{:.2f}")
    figure("share of the overlap's saving that survives with grammars", saved_grammar / saved if saved > 0 else 0.0,
           "{:.2f}", "the forward still hides the schedule and the commit; the mask build and the sampling do not")


def logprobs(prompts, delay_ms: float) -> None:
    section("3. logprobs, and the lengths snapshotted at launch (logprob_snapshot off)")
    params = SamplingParams(max_new_tokens=4, logprobs=2)
    runs = [run("overlap", prompts, params, delay_ms=delay_ms, chunk_size=8),
            run("overlap, live lengths", prompts, params, disable=("logprob_snapshot",), delay_ms=delay_ms,
                chunk_size=8)]
    for r in runs:
        out = r.outs[0]
        console.print(f"  {r.label:22} tokens {out.token_ids}  logprob tokens "
                      f"{[lp.token_id if lp else None for lp in out.logprobs]}")
    misplaced = [sum(lp is None or lp.token_id != t for lp, t in zip(o.logprobs, o.token_ids)) for o in runs[1].outs]
    figure("misplaced logprobs (snapshot on)", sum(sum(lp is None or lp.token_id != t for lp, t in
                                                       zip(o.logprobs, o.token_ids)) for o in runs[0].outs), "{:d}")
    figure("misplaced logprobs (live lengths)", sum(misplaced), "{:d}",
           "the next schedule already advanced each request: every logprob lands one token late")


def main() -> None:
    args = parse_args(__doc__, delay_ms=10.0)
    header(11, "constrained decoding: delayed sampling, its cost, and logprobs",
           [DelayedSampling.launch, launch_sample, build_mask, plan_logprobs,
            "lessons/readings §16, §17 (000 「Overlap Scheduler 的执行时间线」)"])
    pairs = demo_pairs(6 if args.quick else 12)
    prompts = [p for p, _ in pairs]
    outputs_and_symptom(prompts, args.delay_ms)
    cost(prompts, args.delay_ms, host_ms=args.delay_ms / 2)
    logprobs(prompts, args.delay_ms)
    notice("with a grammar the overlap loop keeps the forward in parallel but samples only after the commit: "
           "masks from the state one token behind break the grammar, and logprobs need the lengths of the launch.")


if __name__ == "__main__":
    lesson_main(main)
