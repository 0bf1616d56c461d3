"""The engine options every CLI command shares, and building an `LLM` from them.

Kept apart from `__main__` so that library modules (the benchmark, the lab) can build an
engine from parsed arguments without importing the command line itself.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..checks import INT64_MAX, MAX_DELAY_MS, MAX_RUNNING_REQUESTS, MAX_TOKENS
from ..mechanisms import MECHANISMS


# The most requests a CLI run builds (generate's demo prompts, bench, trace, the lab's batch): the
# workload is built up front, and 16,384 offline requests are ~9M prompt tokens (~300 MB of Python
# lists), four times the largest GPU run recorded (benchmarks/RESULTS.md).
MAX_CLI_REQUESTS = 16384
# generate's demo prompts and trace's requests are distinct held-out demo prompts, drawn one by
# one: about 6 s per thousand on a loaded 2-core machine, slower as the pool runs out (16,384: minutes).
MAX_DEMO_PROMPTS = 1024


@dataclass(frozen=True)
class Number:
    """The argparse type of one numeric flag, and its range. A value outside it (nan, inf, a negative
    count, a count or time no run could finish) is one `error:` line, exit 2, before anything runs.
    Whether 0 is valid is decided here, per flag, from its meaning: a delay of 0 is, a count is not."""

    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False  # low itself excluded (a rate must be above 0)
    special: tuple = ()  # valid values outside [low, high], e.g. --top-k -1 (off)

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.expected()}, got {shown(text)}") from None
        if not self.valid(value):
            raise argparse.ArgumentTypeError(f"must be {self.expected()}, got {shown(text)}")
        return value

    def valid(self, value) -> bool:
        if value in self.special:
            return True
        above = value > self.low if self.low_open else value >= self.low
        return (self.kind is int or math.isfinite(value)) and above and value <= self.high

    def expected(self) -> str:
        kind = "an integer" if self.kind is int else "a finite number"
        low = f"{'>' if self.low_open else '>='} {self.low:g}"
        special = f" (or {', '.join(map(str, self.special))})" if self.special else ""
        return f"{kind} {low} and <= {self.high if self.kind is int else format(self.high, 'g')}{special}"


@dataclass(frozen=True)
class NumberList:
    """The argparse type of a comma-separated list of numbers, each in `item`'s range."""

    item: Number

    def __call__(self, text: str) -> list:
        parts = [x for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"must be comma-separated numbers, each {self.item.expected()}")
        try:
            return [self.item(x) for x in parts]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"each comma-separated value {exc}") from None


def shown(text: str, limit: int = 40) -> str:
    """A value as an error line quotes it: cut to `limit` characters (a 5,000-digit number stays one short line)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def count(high: int, low: int = 1) -> Number:
    """An integer count or size in [low, high]: 0 or a negative number is an error, not "the default"."""
    return Number(int, low, high)


DELAY_MS = Number(float, 0.0, MAX_DELAY_MS)  # 0: no emulated delay
SEED = Number(int, 0, INT64_MAX)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags print one line, `error: ...`, and exit 2, like every other bad input."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the demo model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--loop", default="overlap", choices=["overlap", "normal"])
    p.add_argument("--disable", action="append", default=[], metavar="NAME",
                   help=f"switch a mechanism off (repeatable or comma-separated): {', '.join(MECHANISMS)}")
    p.add_argument("--device-delay-ms", type=DELAY_MS, default=0.0,
                   help="emulated extra device time per forward (CPU teaching aid)")
    p.add_argument("--host-delay-ms", type=DELAY_MS, default=0.0,
                   help="emulated extra scheduler (host) work per loop iteration (the lab's knob for C)")
    p.add_argument("--max-running-requests", type=count(MAX_RUNNING_REQUESTS), default=None)
    p.add_argument("--chunk-size", type=count(MAX_TOKENS), default=None)
    # The smallest pool: a one-token prompt, one new token, and the slot an overshoot step writes.
    p.add_argument("--kv-tokens", type=count(MAX_TOKENS, low=3), default=None)
    p.add_argument("--min-prefill-tokens", type=count(MAX_TOKENS, low=0), default=None,
                   help="while requests decode, admit new ones only when their prefill reaches this many tokens "
                   "(0: as soon as they fit; default: 7168 on CUDA, 0 on the CPU)")
    p.add_argument("--admission", default="reserve", choices=["reserve", "optimistic"],
                   help="reserve: promise prompt + max_new_tokens per request; optimistic: estimate what running "
                   "requests still need (new-token ratio) and retract when a decode step runs short")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a request's tokens do not depend on its batch")


def disabled_names(args: argparse.Namespace) -> list[str]:
    return [name for item in args.disable for name in item.split(",") if name]


def model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from ..demo.paths import demo_model_path

    return demo_model_path()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM keyword arguments the engine flags give."""
    return dict(device=args.device, dtype=args.dtype, loop=args.loop, disable=disabled_names(args),
                device_delay_ms=args.device_delay_ms, host_delay_ms=args.host_delay_ms,
                max_running_requests=args.max_running_requests, chunk_size=args.chunk_size, kv_tokens=args.kv_tokens,
                deterministic=getattr(args, "deterministic", False), admission=getattr(args, "admission", "reserve"),
                min_prefill_tokens=getattr(args, "min_prefill_tokens", None))


def build_llm(args: argparse.Namespace, **overrides):
    from .llm import LLM

    return LLM(model_dir(args), **{**engine_kwargs(args), **overrides})


def check_output_file(path: str | None, option: str) -> None:
    """Refuse, before a long run, an output file that cannot be written: opened for appending (which
    creates it, or keeps what it holds), then removed again if it did not exist."""
    if path is None:
        return
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{option}: cannot write {path!r}: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)
