"""FutureMap: batch n publishes its sampled tokens by request-pool row, on the device, and batch
n+1 resolves its placeholder input ids from them, so the host never waits (lessons/readings §6).

Rows key it, not batch positions: a row is stable for a request's life. Stream order (publish of
n before resolve of n+1) is the only synchronisation needed."""

from __future__ import annotations

import torch


def placeholder(row: int) -> int:
    """The input id the scheduler writes for a token that is still in flight."""
    return -(row + 1)


class FutureMap:
    def __init__(self, max_running_requests: int, device: torch.device) -> None:
        # An unpublished row holds 0, a valid id: a missing publish shows as wrong tokens, not a crash.
        self.tokens = torch.zeros(max_running_requests, dtype=torch.int64, device=device)

    def publish(self, rows: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Runs on the engine stream right after sampling batch n."""
        # >>> exercise 2: publish
        self.tokens[rows] = next_tokens
        # <<< exercise 2

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Runs on the engine stream at the entry of batch n+1: placeholders become token ids."""
        # >>> exercise 2: resolve
        is_future = input_ids < 0
        rows = (-input_ids - 1).clamp(min=0)
        return torch.where(is_future, self.tokens[rows], input_ids)
        # <<< exercise 2
