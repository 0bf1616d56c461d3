"""What every lesson script shares: the model, one traced run, and how figures are printed.

Kept small on purpose: a lesson script should read top to bottom without jumping here
more than once or twice. Every figure a lesson wants you to look at is printed by
`figure()` as one line `» name = value` (tests/test_lessons.py parses those lines); in the
student edition, a figure that an exercise's stub cannot show is one line `» name: not shown
until exercise N is written; ...` instead, with no number (tests/test_student_edition.py).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python lessons/lesson_N_x.py` from anywhere finds this checkout's minisgl
    sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

import minisgl  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.batch import SchedulerStats  # noqa: E402
from minisgl.course import missing_exercise  # noqa: E402
from minisgl.course.catalog import stub_note  # noqa: E402
from minisgl.observe.timeline import render_timeline  # noqa: E402
from minisgl.observe.trace import pipeline_metrics, request_metrics  # noqa: E402

# The terminal's width (80 when output is not a terminal); LESSON_WIDTH overrides it.
console = Console(width=int(os.environ["LESSON_WIDTH"]) if os.environ.get("LESSON_WIDTH") else None, highlight=False)
OK, BAD = "✓", "✗"


# --------------------------------------------------------------------------- a part not written yet



# --------------------------------------------------------------------------- the model

_MODEL: Path | None = None


def model_path() -> Path:
    """$MINISGL_LESSON_MODEL, else the demo model, else (said loudly) a tiny random model."""
    global _MODEL
    if _MODEL is None:
        if os.environ.get("MINISGL_LESSON_MODEL"):
            _MODEL = Path(os.environ["MINISGL_LESSON_MODEL"])
        else:
            try:
                _MODEL = minisgl.demo_model_path()
            except FileNotFoundError:
                from minisgl.demo.tiny import make_tiny

                _MODEL = make_tiny(Path(tempfile.mkdtemp(prefix="minisgl-lesson-")), "qwen3", seed=7)
                console.print(f"[yellow]the demo model is missing (minisgl/demo/checkpoint): using a tiny RANDOM model "
                              f"in {_MODEL}. Its answers are gibberish (every row shows {BAD}); the scheduling "
                              f"you are here to watch is the same.[/]")
    return _MODEL


def demo_pairs(n: int) -> list[tuple[str, str]]:
    """n held-out (prompt, expected answer) pairs: the model never saw them in training."""
    return minisgl.demo_prompts(n, seed=0)


# --------------------------------------------------------------------------- a run

@dataclass
class Run:
    label: str
    llm: LLM
    outs: list
    wall_s: float
    host_cpu_s: float  # CPU time of the scheduler (main) thread during generate(): waiting costs none

    @property
    def spans(self):
        return self.llm.engine.tracer.resolve()

    @property
    def metrics(self) -> dict:
        return pipeline_metrics(self.spans)

    @property
    def latency(self) -> dict:
        return request_metrics(self.outs)

    @property
    def stats(self) -> SchedulerStats:
        return self.llm.stats

    @property
    def tokens(self) -> list[list[int]]:
        return [o.token_ids for o in self.outs]

    @property
    def tok_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.wall_s


def make_llm(loop: str = "overlap", disable=(), delay_ms: float = 0.0, warm: bool = True, model=None,
             **kwargs) -> LLM:
    """An LLM with tracing on. `warm`: one tiny request first, then traces and counters reset,
    so that figures describe the lesson's workload only. (Not with batch_snapshot off: there
    even one request can lose its last token and never finish, see lesson 5.) `model`: another
    checkpoint than the lesson model; other keyword arguments go to LLM."""
    kwargs.setdefault("kv_tokens", 8192)  # plenty for a lesson, and small: lessons keep several engines alive
    kwargs.setdefault("device", "cpu")  # lessons 1-8 teach with the CPU stream emulation, even on a GPU machine
    llm = LLM(model or model_path(), loop=loop, disable=disable, device_delay_ms=delay_ms, trace=True, **kwargs)
    if disable:  # a switched-off mechanism may corrupt ownership on purpose: show the symptom, not the audit
        llm.scheduler.check_each_step = False
    if warm and "batch_snapshot" not in disable:
        llm.generate(["add 1 2:"], SamplingParams(max_new_tokens=2))
        llm.reset_stats()
    return llm


def run(label: str, prompts, params, loop: str = "overlap", disable=(), delay_ms: float = 0.0, **kwargs) -> Run:
    """generate() the prompts on a fresh engine and keep everything a lesson may want to show."""
    llm = make_llm(loop, disable, delay_ms, **kwargs)
    start, cpu = time.perf_counter(), time.thread_time()
    outs = llm.generate(prompts, params)
    return Run(label, llm, outs, time.perf_counter() - start, time.thread_time() - cpu)


def rounds(reps: int, configs: dict, prompts, params, runner=run) -> dict[object, list[Run]]:
    """Short runs on a shared 2-core machine are noisy: run the configurations in turn, `reps`
    rounds, so that a burst of other work hits all of them; every run is kept, in round order
    (round i of one configuration ran next to round i of the others). `runner`: how one run is
    made, `run` or a function with its arguments."""
    runs: dict = {key: [] for key in configs}
    for _ in range(reps):
        for key, (label, kwargs) in configs.items():
            runs[key].append(runner(label, prompts, params, **kwargs))
    return runs


def best_of(reps: int, configs: dict, prompts, params) -> dict:
    """`rounds`, keeping each configuration's fastest run."""
    return {key: max(rs, key=lambda r: r.tok_per_s) for key, rs in rounds(reps, configs, prompts, params).items()}


