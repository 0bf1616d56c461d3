"""The engine options every CLI command shares, and building an `LLM` from them.

Kept apart from `__main__` so that library modules (the benchmark, the lab) can build an
engine from parsed arguments without importing the command line itself.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..mechanisms import MECHANISMS


def _number(text: str, convert, valid, expected: str):
    """An argparse value: `text` converted, and `valid`, or one error saying what is `expected`."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
    if not valid(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type for counts and sizes: 0 or a negative number is an error, not "the default"."""
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def nonnegative_int(text: str) -> int:
    """argparse type for counts where 0 means "none" (e.g. skip a step)."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type for rates: a finite number above 0 (nan, inf and 0 are errors)."""
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


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
    p.add_argument("--device-delay-ms", type=float, default=0.0,
                   help="emulated extra device time per forward (CPU teaching aid)")
    p.add_argument("--host-delay-ms", type=float, default=0.0,
                   help="emulated extra scheduler (host) work per loop iteration (the lab's knob for C)")
    p.add_argument("--max-running-requests", type=positive_int, default=None)
    p.add_argument("--chunk-size", type=positive_int, default=None)
    p.add_argument("--kv-tokens", type=positive_int, default=None)
    p.add_argument("--min-prefill-tokens", type=nonnegative_int, default=None,
                   help="while requests decode, admit new ones only when their prefill reaches this many tokens "
                   "(0: as soon as they fit; default: 4096 on CUDA, 0 on the CPU)")
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


def build_llm(args: argparse.Namespace, **overrides):
    from .llm import LLM

    kwargs = dict(device=args.device, dtype=args.dtype, loop=args.loop, disable=disabled_names(args),
                  device_delay_ms=args.device_delay_ms, host_delay_ms=args.host_delay_ms, max_running_requests=args.max_running_requests,
                  chunk_size=args.chunk_size, kv_tokens=args.kv_tokens,
                  deterministic=getattr(args, "deterministic", False),
                  admission=getattr(args, "admission", "reserve"),
                  min_prefill_tokens=getattr(args, "min_prefill_tokens", None))
    kwargs.update(overrides)
    return LLM(model_dir(args), **kwargs)


def parse_numbers(text: str, option: str, allow_zero: bool) -> list[float]:
    """A comma-separated list of finite numbers >= 0 (or > 0): one clear error otherwise."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero) for v in values):
        raise ValueError(f"{option} must be {'non-negative' if allow_zero else 'positive'} numbers, got {text!r}")
    return values


def check_output_file(path: str | None, option: str) -> None:
    """Refuse, before a long run, an output file whose directory does not exist."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise ValueError(f"{option}: the directory of {path!r} does not exist")
