"""Lesson 13: the server's process layout: what tokenizing outside the loop buys the overlap.

The same text requests through the real scheduler loop, served two ways: by one loop that also
tokenizes every prompt and detokenizes every new token on the scheduler's thread (a server in one
process), and as minisgl's server splits the work (ids in, ids out; the HTTP process makes the
text). C per iteration, G and throughput for both loops, at the emulated device time and with the
loop's other host work raised toward G.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common import (Run, console, demo_pairs, figure, header, lesson_main, make_llm, median, median_run, ms, notice,
                    parse_args, per_run, rounds, section)

from minisgl import SamplingParams
from minisgl.observe.lab import host_delay_for
from minisgl.server.detokenizer import WINDOW, IncrementalDetokenizer
from minisgl.server.scheduler_process import SchedulerLoop
from minisgl.tracer import SpanName

WAVE, EVERY = 16, 8  # requests arrive 16 at a time, every 8 loop iterations
LOOPS = ("normal", "overlap")
WHERE = {True: "in the loop", False: "outside"}


class LoopThreadCalls:
    """The engine's tokenizer, counting its encode and decode calls by thread: on the loop's, or elsewhere."""

    def __init__(self, tokenizer, loop_thread: int) -> None:
        self.tokenizer = tokenizer
        self.loop_thread = loop_thread
        self.on_loop: Counter = Counter()
        self.elsewhere: Counter = Counter()

    def _count(self, call: str) -> None:
        (self.on_loop if threading.get_ident() == self.loop_thread else self.elsewhere)[call] += 1

    def encode(self, *args, **kwargs):
        self._count("encode")
        return self.tokenizer.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self._count("decode")
        return self.tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name: str):  # everything else (eos_token_id, ...) from the tokenizer, uncounted
        return getattr(self.tokenizer, name)


def in_another_thread(fn, items: list) -> list:
    """Stands in for the HTTP process: `fn` over `items`, on a thread that is not the loop's."""
    with ThreadPoolExecutor(1) as pool:
        return list(pool.map(fn, items))


class TextStreams:
    """Tokens to text as they come, in the loop (the DetokenizerManager's work, done by the scheduler's thread)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.text: dict[int, str] = {}

    def __call__(self, rid: int, ids: list[int], final: bool) -> None:
        detokenizer = self.detokenizers.setdefault(rid, IncrementalDetokenizer(self.tokenizer))
        piece = detokenizer.add(ids) + (detokenizer.flush() if final else "")
        self.text[rid] = self.text.get(rid, "") + piece


class IdStreams:
    """Tokens handed on as ids (to the HTTP process, which makes the text)."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}

    def __call__(self, rid: int, ids: list[int], final: bool) -> None:
        self.ids.setdefault(rid, []).extend(ids)


def serving_loop(llm, prompts: list, params: SamplingParams, stream) -> tuple[list, float]:
    """A server's loop on one thread, the shape of SchedulerLoop.run: WAVE prompts arrive every EVERY
    iterations; each iteration takes them in, runs one scheduler step and hands every request's new
    tokens to `stream(rid, ids, final)`. The loop's own work between two steps is traced as io spans,
    so C counts it. Returns the finished requests in arrival order, and the wall time."""
    tracer = llm.engine.tracer
    sent: dict[int, int] = {}  # request id -> tokens handed to `stream`
    done: dict[int, object] = {}
    arrived = iteration = 0
    start = time.perf_counter()
    while arrived < len(prompts) or llm.has_unfinished():
        with tracer.host(SpanName.IO):  # requests in: text is tokenized here, in add_request
            if iteration % EVERY == 0:
                for prompt in prompts[arrived:arrived + WAVE]:
                    sent[llm.add_request(prompt, params)] = 0
                arrived = min(len(prompts), arrived + WAVE)
        iteration += 1
        finished = llm.step()
        with tracer.host(SpanName.IO):  # outputs out
            for rid, (ids, _) in llm.new_output(sent).items():
                sent[rid] += len(ids)
                stream(rid, ids, final=False)
            for out in finished:
                stream(out.rid, out.token_ids[sent.pop(out.rid):], final=True)
                done[out.rid] = out
    return [done[rid] for rid in sorted(done)], time.perf_counter() - start


@dataclass
class Served(Run):
    texts: list[str] = field(default_factory=list)  # each request's text, as its client got it
    tokenizer: LoopThreadCalls | None = None