def median_run(runs: list[Run]) -> Run:
    """The run with the median throughput: a real run whose every figure belongs together."""
    return sorted(runs, key=lambda r: r.tok_per_s)[len(runs) // 2]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# --------------------------------------------------------------------------- printing

def header(number: int, title: str, read: list) -> None:
    """Lesson title, then where to read: each item an object (printed as file:line) or a string."""
    console.rule()
    console.print(f"[bold]Lesson {number}: {title}[/]")  # printed, not in the rule: a rule cuts a long title
    console.print(f"model: {model_path()}")
    for item in read:
        console.print(f"  read  {where(item) if not isinstance(item, str) else item}")


def where(obj) -> str:
    """`minisgl/scheduler.py:178 Scheduler.overlap_loop`, with the line number of today's code."""
    obj = inspect.unwrap(obj)
    path = Path(inspect.getsourcefile(obj)).resolve()
    source, line = inspect.getsourcelines(obj)
    line += next((i for i, text in enumerate(source) if not text.lstrip().startswith("@")), 0)  # skip decorators
    try:
        path = path.relative_to(ROOT)
    except ValueError:
        pass
    return f"{path}:{line} {obj.__qualname__}"


def section(text: str) -> None:
    console.print()
    console.print(f"[bold cyan]{text}[/]")  # wraps at the terminal's width (a rule would cut it)


_STUBS_EXPLAINED: set[tuple[int, str]] = set()  # a stub's note is printed in full once per run


def unwritten(number: int, part: str) -> bool:
    """Whether exercise `number`'s region `part` still holds the student edition's stub (never in
    the teacher's checkout): for a sentence about a symptom that the stub cannot show."""
    return stub_note(number, part) is not None


def figure(name: str, value: float | int, fmt: str = "{:.3f}", note: str = "",
           needs: tuple[int, str] | None = None) -> float:
    """Print a key figure on its own line: `» name = value  (note)`. Returns the value.

    `needs`: (exercise, region name) of the part whose mechanism this figure shows, where the
    student edition's stub there cannot show it (it ignores the switch the lesson turns off, or
    does without the mechanism). While that stub is in place, one line says so in the figure's
    place, in the stub's own words, and no number: a 0 would read "switch it off and nothing
    happens". Once anything else is written there (and in the teacher's checkout) the figure is
    printed as usual."""
    missing = stub_note(*needs) if needs else None
    if missing is not None:
        said = "see above" if needs in _STUBS_EXPLAINED else missing
        _STUBS_EXPLAINED.add(needs)
        console.print(f"» {name}: not shown until exercise {needs[0]} is written; its stub ({needs[1]}): {said}")
        return value
    console.print(f"» {name} = {fmt.format(value)}" + (f"   [dim]({note})[/]" if note else ""))
    return value


def busy_change(serial: Run, pipelined: Run) -> str:
    """The device-busy change from `serial` to `pipelined`, worded so that a notice never claims
    more than this run's figures show (on a loaded machine one short run can invert them)."""
    before, after = (r.metrics["device_busy_fraction"] for r in (serial, pipelined))
    if after > before:
        return f"device busy {before:.0%} -> {after:.0%}"
    return (f"device busy did not rise in this run ({before:.0%} -> {after:.0%}): other programs delayed the "
            "two threads by more than the bubble costs; the counts still hold, rerun on a quieter machine")


def notice(text: str) -> None:
    """The one line the learner should take away."""
    console.print()
    console.print(f"[bold green]Notice:[/] {text}")


def timeline(r: Run, width: int | None = None, iterations: int = 6) -> None:
    console.print(render_timeline(r.spans, title=r.label, width=width or console.width, max_iterations=iterations))


def answers(pairs: list[tuple[str, str]], outs, limit: int = 8, title: str = "answers") -> int:
    """prompt | expected | generated | ✓/✗ for the first `limit` rows; returns how many are right."""
    table = Table(title=title, title_justify="left")
    for col in ("prompt", "expected", "generated", "", "finish"):
        table.add_column(col, overflow="fold")
    right = 0
    for i, ((prompt, expected), out) in enumerate(zip(pairs, outs)):
        ok = out.text == expected
        right += ok
        if i < limit:
            table.add_row(prompt, expected, out.text, OK if ok else BAD, out.finish_reason)
    console.print(table)
    console.print(f"{right}/{len(outs)} answers exactly right" + (f" (first {limit} shown)" if len(outs) > limit else ""))
    return right


def side_by_side(title: str, runs: list[Run], rows: dict) -> None:
    """A table: one column per run, one row per figure; `rows` maps a label to fn(run) -> str."""
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for r in runs:
        table.add_column(r.label, justify="right")
    for label, fn in rows.items():
        table.add_row(label, *(fn(r) for r in runs))
    console.print(table)


def per_run(title: str, runs: list[Run], columns: dict) -> None:
    """A table: one row per run, one column per figure (for many runs and few figures, where one
    column per run would not fit 80 columns); `columns` maps a short header to fn(run) -> str."""
    table = Table(title=title, title_justify="left")
    table.add_column("run")
    for name in columns:
        table.add_column(name, justify="right")
    for r in runs:
        table.add_row(r.label, *(fn(r) for fn in columns.values()))
    console.print(table)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def differing(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """How many requests' outputs differ from the reference run's."""
    return sum(a != b for a, b in zip(tokens, reference))


def lesson_main(main) -> None:
    """Run a lesson's main(). In an exercise's skeleton copy (make_exercise generate) the region
    not written yet raises NotImplementedError naming its exercise: say which exercise unlocks the
    lesson and exit 0, instead of a traceback from deep inside the engine. (The student edition
    has a working stub in every region: its lessons always run.)"""
    try:
        main()
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is an unwritten exercise
        missing = missing_exercise(exc)
        if missing is None:
            raise
        console.print(f"[yellow]This lesson needs exercise {missing['number']} ({escape(missing['part'])}), "
                      "which you have not written yet.[/]")
        console.print("It runs once that exercise passes (`python -m minisgl course exercises` lists them, "
                      "`python -m minisgl course exercise N` checks one).")
        sys.exit(0)


def parse_args(doc: str, delay_ms: float, extra=None) -> argparse.Namespace:
    """--quick and --delay-ms for every lesson; `extra(parser)` adds a lesson's own options."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (CI)")
    ap.add_argument("--delay-ms", type=float, default=delay_ms,
                    help=f"emulated device time per forward, ms (default {delay_ms:g}; CPU teaching aid)")
    if extra:
        extra(ap)
    return ap.parse_args()
