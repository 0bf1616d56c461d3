"""The online benchmark through HTTP, beside the in-process one at the same arrival rates.

    python benchmarks/http_online.py [--model DIR] [--num-requests N] [--rate R1,R2] [--loops normal,overlap]
                                     [--repeat R] [--server-cpus 0,1 --client-cpus 2]

For each loop: a `minisgl serve` process; Poisson arrivals (seed 0) of the online workload
(`bench --workload online`: the offline lengths, ignore_eos), each request a streaming
completion from the official `openai` client (asyncio); TTFT from the request's arrival time
to its first chunk, ITL between chunks, tok/s over the run, all measured by the client. Beside
each HTTP run, the in-process online bench (minisgl/observe/online.py) on the same requests at
the same rate, and the ratio of the two throughputs. With --repeat R, R such pairs a rate, taken
in turn (HTTP first, then in-process first, and so on, so that a drift of the machine's speed
weighs on both paths alike); the table shows each pair and the median of the ratios. Under the
table, each run's CPU seconds by process (the HTTP process, the scheduler process, this
benchmark's client; in process, the engine's), also per 1,000 output tokens, and the load
average before and after it (1 minute).

With --server-cpus (Linux), the server's two processes and the in-process engine run on those
cores alone, and with --client-cpus the benchmark's client on others: the comparison a deployment
makes, where the load comes from another machine. Without them all three share every core, and
on 2 cores the client's own work (about as much as the HTTP process's) is taken from the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.request import urlopen

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from minisgl import SamplingParams  # noqa: E402
from minisgl.frontend.options import Number, NumberList  # noqa: E402
from minisgl.observe.bench import Workload, offline_workload  # noqa: E402
from minisgl.observe.online import poisson_arrivals, run_online  # noqa: E402
from minisgl.observe.trace import _percentile  # noqa: E402
from minisgl.server.launcher import running_server, scheduler_pid  # noqa: E402

console = Console(width=None if sys.stdout.isatty() else 160)


async def one_request(client, prompt: list[int], max_tokens: int, arrival: float, progress, task) -> dict:
    """One streaming completion, started at its arrival time; its token times as the client saw them."""
    await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
    # The ids go in extra_body, which the client sends as it is: its own conversion of `prompt` walks
    # the list item by item (tens of ms for a thousand ids on the 2-core machine), work of the
    # benchmark's client that would be counted as the server's TTFT.
    stream = await client.completions.create(model="bench", prompt="", max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"prompt": prompt, "ignore_eos": True})
    times, tokens = [], 0
    async for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    progress.advance(task)
    return {"arrival": arrival, "times": times, "tokens": tokens}


def server_sums(url: str) -> dict[str, float]:
    """The server's own TTFT and ITL histograms' sums and counts (/metrics)."""
    text = urlopen(f"{url}/metrics").read().decode()
    return {name: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            for name in (f"minisgl:{m}_seconds_{s}" for m in ("time_to_first_token", "inter_token_latency")
                         for s in ("sum", "count")) if line.startswith(name + "{")}


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process so far (Linux /proc), or of this one."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def http_online(url: str, workload: Workload, rate: float, label: str, pids: tuple[int, int]) -> dict:
    """The run; also the CPU seconds each process spent in it: the HTTP process, the scheduler
    process and this benchmark's client."""
    import openai

    before = server_sums(url)
    load = os.getloadavg()[0]
    cpu_before = [cpu_s(p) for p in (*pids, None)]
    arrivals = poisson_arrivals(len(workload.prompts), rate, seed=0)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600) as client:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(label, total=len(arrivals))
            start = time.perf_counter()
            runs = await asyncio.gather(*(one_request(client, p, sp.max_new_tokens, start + a, progress, task)
                                          for p, sp, a in zip(workload.prompts, workload.params, arrivals)))
            end = time.perf_counter()
    ttft = [r["times"][0] - r["arrival"] for r in runs if r["times"]]
    itl = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in runs)
    after = server_sums(url)
    cpu = [cpu_s(p) - b for p, b in zip((*pids, None), cpu_before)]

    def server_mean(metric: str) -> float:
        sums, counts = (after[f"minisgl:{metric}_seconds_{s}"] - before[f"minisgl:{metric}_seconds_{s}"]
                        for s in ("sum", "count"))
        return sums / counts if counts else float("nan")

    console.print(f"{label}: {tokens / (end - start):.0f} tok/s", highlight=False)  # a line a run, before the table
    return {"cpu_s": dict(zip(("http", "scheduler", "client"), cpu)), "load": (load, os.getloadavg()[0]),
            "server_ttft_mean_s": server_mean("time_to_first_token"),
            "server_itl_mean_s": server_mean("inter_token_latency"), "rate": rate, "output_tokens": tokens,
            "wall_s": end - start, "output_tok_per_s": tokens / (end - start),
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "itl_p50_s": _percentile(itl, 50), "itl_p99_s": _percentile(itl, 99)}