def serve(label: str, texts: list[str], params: SamplingParams, in_loop: bool, loop: str, delay_ms: float,
          host_delay_ms: float = 0.0) -> Served:
    """One run of `serving_loop` on a fresh engine. `in_loop`: the prompts arrive as text and every new token
    becomes text on the loop's thread; else the prompts arrive as ids and the ids go out, tokenized and
    detokenized on another thread (the HTTP process's work)."""
    llm = make_llm(loop, delay_ms=delay_ms, host_delay_ms=host_delay_ms, kv_tokens=16384)
    tokenizer = LoopThreadCalls(llm.tokenizer, threading.get_ident())
    llm.tokenizer = tokenizer  # the LLM tokenizes prompts and makes each RequestOutput's text with it
    prompts = texts if in_loop else in_another_thread(tokenizer.encode, texts)
    stream = TextStreams(tokenizer) if in_loop else IdStreams()
    cpu_start = time.thread_time()
    outs, wall = serving_loop(llm, prompts, params, stream)
    cpu = time.thread_time() - cpu_start
    rids = [out.rid for out in outs]
    if in_loop:
        streamed = [stream.text[rid] for rid in rids]
    else:
        streamed = in_another_thread(lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                     [stream.ids[rid] for rid in rids])
    return Served(label, llm, outs, wall, cpu, streamed, tokenizer)


def configs(delay_ms: float, host_delay_ms: float = 0.0) -> dict:
    """A section's four runs: both loops, tokenizing in the loop and outside, for `rounds`."""
    return {(loop, in_loop): (f"{loop}, tokenizing {WHERE[in_loop]}",
                              dict(in_loop=in_loop, loop=loop, delay_ms=delay_ms, host_delay_ms=host_delay_ms))
            for loop in LOOPS for in_loop in (True, False)}


def g_of(r: Run) -> float:
    return r.metrics["device_time_per_forward_s"]


def c_of(r: Run) -> float:
    return r.metrics["host_time_per_iteration_s"]


def show(title: str, runs: dict) -> None:
    per_run(title, list(runs.values()), {
        "tok/s": lambda r: f"{r.tok_per_s:.0f}",
        "G": lambda r: ms(g_of(r)),
        "C": lambda r: ms(c_of(r)),
        "idle/fwd": lambda r: ms(r.metrics["exposed_host_time_per_step_s"]),
    })
    console.print("  G: device time per forward. C: host work per iteration, the io spans included. idle/fwd: "
                  "device idle per forward, the bubble (lesson 8's \"device idle per forward\").", style="dim")


STEP = {"normal": lambda g, c: g + c, "overlap": max}  # a step's time: serial, or overlapped


def predicted_why(loop: str, g: float, c_in: float) -> str:
    if loop == "normal":
        return "its step is G + C: it pays all of the tokenizer's C"
    if c_in < g:
        return "its step is max(G, C), and C in the loop stays under G: the tokenizer's C is hidden"
    return "its step is max(G, C), and C in the loop is above G: the part above G is paid on every step"


def measured_says(ratios: list[float]) -> str:
    """What the rounds' ratios show of the tokenizer's cost, and no more."""
    low, high = min(ratios), max(ratios)
    if len(ratios) == 1:
        return "one round (--quick): no range, so no verdict"
    if low <= 1 <= high:
        return f"inside the noise: the rounds' ratios ({low:.2f}-{high:.2f}) straddle 1"
    if high < 1:
        return f"slower with the tokenizing in the loop, in every round ({low:.2f}-{high:.2f})"
    return (f"faster with the tokenizing in the loop, in every round ({low:.2f}-{high:.2f}): not what its larger C "
            "predicts; compare the two rows' G")


