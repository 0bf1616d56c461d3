"""Lesson 4: FutureMap, or how batch n+1 is built before batch n's tokens reach the host.

Spies on the engine to show the input ids the host staged (placeholders -(row+1)) and what
the device resolved them to. Then switches the future_map mechanism off: the host must
commit batch n before it can write batch n+1's input ids, and the bubble comes back.
"""

from common import (busy_change, console, demo_pairs, figure, header, lesson_main, make_llm, ms, notice, parse_args,
                    pct, run, section, side_by_side, timeline)

from minisgl import SamplingParams
from minisgl.future_map import FutureMap, placeholder
from minisgl.scheduler import Scheduler


def spy_on_resolve(llm) -> list[tuple[list[int], list[int]]]:
    """Record (staged input ids, resolved input ids) of every forward. resolve() runs on the
    engine stream, at the entry of each forward: the moment the placeholders become tokens."""
    seen: list[tuple[list[int], list[int]]] = []
    original = llm.engine.future_map.resolve

    def resolve(input_ids):
        out = original(input_ids)
        seen.append((input_ids.tolist(), out.tolist()))
        return out

    llm.engine.future_map.resolve = resolve
    return seen


def show_placeholders(prompts, params, delay_ms: float, disable=()) -> None:
    llm = make_llm("overlap", disable, delay_ms)
    seen = spy_on_resolve(llm)
    llm.generate(prompts, params)
    # A decode batch after some requests left: batch positions and rows no longer agree.
    staged, resolved = next(((s, r) for s, r in seen if 1 < len(s) < len(prompts) and len(set(s)) == len(s)
                             and all(t < 0 for t in s) and [-t - 1 for t in s] != list(range(len(s)))),
                            seen[len(seen) // 2])
    label = "future_map off" if disable else "future_map on"
    console.print(f"  [bold]{label}[/], a decode batch of {len(staged)} requests:")
    console.print(f"    host staged input_ids   {staged}")
    console.print(f"    device resolved them to {resolved}  {llm.tokenizer.decode(resolved)!r}")
    if any(t < 0 for t in staged):
        rows = [-t - 1 for t in staged]
        console.print(f"    placeholder(row) = -(row+1), so these are rows {rows} at batch positions "
                      f"{list(range(len(rows)))}: the row, stable for a request's life, is the mailbox "
                      f"(placeholder({rows[0]}) = {placeholder(rows[0])})")
    figure(f"placeholders in that batch ({label})", sum(t < 0 for t in staged), "{:d}")
    llm.close()


def main() -> None:
    args = parse_args(__doc__, delay_ms=3.0)
    header(4, "FutureMap: the next input token, relayed on the device",
           [FutureMap.publish, FutureMap.resolve, Scheduler._schedule_decode, Scheduler.overlap_loop,
            "minisgl/engine.py Engine._forward_and_sample (resolve at entry, publish after sampling)",
            "lessons/readings §6 (000 「future token：结果未返回时怎样准备下一轮」)"])
    pairs = demo_pairs(4 if args.quick else 8)
    prompts = [p for p, _ in pairs]
    # Different lengths, so that requests leave the batch and positions stop matching rows.
    params = [SamplingParams(max_new_tokens=8 + 4 * (i % 4), ignore_eos=True) for i in range(len(prompts))]

    section("1. what the host writes for a token it has not seen yet")
    show_placeholders(prompts, params, args.delay_ms)
    show_placeholders(prompts, params, args.delay_ms, disable=("future_map",))

    section("2. switch future_map off: batch n must be committed before batch n+1 is built")
    on = run("overlap, future_map on", prompts, params, delay_ms=args.delay_ms)
    off = run("overlap, future_map off", prompts, params, disable=("future_map",), delay_ms=args.delay_ms)
    timeline(off)
    side_by_side(f"device delay {args.delay_ms:g} ms", [on, off], {
        "device busy": lambda r: pct(r.metrics["device_busy_fraction"]),
        "device idle per forward": lambda r: ms(r.metrics["exposed_host_time_per_step_s"]),
        "output tok/s": lambda r: f"{r.tok_per_s:.0f}",
        "early commits (commit before launch)": lambda r: str(r.stats.early_commits),
        "batches": lambda r: str(r.stats.batches),
    })
    figure("device busy (future_map on)", on.metrics["device_busy_fraction"])
    figure("device busy (future_map off)", off.metrics["device_busy_fraction"])
    figure("early commits (future_map off)", off.stats.early_commits, "{:d}", "one per batch: the serial loop again")
    figure("batches (future_map off)", off.stats.batches, "{:d}")
    figure("outputs identical", int(on.tokens == off.tokens), "{:d}")
    notice("without the FutureMap the host has to wait for batch n's tokens to write batch n+1's input ids: "
           "every batch is synced first (one early commit per batch) and the red gaps come back. From off to on, "
           f"{busy_change(off, on)}. Not a token changes (tok/s is too noisy here to show the bubble).")


if __name__ == "__main__":
    lesson_main(main)
