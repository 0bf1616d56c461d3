"""The C library's allocator, set once per process for the CPU engine's tensors.

glibc hands each freed block above its mmap threshold straight back to the kernel, so the next
tensor of that size is built on fresh pages that the kernel zeroes on first touch. The threshold
rises by itself as such blocks are freed, but slowly: a process's first CPU engine paid a page
fault per page of its attention tensors for most of a run, and every later engine in the same
process ran without them (benchmarks/RESULTS.md, the CPU allocator row). A server starts one
engine per process, so every server paid it. Fixed thresholds keep freed blocks for reuse
from the first step. Other C libraries (macOS, Windows) are left as they are.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # where the self-raising threshold stops on 64-bit; larger blocks still use mmap
TRIM_THRESHOLD_BYTES = 256 << 20  # free memory at the heap's top kept before it is given back


def keep_freed_blocks() -> None:
    """Set glibc's thresholds in this process (again: the same); nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # this process's C library
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
