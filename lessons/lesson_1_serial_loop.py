"""Lesson 1: the serial loop and its bubble.

Runs the normal (serial) loop on demo prompts, shows the timeline and measures the bubble:
the device idles while the host commits batch n and schedules batch n+1.
"""

from common import (answers, console, demo_pairs, figure, header, lesson_main, ms, notice, parse_args, pct, run,
                    section, side_by_side, timeline)

from minisgl import SamplingParams
from minisgl.scheduler import Scheduler


def main() -> None:
    args = parse_args(__doc__, delay_ms=3.0)
    header(1, "the serial loop and its bubble",
           [Scheduler.normal_loop, Scheduler.schedule, Scheduler.launch, Scheduler.commit,
            "lessons/readings §2 (article 000 「串行调度为什么会让 GPU 等 CPU」)"])
    pairs = demo_pairs(8 if args.quick else 16)
    prompts, params = [p for p, _ in pairs], SamplingParams(max_new_tokens=40)

    section("1. the answers (the serial loop is the reference every other run must match)")
    slow = run(f"delay {args.delay_ms:g} ms", prompts, params, loop="normal", delay_ms=args.delay_ms)
    answers(pairs, slow.outs)

    section("2. the timeline: one row for the host (scheduler thread), one for the device (engine stream)")
    timeline(slow, iterations=4)
    m = slow.metrics
    g, c, idle = m["device_time_per_forward_s"], m["host_time_per_iteration_s"], m["exposed_host_time_per_step_s"]
    figure("device busy", m["device_busy_fraction"], note="union of forward spans / device window")
    figure("G ms", g * 1e3, "{:.2f}", "device time per forward")
    figure("C ms", c * 1e3, "{:.2f}", "host work per iteration: schedule + launch + commit, waiting excluded")
    figure("idle per forward ms", idle * 1e3, "{:.2f}", "what the device really waits each step")
    figure("G/(G+C)", g / (g + c), note="the article's bound, from host work alone")
    console.print("  The device waits a little more than C: after copy_done the host thread must wake up, and "
                  "after launch() the stream thread must wake up. Both hand-offs are part of the serial tail.")

    section("3. device speed: same host work, longer or shorter G")
    fast = run("no delay", prompts, params, loop="normal", delay_ms=0.0)
    slower = run("delay 10 ms", prompts, params, loop="normal", delay_ms=10.0)
    side_by_side("normal loop at three device speeds", [fast, slow, slower], {
        "G per forward": lambda r: ms(r.metrics["device_time_per_forward_s"]),
        "C host work per iteration": lambda r: ms(r.metrics["host_time_per_iteration_s"]),
        "device idle per forward": lambda r: ms(r.metrics["exposed_host_time_per_step_s"]),
        "device busy": lambda r: pct(r.metrics["device_busy_fraction"]),
        "output tok/s": lambda r: f"{r.tok_per_s:.0f}",
        "batches": lambda r: str(r.stats.batches),
    })
    figure("device busy (no delay)", fast.metrics["device_busy_fraction"])
    figure("device busy (delay 10 ms)", slower.metrics["device_busy_fraction"])
    assert fast.tokens == slow.tokens == slower.tokens, "the device speed must never change a token"
    notice("in the normal loop the device row has a red gap after every forward, right under the host's C, S "
           "and L: the device waits for the host every step, and the faster the device, the larger that share.")


if __name__ == "__main__":
    lesson_main(main)
