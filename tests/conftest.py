"""Shared fixtures: tiny checkpoints written by the project's own `make_tiny` (no network)."""

from __future__ import annotations

import os
import shutil
import sys
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Container, Iterable, Iterator

import pytest
import torch

from minisgl import SamplingParams
from minisgl.frontend.cli import main as cli
from minisgl.demo.tiny import make_tiny

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)  # what the API tests ask of the shared engine

# Every scheduler step of every test audits KV slot, row and queue ownership (invariants.py).
# Tests that switch off a mechanism whose symptom is a leak turn it off for that engine.
os.environ.setdefault("MINISGL_CHECK_INVARIANTS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def tiered(cases: Iterable[tuple], fast: Container[tuple], id: Callable[[tuple], str] | None = None) -> list:
    """pytest parameters for `cases`: those in `fast` run in both tiers, the others only in the full
    tier (marked `full`: `make test` deselects them, `make test-all` runs everything)."""
    return [pytest.param(*case, id=id(case) if id else None, marks=() if case in fast else pytest.mark.full)
            for case in cases]


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Tests that press Ctrl-C (signal.raise_signal) need Python's own SIGINT handler. A shell
    that starts pytest in the background (`make test &`) hands it SIGINT ignored, and Python
    then installs none: every Ctrl-C test would fail with "DID NOT RAISE KeyboardInterrupt"."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    # init_std 0.1 rather than transformers' 0.02: sharper attention and logits, so that a
    # corrupted KV entry visibly changes tokens (the mechanism tests) and argmax ties are rare.
    return {arch: str(make_tiny(root / arch, arch, seed=7, init_std=0.1)) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def qwen3(tiny_models) -> str:
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def llm(qwen3):
    """One engine per test module, with a pool small enough that "too large" is easy to ask for."""
    from minisgl import LLM

    engine = LLM(qwen3, kv_tokens=600)
    yield engine
    engine.close()


def assert_pool_whole(llm) -> None:
    """After a drained workload every slot is free or cached, every row free; after flush all free."""
    mem = llm.memory_report()
    assert mem["kv_free"] + mem["kv_cached"] == mem["kv_total"], mem
    assert mem["rows_free"] == mem["rows_total"], mem
    llm.flush_cache()
    mem = llm.memory_report()
    assert mem["kv_free"] == mem["kv_total"], mem


def drain(llm) -> dict[int, object]:
    """Step until nothing is queued, running or uncollected; the outputs by request id."""
    outs = {}
    while llm.has_unfinished():
        outs.update({o.rid: o for o in llm.step()})
    return outs


@contextmanager
def no_thread_left_behind() -> Iterator[None]:
    """Fails if a thread started inside the block is still alive after it. Compares thread
    identities, not counts: a thread of an earlier test may end meanwhile."""
    before = set(threading.enumerate())
    yield
    for thread in [t for t in threading.enumerate() if t not in before]:
        # A worker that ran its own engine's finalizer (a collection can start on any thread)
        # cannot join itself: it ends right after. Leaked means still running seconds later.
        thread.join(timeout=5)
    left = [t.name for t in threading.enumerate() if t not in before]
    assert left == [], f"threads left behind: {left}"


def run_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """The CLI in-process: its exit code and its stderr lines (SystemExit from argparse included)."""
    try:
        code = cli(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


def assert_one_line_exit_2(capsys, *argv: str) -> None:
    code, err = run_cli(capsys, *argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), (code, err)


def copy_model(src: str, dst: Path) -> Path:
    """A checkpoint copy that a test may break."""
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def reference(llm) -> dict[str, list[int]]:
    """The module engine's greedy answers to two prompts, before a test disturbs it."""
    return {p: llm.generate([p], GREEDY)[0].token_ids for p in ("hello there", "count 1 to 9:")}