@contextmanager
def on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """Run this process (and the processes it starts meanwhile) on `cpus`; None leaves it as it is."""
    if cpus is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def cpu_list(text: str) -> set[int]:
    return {int(c) for c in text.split(",")}


def in_process_run(llm, loop: str, workload: Workload, rate: float) -> dict:
    """One in-process online run; also its CPU seconds (this process: the engine's)."""
    load, cpu = os.getloadavg()[0], cpu_s()
    run = run_online(llm, workload.prompts, workload.params, rate, seed=0)
    console.print(f"{loop} in-process {rate:g} req/s: {run['output_tok_per_s']:.0f} tok/s", highlight=False)
    return {**run, "cpu_s": {"in-process": cpu_s() - cpu}, "load": (load, os.getloadavg()[0])}


def compare_loop(model: Path, loop: str, workload: Workload, args: argparse.Namespace) -> list[tuple]:
    """For each rate, `repeat` pairs of runs (HTTP, in-process) on one server and one in-process
    engine, the pair's order alternating; the rows of the table."""
    from minisgl import LLM

    rows = []
    # Both engines are up at once, so each gets a KV pool that holds every request at once (the
    # default would size the second from what the first left free): the same capacity on both paths.
    kv_tokens = workload.input_tokens + workload.output_tokens + 64
    # A process keeps the cores it was started on: the server's two keep the server's cores
    # when this one moves to the client's.
    with (on_cpus(args.server_cpus),
          running_server("--model", str(model), "--loop", loop, "--served-model-name", "bench",
                         "--kv-tokens", str(kv_tokens)) as (url, proc),
          LLM(model, loop=loop, trace=True, kv_tokens=kv_tokens) as llm):
        pids = (proc.pid, scheduler_pid(proc))
        # Both paths' first run of many concurrent requests paid first-use costs (a first HTTP run's
        # TTFT p50 several times the later runs'): a few requests at once, a few dozen tokens each.
        prompts = [p[:64] for p in workload.prompts[:8]]
        warm_up = Workload("warm-up", prompts, [SamplingParams(max_new_tokens=32, ignore_eos=True)] * len(prompts))
        llm.generate(warm_up.prompts, warm_up.params)
        with on_cpus(args.client_cpus):
            asyncio.run(http_online(url, warm_up, 1e6, "warm-up", pids))

        def http_run(rate: float) -> dict:
            with on_cpus(args.client_cpus):
                return asyncio.run(http_online(url, workload, rate, f"{loop} HTTP {rate:g} req/s", pids))

        for rate in args.rate:
            for pair in range(args.repeat):
                if pair % 2 == 0:
                    http, local = http_run(rate), in_process_run(llm, loop, workload, rate)
                else:
                    local, http = in_process_run(llm, loop, workload, rate), http_run(rate)
                ratio = http["output_tok_per_s"] / local["output_tok_per_s"]
                rows += [(loop, "HTTP", http, ratio), (loop, "in-process", local, None)]
    return rows