def compare(all_runs: dict, where: str) -> None:
    """Per loop, throughput with tokenizing in the loop over outside. Measured: the median of the
    rounds' paired ratios (round i in the loop over round i outside, run side by side under the
    same load); the table's two median runs can come from different rounds, so their ratio can
    differ, even in direction. Predicted from the same loop's rows of the table: C in the loop
    and outside, and one G for both (the outside row's), so that the prediction is what the
    tokenizer's C alone costs."""
    for loop in LOOPS:
        inside, outside = median_run(all_runs[loop, True]), median_run(all_runs[loop, False])
        g, c_in, c_out = g_of(outside), c_of(inside), c_of(outside)
        ratios = [a.tok_per_s / b.tok_per_s for a, b in zip(all_runs[loop, True], all_runs[loop, False])]
        figure(f"{loop}: in the loop / outside, tok/s ({where})", median(ratios), "{:.2f}",
               f"median over {len(ratios)} round(s) of each round's ratio; the table's median runs give "
               f"{inside.tok_per_s:.0f} / {outside.tok_per_s:.0f} = {inside.tok_per_s / outside.tok_per_s:.2f}")
        predicted = STEP[loop](g, c_out) / STEP[loop](g, c_in)
        console.print(f"  predicted {predicted:.2f}, from the {loop} rows of the table (G {ms(g)} outside, "
                      f"C {ms(c_in)} in the loop, {ms(c_out)} outside): {predicted_why(loop, g, c_in)}")
        console.print(f"  measured: {measured_says(ratios)}")


def main() -> None:
    args = parse_args(__doc__, delay_ms=2.0)
    header(13, "the server's process layout: tokenizing outside the loop",
           [SchedulerLoop.run, IncrementalDetokenizer, "minisgl/server/__init__.py (the two processes)",
            "lessons/readings §19 (SGLang's TokenizerManager -> Scheduler -> DetokenizerManager), §2 (C)"])
    texts = [prompt for prompt, _ in demo_pairs(32 if args.quick else 64)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)  # every request decodes the same number of steps
    reps = 1 if args.quick else 3

    section(f"1. {len(texts)} text requests, {WAVE} every {EVERY} iterations, 32 tokens each; both loops, "
            f"device delay {args.delay_ms:g} ms")
    emulated = rounds(reps, configs(args.delay_ms), texts, params, runner=serve)
    median_runs = {key: median_run(rs) for key, rs in emulated.items()}
    show(f"each configuration: its run of median throughput, of {reps}", median_runs)
    inside, outside = median_runs["normal", True], median_runs["normal", False]
    figure("encode calls on the loop thread (in the loop)", inside.tokenizer.on_loop["encode"], "{:d}",
           "one per prompt")
    figure("encode calls on the loop thread (outside)", outside.tokenizer.on_loop["encode"], "{:d}",
           f"{outside.tokenizer.elsewhere['encode']} on the other thread")
    figure("decode calls on the loop thread (in the loop)", inside.tokenizer.on_loop["decode"], "{:d}",
           "one per new token (the incremental detokenizer's window), one more each time the window slides "
           f"(past {WINDOW} ids) and at the end for a piece still pending, one for its RequestOutput.text")
    figure("decode calls on the loop thread (outside)", outside.tokenizer.on_loop["decode"], "{:d}",
           "one per request: the LLM's RequestOutput.text")
    every = [r for rs in emulated.values() for r in rs]
    figure("streamed texts identical", int(all(r.texts == every[0].texts for r in every)), "{:d}",
           "in the loop, piece by piece, against decoded elsewhere at the end; every run")
    figure("C in the loop - C outside, ms (normal loop)", (c_of(inside) - c_of(outside)) * 1e3, "{:.2f}",
           "the host work the tokenizer adds to every iteration")
    compare(emulated, f"delay {args.delay_ms:g} ms")

    g, c_out = g_of(outside), c_of(outside)
    host_delay = host_delay_for(g, c_out, 1.0)
    section(f"2. the loop's other host work raised toward G: host_delay_ms {host_delay:.1f} (the lab's knob), "
            f"aimed at C outside = G of section 1's normal loop ({ms(g)}); G moves from run to run, so read the "
            "C/G reached")
    at_g = rounds(reps, configs(args.delay_ms, host_delay), texts, params, runner=serve)
    at_g_median = {key: median_run(rs) for key, rs in at_g.items()}
    show(f"host_delay_ms {host_delay:.1f}: each configuration's run of median throughput, of {reps}", at_g_median)
    for loop in LOOPS:
        reached = at_g_median[loop, False]
        figure(f"C/G reached, tokenizing outside ({loop})", c_of(reached) / g_of(reached), "{:.2f}", "aimed at 1")
    compare(at_g, "C outside aimed at G")
    notice("tokenizing and detokenizing are host work on the scheduler's thread when the loop does them: they add "
           "to C. The overlap hides C only while C < G, so moving that work to another process (SGLang's "
           "TokenizerManager and DetokenizerManager, minisgl's HTTP process) keeps C under G for longer.")


if __name__ == "__main__":
    lesson_main(main)
