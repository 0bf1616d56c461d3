"""Lesson 2: streams and events, or what "launch returned" means.

A stream is an ordered queue of device work the host does not wait for; an event marks a
point in it. On CPU the stream is a worker thread (minisgl/streams.py, CpuStream). We time
launch() against the wait for copy_done, bare and then inside the real engine.
"""

import sys
import time

from common import console, figure, header, lesson_main, make_llm, notice, parse_args, section

from minisgl import SamplingParams
from minisgl.engine import Engine
from minisgl.batch import InFlight
from minisgl.scheduler import Scheduler
from minisgl.streams import CpuStream


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def bare_stream(kernel_ms: float) -> None:
    section(f"1. a bare stream: launch a {kernel_ms:g} ms 'kernel', then wait for an event behind it")
    stream, log = CpuStream("lesson"), []
    t0 = time.perf_counter()
    stream.launch(lambda: (time.sleep(kernel_ms / 1e3), log.append(f"device: kernel done at {ms_since(t0):.1f} ms")))
    done = stream.record_event()  # completes when the worker thread reaches it: after the kernel
    launched = ms_since(t0)
    log.append(f"host:   launch() returned at {launched:.3f} ms, event.query() = {done.query()}")
    done.synchronize()
    log.append(f"host:   event.synchronize() returned at {ms_since(t0):.1f} ms, event.query() = {done.query()}")
    for line in log:
        console.print("  " + line)
    figure("bare launch returned ms", launched, note="queued, not run")

    # Order between streams is an event, not a sleep: B waits for A's event, the host waits for nobody.
    a, b, order = stream, CpuStream("other"), []
    a.launch(lambda: (time.sleep(0.02), order.append("A: 20 ms kernel")))
    b.wait_event(a.record_event())
    b.launch(lambda: order.append("B: kernel queued behind A's event"))
    order.append("host: already past both launches")
    b.synchronize()
    console.print("  order of completion: " + "  →  ".join(order))
    a.close(), b.close()


def engine_batches(delay_ms: float, steps: int) -> tuple[float, float]:
    """Returns the median launch() time and the median time to copy_done, in ms."""
    section(f"2. the real engine (device delay {delay_ms:g} ms): launch() vs copy_done, batch by batch")
    llm = make_llm(loop="normal", delay_ms=delay_ms)
    sched = llm.scheduler
    llm.add_request("count 3 to 9:", SamplingParams(max_new_tokens=steps))
    rows = []
    # This is normal_loop() taken apart, with a stopwatch between the pieces.
    while (planned := sched.schedule()) is not None:
        t0 = time.perf_counter()
        result = sched.launch(planned)
        t_launch = ms_since(t0)
        # Poison the host buffer the device will fill (as SGLang's CI poisons device
        # buffers): reading it before copy_done shows the poison, not a token.
        result.next_tokens_host.fill_(-1)
        early = result.next_tokens_host.tolist()
        ready_early = result.copy_done.query()
        sched.commit(InFlight(planned.view, result))  # waits for copy_done, then commits
        after = result.next_tokens_host.tolist()
        rows.append((planned.forward.batch_id, "prefill" if planned.forward.is_prefill else "decode", t_launch,
                     ms_since(t0), ready_early, early, f"{after} {llm.tokenizer.decode(after)!r}"))
        sched.finished.clear()
    console.print("  batch  kind     launch() returned  copy_done passed  query() after launch  "
                  "next_tokens_host")
    for bid, kind, tl, td, q, before, after in rows:
        console.print(f"  b{bid:<5} {kind:8} {tl:11.3f} ms {td:14.2f} ms {str(q):>21}  {before} → {after}")
    launch = sorted(r[2] for r in rows)[len(rows) // 2]
    done = sorted(r[3] for r in rows)[len(rows) // 2]
    figure("launch returned ms", launch, "{:.3f}", "median over batches")
    figure("copy_done ms", done, "{:.2f}", "median: device delay + forward + copy")
    figure("copy_done / launch", done / launch, "{:.0f}", "how many launches fit in one batch's time")
    figure("batches not done when launch() returned", sum(not r[4] for r in rows), "{:d}",
           f"of {len(rows)}: query() was False right after launch")
    console.print(f"  the stream thread runs with inference_mode and one torch thread; "
                  f"sys.getswitchinterval() = {sys.getswitchinterval():g} s (CPython's default is 0.005)")
    llm.close()
    return launch, done


def main() -> None:
    args = parse_args(__doc__, delay_ms=20.0)
    header(2, "streams and events: what \"launch returned\" means",
           [CpuStream, CpuStream.launch, CpuStream.record_event, Engine.launch, Scheduler.commit,
            "lessons/readings §3, §12 (000 「Overlap Scheduler 的执行时间线」; 001 「同步点分析」)"])
    bare_stream(50.0)
    launch, done = engine_batches(args.delay_ms, 3 if args.quick else 6)
    notice(f"launch() returns long before the batch has run (median {launch:.2f} ms against {done:.0f} ms): only "
           "waiting for copy_done makes next_tokens_host safe to read (before it you read the poison -1).")


if __name__ == "__main__":
    lesson_main(main)