def median_ratios(rows: list[tuple]) -> list[str]:
    """A line a loop and rate with more than one pair: the median of the pairs' ratios, and their range."""
    ratios: dict[tuple[str, float], list[float]] = {}
    for loop, _, r, ratio in rows:
        if ratio is not None:
            ratios.setdefault((loop, r["rate"]), []).append(ratio)
    return [f"{loop} {rate:g} req/s: HTTP / in-process median {statistics.median(rs):.1%} over {len(rs)} pairs "
            f"(range {min(rs):.1%}-{max(rs):.1%})" for (loop, rate), rs in ratios.items() if len(rs) > 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model, shorter lengths)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rate", type=NumberList(Number(float, 1e-3, 1e6)), default=[4.0, 16.0])
    ap.add_argument("--loops", default="normal,overlap")
    ap.add_argument("--repeat", type=Number(int, 1, 100), default=1,
                    help="pairs of runs (HTTP, in-process) a rate, in alternating order; the median ratio is printed")
    ap.add_argument("--server-cpus", type=cpu_list, default=None,
                    help="cores for the server's processes and the in-process engine, e.g. 0,1 (Linux)")
    ap.add_argument("--client-cpus", type=cpu_list, default=None, help="cores for the benchmark's client, e.g. 2")
    args = ap.parse_args()
    from minisgl.demo.paths import demo_model_path
    from transformers import AutoConfig

    model = Path(args.model) if args.model else demo_model_path()
    config = AutoConfig.from_pretrained(model)
    workload = offline_workload(args.num_requests, config.vocab_size)
    window = config.max_position_embeddings
    if workload.input_tokens and max(len(p) + sp.max_new_tokens for p, sp in zip(workload.prompts, workload.params)) > window:
        sys.exit(f"error: the online workload (lengths up to 1024 + 1024) does not fit {model}'s window of {window}; "
                 f"pass --model DIR (make-tiny DIR --arch qwen3)")
    rows = [row for loop in args.loops.split(",") for row in compare_loop(model, loop, workload, args)]
    table = Table(title=f"online: {len(workload.prompts)} requests ({workload.input_tokens} input, "
                        f"{workload.output_tokens} output tokens), Poisson arrivals (seed 0), {model.name}")
    for col in ("loop", "path", "rate req/s", "tok/s", "HTTP / in-process", "TTFT p50 ms", "TTFT p99 ms",
                "ITL p50 ms", "ITL p99 ms", "server TTFT / ITL mean ms"):
        table.add_column(col, justify="right")
    for loop, path, r, ratio in rows:
        server = (f"{r['server_ttft_mean_s'] * 1000:.1f} / {r['server_itl_mean_s'] * 1000:.1f}"
                  if "server_ttft_mean_s" in r else "")
        table.add_row(loop, path, f"{r['rate']:g}", f"{r['output_tok_per_s']:.0f}", "" if ratio is None else f"{ratio:.1%}",
                      *(f"{r[k] * 1000:.1f}" for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")), server)
    console.print(table)
    for loop, path, r, _ in rows:
        per_1k = ", ".join(f"{who} {s:.2f} ({s / r['output_tokens'] * 1000:.3f} per 1,000 tokens)"
                           for who, s in r["cpu_s"].items())
        console.print(f"{loop} {path} {r['rate']:g} req/s: CPU s {per_1k}; wall {r['wall_s']:.1f} s; "
                      f"load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}")
    console.print("TTFT and ITL: as the client saw them (HTTP: the official client, whose own work per request and "
                  "per chunk is in them); server: from its arrival at the server to the token's arrival in the HTTP "
                  "process (/metrics)")
    for line in median_ratios(rows):
        console.print(line, highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
