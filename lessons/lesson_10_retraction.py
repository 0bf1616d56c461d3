"""Lesson 10: optimistic admission and retraction, and the in-flight result of a retracted request.

Reserve admission promises every request prompt + max_new_tokens + 1 KV slots. With a long
max_new_tokens and answers that stop early, the pool is mostly promised and empty. Optimistic
admission charges running requests only a share of what they may still take (the new-token ratio),
runs more requests at once, and retracts some when a decode step runs short of slots.
"""

from common import figure, header, lesson_main, notice, parse_args, run, section, side_by_side, console

from minisgl.features.retraction import NewTokenRatio, OptimisticAdmission
from minisgl.demo.workloads import early_stop_workload
from minisgl.request import Req
from minisgl.scheduler import Scheduler
from minisgl.tracer import SpanName

KV_TOKENS = 200  # a request may need ~80 slots: reserve runs two at once


def concurrency(r) -> float:
    return r.stats.decode_rows / max(1, r.stats.decode_batches)


def event_timeline(r, width: int = 72) -> str:
    """The scheduler's events in order: L launch, C commit, R retraction (one per retracted request)."""
    glyph = {SpanName.LAUNCH: "L", SpanName.COMMIT: "C", SpanName.RETRACT: "R"}
    line = "".join(glyph[kind] for kind, _ in r.stats.events)
    first = line.find("R")
    start = max(0, first - width // 2) if first >= 0 else 0
    return line[start:start + width]


def main() -> None:
    args = parse_args(__doc__, delay_ms=2.0)
    header(10, "optimistic admission and retraction",
           [Scheduler._admit, OptimisticAdmission.retract_for_decode, Scheduler._retract, Scheduler._commit_results,
            Req.reset_for_retract, NewTokenRatio.after_retract, "lessons/readings §15"])
    prompts, params = early_stop_workload(12 if args.quick else 24)
    section(f"1. {len(prompts)} requests, max_new_tokens 64, half stop on EOS after a few tokens; kv_tokens={KV_TOKENS}")
    runs = [run("normal, reserve", prompts, params, loop="normal", delay_ms=args.delay_ms, kv_tokens=KV_TOKENS),
            run("overlap, reserve", prompts, params, delay_ms=args.delay_ms, kv_tokens=KV_TOKENS),
            run("overlap, optimistic", prompts, params, delay_ms=args.delay_ms, kv_tokens=KV_TOKENS,
                admission="optimistic"),
            run("normal, optimistic", prompts, params, loop="normal", delay_ms=args.delay_ms, kv_tokens=KV_TOKENS,
                admission="optimistic")]
    reference = runs[0].tokens
    side_by_side("reserve against optimistic admission", runs, {
        "requests decoding at once (mean)": lambda r: f"{concurrency(r):.2f}",
        "decode batches": lambda r: str(r.stats.decode_batches),
        "throughput (tokens/s)": lambda r: f"{r.tok_per_s:.0f}",
        "retractions": lambda r: str(r.stats.retractions),
        "in-flight results of retracted requests skipped": lambda r: str(r.stats.retracted_late_results),
        "prompt tokens from the radix cache": lambda r: str(r.stats.cached_tokens),
        "outputs identical to normal, reserve": lambda r: str(r.tokens == reference),
    })
    _, reserve, optimistic, _ = runs
    figure("requests at once, reserve", concurrency(reserve), "{:.2f}")
    figure("requests at once, optimistic", concurrency(optimistic), "{:.2f}")
    figure("throughput gain, optimistic / reserve (overlap)", optimistic.tok_per_s / reserve.tok_per_s, "{:.2f}",
           "noisy on a shared machine: the batch count is the steady figure")
    section("2. where the retractions land in the overlap loop (L launch, C commit, R a request retracted)")
    console.print("  " + event_timeline(optimistic))
    console.print("  R comes between an L and the C of the batch before it: that batch is still in flight and "
                  "holds a row of the retracted request. Its result for that row is skipped at the C.")
    section("3. retract_skip_inflight off: the late token is appended to the retracted request")
    off = run("skip off", prompts, params, delay_ms=args.delay_ms, kv_tokens=KV_TOKENS, admission="optimistic",
              disable=("retract_skip_inflight",))
    wrong = sum(a != b for a, b in zip(off.tokens, reference))
    figure("outputs that differ from reserve (skip off)", wrong, "{:d}",
           "the late token, then the re-prefill samples the same step again: a repeated token", needs=(3, "snapshot"))
    notice("optimistic admission keeps more requests decoding per step, so the same tokens take fewer steps; "
           "the price is retraction, and in the overlap loop the in-flight result of a retracted request must be "
           "skipped. Resumed requests re-prefill through the radix cache and produce exactly the same tokens.")


if __name__ == "__main__":
    lesson_main(main)
