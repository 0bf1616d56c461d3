"""FutureMap: the next token of every running request, relayed on the device.

Batch n+1's input ids are batch n's sampled tokens. Waiting for them on the host would
bring the bubble back, so (lessons/readings §6, future tokens):

- batch n *publishes* its sampled tokens into `tokens[row]` on the engine stream;
- the scheduler, still ignorant of the values, writes the placeholder `-(row + 1)` as the
  input id of each decode token whose value is not committed yet;
- batch n+1 *resolves* the placeholders at forward entry by gathering `tokens[row]`.

The key is the request-pool row, not the position in the batch: rows are stable for a
request's whole life while batch positions change every step (filter, merge).
Stream order (publish of n runs before resolve of n+1) is the only synchronisation needed.
"""

from __future__ import annotations

import torch


def placeholder(row: int) -> int:
    """The input id the scheduler writes for a token that is still in flight."""
    return -(row + 1)


class FutureMap:
    def __init__(self, max_running_requests: int, device: torch.device) -> None:
        # One entry per request-pool row. A row nobody published yet holds 0: a valid id, so a missing
        # publish (or a batch that read another batch's metadata) shows up as wrong tokens, not a crash.
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
