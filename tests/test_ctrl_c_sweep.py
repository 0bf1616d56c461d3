"""A Ctrl-C at every executed line of the public calls: nothing leaks, nothing is lost.

One scenario uses every public call that moves state (LLM(), add_request, step, generate,
flush_cache, close). It runs once to count the line events that the main thread executes in
minisgl's front end and core modules; then once per injection point k, with a trace function
that sends this process a real SIGINT at the k-th line event. The KeyboardInterrupt then lands
where a user's Ctrl-C would, and the handler minisgl holds back (or not) decides its fate. The
scenario retries an interrupted call, as a user would, and afterwards checks: every request
whose id the caller got has its one output with the reference tokens (none lost, none under an
unknown id), the pool is whole after a flush, the invariants hold, the lock is free for another
thread, close() finished and no worker thread is left. The fast tier runs an even sample of 12
points per loop; the full tier (CI) every 16th line, about 420 points per loop at about 0.4 s
each; MINISGL_SWEEP_STRIDE=1 runs every line (about 13,500 points, 1.5 hours on 2 cores).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams

from .conftest import no_thread_left_behind

PACKAGE = Path(__file__).resolve().parents[1] / "minisgl"
TRACED = (str(PACKAGE / "frontend"), *(str(p) for p in PACKAGE.glob("*.py")))  # front end and core
PARAMS = SamplingParams(max_new_tokens=3, ignore_eos=True)
FAST_SAMPLE = 12  # injection points per loop in the fast tier
# every FULL_STRIDE-th line event in the full tier (1: every line), from line event FULL_START
# (two processes with stride 2 and starts 1 and 2 share the every-line sweep)
FULL_STRIDE = int(os.environ.get("MINISGL_SWEEP_STRIDE", "16"))
FULL_START = int(os.environ.get("MINISGL_SWEEP_START", "1"))


def retry(call):
    """Call until it completes: an interrupted public call left no trace, so calling again is right."""
    while True:
        try:
            return call()
        except KeyboardInterrupt:
            continue


def scenario(model: str, loop: str) -> dict:
    llm = retry(lambda: LLM(model, loop=loop, chunk_size=4, kv_tokens=64))
    rids = [retry(lambda: llm.add_request("hello there", PARAMS))]
    outs = {}
    while True:  # a step() loop, interrupted anywhere, resumed
        try:
            if not llm.has_unfinished():
                break
            outs.update({o.rid: o.token_ids for o in llm.step()})
        except KeyboardInterrupt:
            continue
    generated = retry(lambda: llm.generate(["count 1 to"], PARAMS))
    while retry(llm.has_unfinished):  # an interrupted generate() left aborted requests to drain
        try:
            outs.update({o.rid: o.token_ids for o in llm.step()})
        except KeyboardInterrupt:
            continue
    retry(llm.flush_cache)
    mem = retry(llm.memory_report)
    retry(llm.check_invariants)
    guard_free = run_in_thread(lambda: llm.memory_report() == mem)  # "in use" if the lock stayed held
    retry(llm.close)
    return {"outs": {r: outs.get(r) for r in rids}, "unknown": sorted(set(outs) - set(rids)),
            "generated": [o.token_ids for o in generated], "mem": mem, "guard_free": guard_free,
            "closed": llm._closed, "engine_closed": llm.engine.closed}


def run_in_thread(fn):
    box: list = []

    def target():
        try:
            box.append(fn())
        except RuntimeError as exc:
            box.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return box[0]


def traced(model: str, loop: str, inject_at: int | None, files: tuple[str, ...] = TRACED) -> tuple[dict, int]:
    """Run the scenario, counting the line events of `files`; SIGINT at the `inject_at`-th.
    Returns (facts, count)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count == inject_at:
                signal.raise_signal(signal.SIGINT)
        return local

    def on_call(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(files) else None

    sys.settrace(on_call)
    try:
        facts = scenario(model, loop)
    finally:
        sys.settrace(None)
    return facts, count


@pytest.fixture(scope="module")
def baselines(qwen3):
    return {loop: traced(qwen3, loop, None) for loop in ("normal", "overlap")}


def check(facts: dict, reference: dict, where: str) -> None:
    assert facts["outs"] == reference["outs"] and None not in facts["outs"].values(), where  # none lost
    assert facts["unknown"] == [], where  # no output under an id the caller never got
    assert facts["generated"] == reference["generated"], where
    mem = facts["mem"]
    assert mem["kv_free"] == mem["kv_total"] and mem["rows_free"] == mem["rows_total"], (where, mem)
    assert facts["guard_free"] is True, (where, facts["guard_free"])
    assert facts["closed"] and facts["engine_closed"], where


def sweep(qwen3, baselines, loop: str, points) -> None:
    """Inject at each point; every failing point is reported, not only the first."""
    reference, total = baselines[loop]
    failures = []
    for k in points:
        where = f"{loop}: Ctrl-C at line event {k} of {total}"
        try:
            with no_thread_left_behind():
                facts, _ = traced(qwen3, loop, k)
            check(facts, reference, where)
        except AssertionError as exc:
            failures.append(f"{where}: {exc}")
    print(f"{loop}: {len(points)} injection points of {total} line events, {len(failures)} failed")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_ctrl_c_sample_of_lines(qwen3, baselines, loop):
    total = baselines[loop][1]
    sweep(qwen3, baselines, loop, range(1, total + 1, max(1, total // FAST_SAMPLE)))


@pytest.mark.full
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_ctrl_c_at_every_stride_th_line(qwen3, baselines, loop):
    sweep(qwen3, baselines, loop, range(FULL_START, baselines[loop][1] + 1, FULL_STRIDE))


GUARD = (str(PACKAGE / "frontend" / "guard.py"), str(PACKAGE / "interrupts.py"))


@pytest.mark.full
def test_ctrl_c_at_every_line_of_the_call_guard(qwen3):
    """Every line event of the per-call guard and the deferral, in every public call of the
    scenario (about 1,000 points). The guard's last lines are where a call has completed and
    the handler is back: a Ctrl-C there once lost a queued request's id and a step's outputs."""
    reference, _ = traced(qwen3, "normal", None)
    _, total = traced(qwen3, "normal", None, GUARD)
    for k in range(1, total + 1):
        with no_thread_left_behind():
            facts, _ = traced(qwen3, "normal", k, GUARD)
        check(facts, reference, f"Ctrl-C at guard line event {k} of {total}")
