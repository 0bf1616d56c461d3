"""The CPU engine's allocator setting (minisgl/host_memory.py): freed tensor memory is reused.

Each case runs in a fresh process, since the setting is process-wide and cannot be undone. With
glibc's own self-raising threshold a first engine's decode steps build their attention tensors
on fresh pages, each faulted in and zeroed by the kernel; with the engine's fixed thresholds
the pages are reused."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc setting: Linux only")

PROBE = """
import resource, sys
from minisgl import LLM, SamplingParams, host_memory
from minisgl.observe.bench import offline_workload
if sys.argv[2] == "off":
    host_memory.keep_freed_blocks = lambda: None  # the mechanism switched off: glibc's defaults
with LLM(sys.argv[1], loop="overlap") as llm:
    work = offline_workload(16, llm.engine.model.vocab_size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(work.prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(model: str, setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, model, setting], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_first_engine_reuses_freed_memory(qwen3):
    kept, glibc_default = page_faults(qwen3, "on"), page_faults(qwen3, "off")
    assert kept * 4 < glibc_default, (
        f"the first engine in a process took {kept} page faults with the allocator setting and "
        f"{glibc_default} without: freed tensor memory is not being reused")
