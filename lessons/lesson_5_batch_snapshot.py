"""Lesson 5: batch snapshots: the result queue must remember who was in batch n.

Requests stop (EOS) at different steps, so schedule() filters the live running batch while
a batch is still in flight. With batch_snapshot off the result queue holds the live batch,
and batch n's tokens are zipped with batch n+1's requests.
"""

from common import BAD, OK, console, demo_pairs, figure, header, lesson_main, make_llm, notice, parse_args, run, section

from minisgl import SamplingParams
from minisgl.batch import BatchView, RunningBatch
from minisgl.scheduler import Scheduler


def spy_on_batches(sched) -> dict[int, tuple[list[int], list[int]]]:
    """batch id -> (request ids when launched, request ids its results were committed onto)."""
    seen: dict[int, tuple[list[int], list[int]]] = {}
    launch, commit = sched.launch, sched._commit_results

    def spy_launch(planned):
        seen[planned.forward.batch_id] = ([r.rid for r in planned.view.reqs], [])
        return launch(planned)

    def spy_commit(view, result):
        seen[result.batch_id][1].extend(r.rid for r in view.reqs)
        return commit(view, result)

    sched.launch, sched._commit_results = spy_launch, spy_commit
    return seen


def bounded_run(prompts, params, disable, delay_ms: float, max_steps: int):
    """Step by hand, at most max_steps: misrouted results can keep a request from ever finishing."""
    llm = make_llm("overlap", disable, delay_ms)
    seen = spy_on_batches(llm.scheduler)
    reqs = []
    for prompt in prompts:
        llm.add_request(prompt, params)
        reqs.append(llm.scheduler.waiting[-1])
    for _ in range(max_steps):
        llm.step()
        if all(r.finished for r in reqs):
            break
    return llm, reqs, seen


def main() -> None:
    args = parse_args(__doc__, delay_ms=2.0)
    header(5, "batch snapshots: results must land on the requests that were in the batch",
           [RunningBatch, RunningBatch.snapshot, BatchView, Scheduler.overlap_loop, Scheduler._commit_results,
            "lessons/readings §5 (000 「在途批次：last_batch 与 result_queue」: why batch.copy())"])
    pairs = demo_pairs(6 if args.quick else 12)
    prompts, params = [p for p, _ in pairs], SamplingParams(max_new_tokens=30)
    reference = run("normal loop", prompts, params, loop="normal").tokens

    results = {}
    for label, disable in (("batch_snapshot on", ()), ("batch_snapshot off", ("batch_snapshot",))):
        section(f"overlap loop, {label}")
        llm, reqs, seen = bounded_run(prompts, params, disable, args.delay_ms, max_steps=80)
        misrouted = {bid: (a, b) for bid, (a, b) in seen.items() if b and a != b}
        if misrouted:
            bid, (launched, committed) = next(iter(misrouted.items()))
            console.print(f"  first misrouted batch b{bid}: launched for requests {launched}")
            console.print(f"  {'':22} committed onto requests {committed}  (the live batch, already filtered)")
        wrong = 0
        for (prompt, expected), req, ref in zip(pairs, reqs, reference):
            ok = req.output_ids == ref
            wrong += not ok
            if not ok or len(reqs) <= 6:
                text = llm.tokenizer.decode(req.output_ids, skip_special_tokens=True)
                console.print(f"  {OK if ok else BAD} {prompt:30} expected {expected!r:32} got {text!r}"
                              + ("" if req.finished else "  (still unfinished after the step bound)"))
        figure(f"misrouted batches ({label})", len(misrouted), "{:d}")
        figure(f"wrong outputs ({label})", wrong, "{:d}", f"of {len(reqs)}, against the normal loop")
        results[label] = wrong
        llm.close()
    notice("with batch_snapshot off, once a request has left the running batch, every in-flight result is "
           "zipped with the wrong list: tokens land on the neighbour and answers fall apart.")


if __name__ == "__main__":
    lesson_main(main)
