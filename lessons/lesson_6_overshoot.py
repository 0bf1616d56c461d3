"""Lesson 6: overshoot: the step the overlap loop runs past a request's end.

When batch n samples EOS, batch n+1 is already planned (even launched) for that request.
Three mechanisms make that extra step harmless: skip_finished (drop the late result),
length_lookahead (don't plan a step known to be past max_new_tokens) and release_allocated
(free KV by allocated length, which covers the overshoot slot). We switch each one off.
"""

from common import (console, demo_pairs, figure, header, lesson_main, make_llm, notice, parse_args, run, section,
                    side_by_side)

from minisgl import SamplingParams
from minisgl.kv_pool import KVAccountingError
from minisgl.request import Req
from minisgl.scheduler import Scheduler


def leaked(r) -> int:
    """KV slots neither free nor held by the radix cache after everything finished."""
    mem = r.llm.memory_report()
    return mem["kv_total"] - mem["kv_free"] - mem["kv_cached"]


def lookahead_and_release(pairs, delay_ms: float) -> None:
    section("1. length_lookahead and release_allocated: count the wasted steps and the lost KV slots")
    prompts = [p for p, _ in pairs]
    # Half the requests are cut by length (predictable), the others stop on EOS (not predictable).
    params = [SamplingParams(max_new_tokens=3 if i % 2 else 40) for i in range(len(prompts))]
    runs = [run("all on", prompts, params, delay_ms=delay_ms),
            run("length_lookahead off", prompts, params, disable=("length_lookahead",), delay_ms=delay_ms),
            run("release_allocated off", prompts, params, disable=("release_allocated",), delay_ms=delay_ms)]
    side_by_side(f"{len(prompts)} requests: {len(prompts) // 2} cut at 3 tokens, the rest stop on EOS", runs, {
        "finished by length / by stop": lambda r: "{} / {}".format(
            sum(o.finish_reason == "length" for o in r.outs), sum(o.finish_reason == "stop" for o in r.outs)),
        "stopped on EOS at their last allowed token": lambda r: str(sum(
            o.finish_reason == "stop" and len(o.token_ids) == p.max_new_tokens for o, p in zip(r.outs, params))),
        "overshoot steps (planned past max_new_tokens)": lambda r: str(r.stats.overshoot_steps),
        "late results dropped (overshoot tokens)": lambda r: str(r.stats.overshoot_tokens),
        "decode batches": lambda r: str(r.stats.decode_batches),
        "KV slots leaked after drain": lambda r: str(leaked(r)),
        "outputs identical to 'all on'": lambda r: str(r.tokens == runs[0].tokens),
    })
    on, no_lookahead, no_release = runs
    figure("overshoot steps (length_lookahead on)", on.stats.overshoot_steps, "{:d}")
    figure("overshoot steps (length_lookahead off)", no_lookahead.stats.overshoot_steps, "{:d}",
           needs=(4, "length lookahead"))
    figure("overshoot tokens (all on)", on.stats.overshoot_tokens, "{:d}",
           "EOS cannot be foreseen: one late result per request that stopped while its next step was in flight "
           "(not those that hit EOS at their cap: the lookahead had left them out already)")
    figure("leaked KV slots (release_allocated on)", leaked(on), "{:d}")
    figure("leaked KV slots (release_allocated off)", leaked(no_release), "{:d}",
           "one per overshoot token: the slot the extra step wrote", needs=(4, "release by allocated length"))


def token_after_stop(prompt: str, delay_ms: float) -> None:
    section("2. skip_finished off: the late result is committed after EOS")
    for label, disable in (("skip_finished on", ()), ("skip_finished off", ("skip_finished",))):
        llm = make_llm("overlap", disable, delay_ms)
        eos = sorted(llm.eos_ids)
        llm.add_request(prompt, SamplingParams(max_new_tokens=40))
        req = llm.scheduler.waiting[-1]
        error = ""
        try:
            while llm.has_unfinished():
                llm.step()
        except KVAccountingError as exc:
            error = f"   KVAccountingError: {exc}"
        ids = req.output_ids
        stop_at = next(i for i, t in enumerate(ids) if t in eos)
        after = len(ids) - stop_at - 1
        console.print(f"  {label:18} output ids {ids}  (EOS = {eos})")
        console.print(f"  {'':18} text {llm.tokenizer.decode(ids)!r}{error}")
        figure(f"tokens after stop ({label})", after, "{:d}")
        llm.scheduler.last = None  # after a double free the engine state is broken: do not drain it
        llm.engine.stream.close()


def main() -> None:
    args = parse_args(__doc__, delay_ms=2.0)
    header(6, "overshoot: skip it, avoid it when you can, and free what it used",
           [Scheduler._commit_results, Scheduler._schedule_decode, Req.will_finish_by_length, Scheduler._release,
            "lessons/readings §8 (000 「Overshoot：多跑一步为什么不能直接忽略」)"])
    pairs = demo_pairs(8 if args.quick else 16)
    lookahead_and_release(pairs, args.delay_ms)
    token_after_stop(pairs[0][0], args.delay_ms)
    notice("the overlap loop always plans one step past EOS; it is harmless only because that late result is "
           "dropped and its KV slot freed by allocated length. Length-bound ends are foreseen: no step is wasted.")


if __name__ == "__main__":
    lesson_main(main)
