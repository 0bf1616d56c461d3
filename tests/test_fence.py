"""The fence around the lesson core: a plain step runs only lesson-core code.

A plain step is one scheduler step with reserve admission, no grammar, no logprobs and no
speculation. Every Python function it calls, on the host thread and on the CPU stream's worker
thread, is recorded; the modules they live in must all be lesson-core modules (the top of
minisgl/, plus models/ for the forward), never a feature, and the package modules a reader
follows (all but models/, the plain-torch forward) must stay short enough to read in a sitting.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams

PACKAGE = Path(__file__).resolve().parents[1] / "minisgl"
# The lines a reader follows through one plain step (the model's forward apart).
MAX_PLAIN_STEP_LINES = 2200


def modules_of_steps(llm: LLM, steps: int) -> set[Path]:
    """The minisgl source files whose functions run during `steps` scheduler steps, on both threads."""
    files: set[Path] = set()

    def record(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            files.add(path.relative_to(PACKAGE))

    stream = llm.engine.stream
    stream.launch(lambda: sys.setprofile(record))  # the CPU "device" is a worker thread
    sys.setprofile(record)
    try:
        for _ in range(steps):
            llm.scheduler.step()
    finally:
        sys.setprofile(None)
        stream.launch(lambda: sys.setprofile(None))
        stream.synchronize()
    return files


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_plain_step_enters_no_feature_and_stays_short(qwen3, loop):
    llm = LLM(qwen3, loop=loop, device="cpu")
    llm.scheduler.check_each_step = False  # the tests' audit after every step is no part of a step
    for i in range(3):
        llm.add_request([3, 4, 5 + i] * 4, SamplingParams(max_new_tokens=6))
    files = modules_of_steps(llm, steps=4)  # prefills, then decodes (with one batch in flight when overlapping)
    while llm.has_unfinished():
        llm.step()
    llm.close()
    assert Path("scheduler.py") in files and Path("kv_ledger.py") in files  # the recorder saw the step
    features = sorted(str(f) for f in files if f.parts[0] == "features")
    assert not features, f"a plain step entered feature modules: {features}"
    read = {f: len((PACKAGE / f).read_text().splitlines()) for f in files if f.parts[0] != "models"}
    assert sum(read.values()) <= MAX_PLAIN_STEP_LINES, sorted(read.items(), key=lambda kv: -kv[1])


def test_each_feature_is_entered_when_asked_for(qwen3):
    """The same recorder does see the features: a grammar, logprobs and optimistic admission."""
    from minisgl.features.grammar import Grammar

    llm = LLM(qwen3, admission="optimistic", device="cpu")
    llm.add_request([3, 4, 5], SamplingParams(max_new_tokens=4, logprobs=2,
                                              grammar=Grammar({0: {7: 1, 8: 1}, 1: {}})))
    files = modules_of_steps(llm, steps=3)
    while llm.has_unfinished():
        llm.step()
    llm.close()
    assert {Path("features/grammar.py"), Path("features/logprobs.py"), Path("features/retraction.py")} <= files
