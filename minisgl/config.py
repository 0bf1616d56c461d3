"""The engine's defaults: what `LLM(...)` picks for every size it is not told.

One dataclass, so that every number the engine chooses on its own is in one place with the
reason for it. `LLM`'s keyword arguments override these per engine; an argument that is
given is checked (0 is an error, not "use the default").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class EngineDefaults:
    # Request-pool rows = the most requests decoding at once. A GPU decode step costs about
    # the same for 1 or 256 rows (it reads the weights once), so batch wide; on the CPU every
    # row costs compute, and 64 already saturates a laptop core.
    rows_cuda: int = 256
    rows_cpu: int = 64
    # Prompt tokens per prefill batch (chunked prefill): large on a GPU to fill it, small on the
    # CPU so that a long prompt does not stall the decodes behind it for long.
    chunk_size_cuda: int = 8192
    chunk_size_cpu: int = 512
    # KV pool on a GPU: this fraction of the memory free after loading the weights, minus a
    # headroom for activations, CUDA graphs and sampling (vocab-wide float32 rows per request).
    kv_memory_fraction: float = 0.8
    kv_headroom_bytes: int = 4 << 30
    # KV pool on the CPU: a fixed host-memory budget (a laptop shares it with everything else).
    kv_host_bytes: int = 2 << 30
    # Whatever the budget says, at least enough for a few demo requests, and at most what the
    # device tables index comfortably (slot ids are int32 in attention kernels).
    kv_tokens_min: int = 1024
    kv_tokens_max_cuda: int = 1 << 20
    kv_tokens_max_cpu: int = 65536

    def rows(self, device: torch.device) -> int:
        return self.rows_cuda if device.type == "cuda" else self.rows_cpu

    def chunk_size(self, device: torch.device) -> int:
        return self.chunk_size_cuda if device.type == "cuda" else self.chunk_size_cpu

    def kv_tokens(self, device: torch.device, bytes_per_token: int) -> int:
        """KV slots that fit the memory budget of `device`, clamped to [kv_tokens_min, max]."""
        if device.type == "cuda":
            budget = int(free_memory_bytes(device) * self.kv_memory_fraction) - self.kv_headroom_bytes
            cap = self.kv_tokens_max_cuda
        else:
            budget, cap = self.kv_host_bytes, self.kv_tokens_max_cpu
        return max(self.kv_tokens_min, min(budget // bytes_per_token, cap))


DEFAULTS = EngineDefaults()


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory an engine on `device` may still allocate: free GPU memory, or the host's
    MemAvailable on Linux; None where the host does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
