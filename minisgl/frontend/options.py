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

from ..checks import INT64_MAX
from ..mechanisms import MECHANISMS
from ..settings import SETTING, SETTINGS, Setting


# The most requests a CLI run builds (generate's demo prompts, bench, trace, the lab's batch): the
# workload is built up front, in Python lists, so the bound keeps it well within host memory while
# leaving room above the largest GPU run recorded (figures: benchmarks/RESULTS.md, "CLI limits").
MAX_CLI_REQUESTS = 16384
# generate's demo prompts and trace's requests are distinct held-out demo prompts, drawn one by one
# and slower as the pool runs out: the bound keeps the drawing short.
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
    none: bool = False  # "none" is valid too and means None (a setting's None, e.g. "never")

    def __call__(self, text: str):
        if self.none and text == "none":
            return None
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
        extra = [*map(str, self.special), *(["none"] if self.none else [])]
        special = f" (or {', '.join(extra)})" if extra else ""
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


def setting_type(setting: Setting) -> Number:
    """A numeric setting's range as the argparse type of its flag."""
    return Number(setting.kind, setting.low, setting.high, none=setting.accepts_none and setting.default is not None)


DELAY_MS = setting_type(SETTING["device_delay_ms"])  # 0: no emulated delay
SEED = Number(int, 0, INT64_MAX)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags print one line, `error: ...`, and exit 2, like every other bad input."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """`--model`, then one flag per engine setting (settings.py): `--name-with-dashes`, its range, its help."""
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the demo model)")
    for setting in SETTINGS:
        if setting.cli:
            add_setting_flag(p, setting)


def add_setting_flag(p: argparse.ArgumentParser, s: Setting) -> None:
    flag, helptext = "--" + s.name.replace("_", "-"), f"{s.help} ({default_text(s)})"
    if s.kind is bool:  # a switch: --name sets the other value than the default (--no-name where that is off)
        p.add_argument(flag, action=argparse.BooleanOptionalAction if s.default else "store_true", default=s.default,
                       help=helptext)
    elif s.kind is tuple:  # names, repeatable or comma-separated
        p.add_argument(flag, type=comma_separated, action="extend", default=[], metavar="NAME",
                       help=f"{s.help}, repeatable or comma-separated: {', '.join(MECHANISMS)}")
    elif s.choices:
        p.add_argument(flag, choices=s.choices, default=s.default, help=helptext)
    elif s.kind in (int, float):
        p.add_argument(flag, type=setting_type(s), default=s.default, metavar="MS" if s.name.endswith("_ms") else "N",
                       help=helptext)
    else:  # a device, a dtype, a path: resolve_config checks them
        p.add_argument(flag, default=s.default, metavar="DIR" if s.kind is Path else None, help=helptext)


def default_text(s: Setting) -> str:
    if s.per_device is not None:
        return f"default: {s.per_device[0]} on the CPU, {s.per_device[1]} on CUDA"
    if s.default is None:
        return f"default: {s.none}"
    shown_default = ("on" if s.default else "off") if s.kind is bool else s.default
    return f"default: {shown_default}" + (f"; none: {s.none}" if s.none else "")


def comma_separated(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from ..demo.paths import demo_model_path

    return demo_model_path()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM keyword arguments the engine flags give (one per setting with a flag)."""
    return {s.name: getattr(args, s.name) for s in SETTINGS if s.cli}


def build_llm(args: argparse.Namespace, **overrides):
    """An LLM from the engine flags (add_engine_args); `overrides`: settings the command sets itself."""
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
