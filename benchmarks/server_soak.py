"""A soak of `minisgl serve` under mixed traffic, then a SIGTERM drain.

    python benchmarks/server_soak.py [--minutes M] [--clients C] [--model DIR]

C concurrent clients loop for M minutes, each request drawn at random: a streaming completion
read to the end, a non-streaming one, a chat completion with a JSON schema, a stream dropped
at a random point, a bad request. Well-behaved clients' greedy text is checked against the
first answer to the same prompt. Every 10 s: the RSS of both server processes and the KV the
requests hold. At the end: SIGTERM, the exit code (0: drained, the scheduler's pools checked),
and the figures: requests by kind, mismatches, peak RSS against the start, KV after the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minisgl.demo.tasks import demo_prompts  # noqa: E402
from minisgl.server.launcher import rss_mb, running_server, scheduler_pid  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["animal"],
          "properties": {"animal": {"enum": ["cat", "dog", "owl"]}}}
KINDS = ("stream", "whole", "json", "drop", "bad")


async def post(host: str, port: int, path: str, body: dict, drop_after: int | None = None) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                 .encode() + payload)
    await writer.drain()
    if drop_after is not None:
        await reader.read(drop_after)
        writer.transport.abort()
        return 0, b""
    raw = await reader.read(-1)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


def text_of(kind: str, raw: bytes) -> str:
    if kind == "stream":  # chunked SSE: the data lines' texts
        return "".join(c["text"] for line in raw.split(b"\n") if line.startswith(b"data: {")
                       for c in json.loads(line[6:])["choices"])
    start = raw.index(b"{")
    out = json.loads(raw[start:raw.rindex(b"}") + 1])
    return out["choices"][0]["text"] if kind == "whole" else out["choices"][0]["message"]["content"]


async def client(host: str, port: int, prompts: list[str], deadline: float, rng: random.Random,
                 counts: Counter, answers: dict) -> None:
    while time.monotonic() < deadline:
        kind, prompt = rng.choice(KINDS), rng.choice(prompts)
        base = {"model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        if kind == "stream":
            status, raw = await post(host, port, "/v1/completions", {**base, "stream": True})
        elif kind == "whole":
            status, raw = await post(host, port, "/v1/completions", base)
        elif kind == "json":
            status, raw = await post(host, port, "/v1/chat/completions", {
                "model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}})
        elif kind == "drop":
            status, raw = await post(host, port, "/v1/completions", {**base, "max_tokens": 200, "ignore_eos": True,
                                                                     "stream": True}, drop_after=rng.randint(1, 3000))
        else:
            status, raw = await post(host, port, "/v1/completions", {**base, "max_tokens": -rng.randint(1, 9)})
        counts[kind] += 1
        if kind == "bad":
            counts["bad answered 400"] += status == 400
        elif kind != "drop":
            if status != 200:
                counts[f"{kind} status {status}"] += 1
                continue
            text = text_of(kind, raw)
            if kind == "json":
                json.loads(text)
            key = (kind == "json", prompt)
            if answers.setdefault(key, text) != text:
                counts["mismatches"] += 1


async def soak(url: str, proc, minutes: float, clients: int) -> dict:
    host, port = url.split("//")[1].split(":")
    prompts = [p for p, _ in demo_prompts(64, seed=31)]
    pids = [proc.pid, scheduler_pid(proc)]
    start_rss = [rss_mb(p) for p in pids]
    peak = list(start_rss)
    counts: Counter = Counter()
    answers: dict = {}
    deadline = time.monotonic() + minutes * 60
    tasks = [asyncio.create_task(client(host, int(port), prompts, deadline, random.Random(i), counts, answers))
             for i in range(clients)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(10)
        peak = [max(a, rss_mb(p)) for a, p in zip(peak, pids)]
        print(f"{time.strftime('%H:%M:%S')} {sum(counts[k] for k in KINDS)} requests, RSS MB "
              f"{[round(rss_mb(p)) for p in pids]} (start {[round(x) for x in start_rss]})", flush=True)
    for t in tasks:
        t.result()
    after, _ = await post(host, int(port), "/v1/completions", {"model": "demo", "prompt": "add 1 2:"})  # still serving
    return {"counts": dict(counts), "start_rss_mb": start_rss, "peak_rss_mb": peak, "answered_after": after,
            "distinct_prompts": len(answers)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=32)
    args = ap.parse_args()
    with running_server("--kv-tokens", "16384") as (url, proc):
        figures = asyncio.run(soak(url, proc, args.minutes, args.clients))
        from urllib.request import urlopen

        metrics = urlopen(f"{url}/metrics").read().decode()
        figures["kv_after"] = [line for line in metrics.splitlines() if line.startswith("minisgl:token_usage")]
        proc.send_signal(signal.SIGTERM)
        figures["exit_code"] = proc.wait(120)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
