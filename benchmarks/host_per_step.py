"""Host work per decode step at N running requests, for both loops (issue: a lighter host).

    python benchmarks/host_per_step.py MODEL_DIR [--device cpu|cuda] [--requests 256] [--steps 20]

Every request is prefilled first; then `--steps` steady decode steps are traced. Host work is
the schedule + launch + commit spans of a step (the waits for copy_done excluded): the same C
that `bench` and the lab report. On the CPU a 40 ms emulated device delay keeps the device
thread asleep during the host's work, so the figure is the host's own, not a GIL contest.
"""

from __future__ import annotations

import argparse
import statistics

from minisgl import LLM, SamplingParams
from minisgl.tracer import HOST_LANE, HOST_WORK


def host_ms_per_step(model: str, loop: str, device: str, requests: int, steps: int) -> dict[str, float]:
    delay = 40.0 if device == "cpu" else 0.0
    llm = LLM(model, device=device, loop=loop, trace=True, device_delay_ms=delay,
              max_running_requests=requests, kv_tokens=requests * 200)
    params = SamplingParams(max_new_tokens=steps + 16, ignore_eos=True)
    for i in range(requests):
        llm.add_request([(i * 31 + j) % 200 + 1 for j in range(64)], params)
    while len(llm.scheduler.running.reqs) < requests or llm.scheduler.prefilling or llm.scheduler.waiting:
        llm.step()
    for _ in range(2):  # the last prefill's commit and the first decode's launch
        llm.step()
    llm.engine.tracer.clear()
    for _ in range(steps):
        llm.step()
    by_iteration: dict[int, dict[str, float]] = {}
    for span in llm.engine.tracer.resolve():
        if span.lane == HOST_LANE:
            parts = by_iteration.setdefault(span.iteration, {})
            parts[span.name] = parts.get(span.name, 0.0) + span.duration * 1000
    while llm.has_unfinished():
        llm.step()
    llm.close()
    rows = list(by_iteration.values())
    out = {name: statistics.median(r.get(name, 0.0) for r in rows) for name in HOST_WORK}
    out["host"] = statistics.median(sum(r.get(n, 0.0) for n in HOST_WORK) for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(f"host ms per decode step, {args.requests} running requests, median of {args.steps} steps ({args.device})")
    for loop in ("normal", "overlap"):
        r = host_ms_per_step(args.model, loop, args.device, args.requests, args.steps)
        print(f"  {loop:8} host {r['host']:.2f}  (schedule {r['schedule']:.2f}, launch {r['launch']:.2f}, "
              f"commit {r['commit']:.2f})")


if __name__ == "__main__":
    main()
