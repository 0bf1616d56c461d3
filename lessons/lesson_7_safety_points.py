"""Lesson 7: safety points: nothing is reused while an in-flight batch may still touch it.

Three resources outlive the host's decision to let them go: KV slots handed to the radix
cache (commit_point_cache), request-pool rows (deferred_row_free) and the host staging
buffers of batch metadata (staging_double_buffer, staging_war_wait: the article's two
protections; either one alone is enough here, both off gives wrong tokens).
"""

from common import (BAD, OK, console, demo_pairs, differing, figure, header, lesson_main, make_llm, notice, parse_args,
                    per_run, run, section)

from minisgl import SamplingParams
from minisgl.rows import RowTracker
from minisgl.scheduler import Scheduler
from minisgl.staging import StagingRing


def commit_point_and_staging(pairs, delay_ms: float) -> None:
    section("1. commit_point_cache and the staging protections: same workload, compare with the normal loop")
    prompts = [p for p, _ in pairs]
    # Requests end by length at different steps while the others keep decoding in the same batch.
    params = [SamplingParams(max_new_tokens=2 + i % 5) for i in range(len(prompts))]
    ref = run("normal loop", prompts, params, loop="normal")
    runs = [run("overlap, all on", prompts, params, delay_ms=delay_ms),
            run("commit_point_cache off", prompts, params, disable=("commit_point_cache",), delay_ms=delay_ms),
            run("one staging buffer, wait on", prompts, params, disable=("staging_double_buffer",),
                delay_ms=delay_ms),
            run("two buffers, no wait", prompts, params, disable=("staging_war_wait",), delay_ms=delay_ms),
            run("staging both off", prompts, params, disable=("staging_double_buffer", "staging_war_wait"),
                delay_ms=delay_ms)]
    per_run(f"{len(prompts)} requests, max_new_tokens 2..6; wrong = outputs that differ from the normal loop's",
            runs, {
                "wrong": lambda r: f"{differing(r.tokens, ref.tokens)}/{len(prompts)}",
                "staging waits": lambda r: str(r.llm.scheduler.batch_builder.staging.waits),
                "unread rewrites": lambda r: str(r.llm.scheduler.batch_builder.staging.unread_overwrites),
                "first text": lambda r: repr(r.outs[0].text),
            })
    console.print("  staging waits: the host waited for the device to read a buffer; unread rewrites: it "
                  "rewrote one the device had not read yet")
    for r in runs:
        figure(f"wrong outputs ({r.label})", differing(r.tokens, ref.tokens), "{:d}")
        figure(f"unread overwrites ({r.label})", r.llm.scheduler.batch_builder.staging.unread_overwrites, "{:d}")


def row_reuse(delay_ms: float) -> None:
    section("2. deferred_row_free: one request-pool row, reused while the old owner's overshoot is in flight")
    # D's prompt is cached first (E), so D is admitted with a long prefix already in its row.
    # A is short and stops on EOS; its overshoot step writes its next slot into row[pos], a
    # position inside D's cached prefix if the row has already changed hands.
    d_prompt, a_prompt = "reverse cat dog owl fox bee cow:", "reverse sun moon:"
    console.print(f"  A = {a_prompt!r}, D = {d_prompt!r} (D's right answer: ' cow bee fox owl dog cat')")
    # What the stale-result count means in each run: the check can only count a row reuse that happened.
    cases = (("deferred_row_free on", (), "no row was reused early: nothing to detect"),
             ("deferred_row_free off", ("deferred_row_free",), "the ABA, detected by the row's generation"),
             ("row_generation_check off too", ("deferred_row_free", "row_generation_check"),
              "the ABA happened, but nobody checks: not counted"))
    for label, disable, meaning in cases:
        llm = make_llm("overlap", disable, delay_ms, max_running_requests=1)
        llm.generate([d_prompt], SamplingParams(max_new_tokens=2))  # E: puts D's prefix in the radix cache
        a, d = llm.generate([a_prompt, d_prompt], SamplingParams(max_new_tokens=40))
        good = d.text == " cow bee fox owl dog cat"
        console.print(f"  {label}: A → {a.text!r} ({a.finish_reason}); D → {d.text!r} {OK if good else BAD}")
        figure(f"stale row results ({label})", llm.stats.stale_row_results, "{:d}", meaning)
        # D's prompt must come from the radix cache for the late write to land in it (exercise 5's checkpoint)
        figure(f"wrong D ({label})", int(not good), "{:d}",
               needs=(5, "checkpoint") if disable == ("deferred_row_free",) else None)
        llm.close()


def main() -> None:
    args = parse_args(__doc__, delay_ms=2.0)
    header(7, "safety points: release only after the last device use",
           [Scheduler._release, RowTracker.free, RowTracker.free_deferred, Scheduler._commit_results,
            StagingRing.acquire,
            "lessons/readings §9, §7, §4 (000 「缓存 checkpoint 与资源回收的安全点」, 「延迟提交：何时才能修改请求真值」)"])
    commit_point_and_staging(demo_pairs(8 if args.quick else 16), args.delay_ms)
    row_reuse(30.0)  # a wide race window: the host re-admits long before the device reaches the overshoot
    notice("a row may be reused only after the last batch that uses it has passed copy_done, a staging buffer "
           "only after the device has copied it, and a finished prefix is cached only at the commit point; one step "
           "too early and another request's tokens change.")


if __name__ == "__main__":
    lesson_main(main)
