"""Lesson 0: a primer: KV pool and request table, radix cache, continuous batching, chunked prefill.

What lessons 1-9 take for granted, shown on the demo model with the serial (normal) loop and
counted, not timed: every figure here is the same on any machine.
"""

from common import console, figure, header, lesson_main, make_llm, notice, parse_args, section

from minisgl import SamplingParams
from minisgl.checks import MAX_RUNNING_REQUESTS
from minisgl.frontend.options import count
from minisgl.kv_pool import KVPool, ReqToTokenPool
from minisgl.radix_cache import RadixCache
from minisgl.scheduler import Scheduler


def kv_pool_and_request_table() -> None:
    section("1. the KV pool (a slot per token), the request table (a row per request)")
    llm = make_llm("normal", warm=False, max_running_requests=4, kv_tokens=64)
    sched = llm.scheduler
    rid = llm.add_request("count 3 to 9:", SamplingParams(max_new_tokens=4, ignore_eos=True))
    req = sched.waiting[0]
    free = sched.kv_pool.free_count
    console.print(f"  request {rid}: {req.prompt_len} prompt tokens, max_new_tokens 4; "
                  f"KV pool {free} free slots of {sched.kv_pool.kv_tokens}, {sched.req_to_token.free_count} free rows")
    taken = []
    while not llm.collect() and sched.has_work():
        llm.step()
        taken.append(free - sched.kv_pool.free_count)
        free = sched.kv_pool.free_count
        if not req.finished:
            row = sched.req_to_token.table[req.row, :req.launched_len].tolist()
            console.print(f"  after batch {len(taken) - 1}: request table row {req.row} = {row}")
            assert row == req.slot_ids, "the table row is where the device finds the request's slots"
    figure("slots taken by the prefill", taken[0], "{:d}", "one per prompt token")
    figure("slots taken per decode step", max(taken[1:]), "{:d}", "one per new token")
    report = llm.memory_report()
    console.print(f"  finished: " + ", ".join(f"{k} {v}" for k, v in report.items()))
    figure("slots the radix cache holds now", report["kv_cached"], "{:d}",
           f"{req.prompt_len} prompt + 4 outputs - 1: the last output's KV is never computed", needs=(5, "checkpoint"))
    figure("pool whole (kv_free + kv_cached == kv_total)",
           int(report["kv_free"] + report["kv_cached"] == report["kv_total"]), "{:d}")
    llm.close()


def radix_cache() -> None:
    section("2. the radix cache: a new prompt reuses the KV of an earlier prefix")
    llm = make_llm("normal", warm=False)
    first, second = "count 3 to 9:", "count 3 to 12:"
    a, b = llm.tokenizer.encode(first), llm.tokenizer.encode(second)
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    llm.generate([first], SamplingParams(max_new_tokens=32))
    before = llm.stats.cached_tokens
    out = llm.generate([second], SamplingParams(max_new_tokens=32))[0]
    console.print(f"  {first!r} = {a}\n  {second!r} = {b}\n  {second!r} → {out.text!r}")
    figure("tokens the two prompts share", shared, "{:d}")
    figure("prompt tokens served from the cache", llm.stats.cached_tokens - before, "{:d}",
           "their KV is not computed again", needs=(5, "checkpoint"))
    before = llm.stats.cached_tokens
    llm.generate([second], SamplingParams(max_new_tokens=32))
    figure("the same prompt again: tokens served from the cache", llm.stats.cached_tokens - before, "{:d}",
           f"all but the last of its {len(b)}: one token must run to give the next token's logits",
           needs=(5, "checkpoint"))
    llm.close()


def continuous_batching(n: int, rows: int) -> None:
    section(f"3. continuous batching: {n} requests, at most {rows} running (max_running_requests)")
    llm = make_llm("normal", warm=False, max_running_requests=rows)
    sched = llm.scheduler
    lengths = [3 + (i * 5) % 9 for i in range(n)]  # different lengths: requests leave at different steps
    for i, length in enumerate(lengths):
        llm.add_request(f"count {i + 1} to {i + 40}:", SamplingParams(max_new_tokens=length, ignore_eos=True))
    console.print(f"  max_new_tokens per request: {lengths}; a freed row is refilled at the next step")
    while sched.has_work():
        launched = sched.stats.batches
        llm.step()
        if sched.stats.batches > launched:
            running = " ".join(str(r.rid) for r in sched.running.reqs if not r.finished)
            console.print(f"  after batch {launched:>2}: running [{running}]  waiting {len(sched.waiting)}")
    batches = sched.stats.batches
    # A static batcher takes `rows` requests, runs until the longest of them is done, then the next `rows`.
    static = sum(1 + max(lengths[i:i + rows]) - 1 for i in range(0, n, rows))  # one prefill + (length - 1) decodes
    figure("batches (continuous batching)", batches, "{:d}")
    figure("batches a static batcher would run", static, "{:d}",
           f"groups of {rows}, each until its longest request is done")
    llm.close()


def chunked_prefill() -> None:
    section("4. chunked prefill: at most chunk_size prompt tokens per batch")
    prompt = "reverse cat dog owl fox bee cow:"
    outputs = {}
    for chunk in (512, 3):
        llm = make_llm("normal", warm=False, chunk_size=chunk)
        sched = llm.scheduler
        llm.add_request(prompt, SamplingParams(max_new_tokens=8))
        req = sched.waiting[0]
        progress, done = [], []
        while not req.prefill_launched:
            done += llm.step()
            progress.append(req.launched_len)
        while sched.has_work():
            done += llm.step()
        outputs[chunk] = done[0].token_ids
        console.print(f"  chunk_size {chunk:>3}: prompt positions launched after each prefill batch: {progress} "
                      f"(of {req.prompt_len})")
        figure(f"prefill batches (chunk_size {chunk})", sched.stats.prefill_batches, "{:d}")
        llm.close()
    figure("outputs identical", int(outputs[512] == outputs[3]), "{:d}", "chunking changes when, never what")


def main() -> None:
    args = parse_args(__doc__, delay_ms=0.0, extra=lambda ap: ap.add_argument(
        "--max-running-requests", type=count(MAX_RUNNING_REQUESTS), default=4, metavar="N",
        help="section 3's request rows: the most requests running at once (default 4)"))
    header(0, "a primer: KV pool, request table, radix cache, continuous batching, chunked prefill",
           [KVPool, ReqToTokenPool, RadixCache.match_prefix, Scheduler._admit, Scheduler._schedule_prefill,
            "lessons/lesson_0_primer.md"])
    kv_pool_and_request_table()
    radix_cache()
    continuous_batching(6 if args.quick else 10, args.max_running_requests)
    chunked_prefill()
    notice("a request owns a row and one KV slot per token; finished prefixes stay in the radix cache for the "
           "next prompt that starts the same way; a freed row is refilled at the next step; a long prompt is "
           "split into chunks. Lessons 1-9 take all four for granted.")


if __name__ == "__main__":
    lesson_main(main)
