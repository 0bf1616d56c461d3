"""Per-token logprobs: the chosen token's log-probability and the top-k alternatives.

Logprobs are those of the model's own distribution, log_softmax of the raw logits in float32:
before temperature, top-k/top-p and any grammar mask (a forbidden token keeps its logprob).

Which rows of a batch return logprobs, and which output token each one is (its index in the
request's output), are decided from the request lengths *at planning* (`plan_logprobs`) and
travel with the batch (ForwardBatch.logprobs -> ForwardResult.logprobs): the launch snapshot. Recomputed at commit from the live requests, as the switch `logprob_snapshot` off
does, they read lengths that the overlap loop's next schedule has already moved (batch n+1
launched one more position for every request it continues, including a request whose last
prefill chunk it launched): each logprob lands one token late (lessons/readings §17; SGLang
copies these lengths at launch in `run_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from ..request import Req

from ..sampling_params import TokenLogprob

if TYPE_CHECKING:
    from ..batch import BatchView, RunningBatch
    from ..engine import ForwardResult


def plan_logprobs(reqs: Sequence[Req], kv_lens: Sequence[int]) -> LogprobsPlan | None:
    """The rows of a batch whose sample returns logprobs (the request asked for them, and its
    length after this batch reaches its prompt: the batch samples an output token), with the
    output index each one samples. None when no row does."""
    rows = [i for i, (req, kv_len) in enumerate(zip(reqs, kv_lens))
            if req.params.logprobs is not None and kv_len >= req.prompt_len]
    if not rows:
        return None
    return LogprobsPlan(rows, [output_index(reqs[i], kv_lens[i]) for i in rows],
                        max(reqs[i].params.logprobs or 0 for i in rows))


def output_index(req: Req, kv_len: int) -> int:
    """Which output token a sample is: the request's length after the batch, minus its prompt."""
    return kv_len - req.prompt_len


@dataclass(frozen=True)
class LogprobsPlan:
    """Fixed at planning, carried by ForwardBatch: the launch snapshot."""

    rows: list[int]  # batch rows returning logprobs
    indices: list[int]  # the output index each of those rows samples
    k: int  # the largest top-k those rows asked for

    def allocate(self, pin: bool) -> LogprobsHost:
        return LogprobsHost.empty(self.rows, self.indices, self.k, pin)


def logprobs_by_row(view: BatchView | RunningBatch, result: ForwardResult, tokens: list[int],
                    snapshot: bool) -> dict[int, tuple[int, TokenLogprob]]:
    """At commit: batch row -> (output index, logprob). `snapshot` (the switch logprob_snapshot):
    the indices fixed at planning; off, recomputed from the live lengths, which the next schedule
    has already moved (batch n+1 launched one more position): each logprob lands one token late."""
    logprobs = result.logprobs
    indices = logprobs.indices if snapshot else [output_index(view.reqs[i], view.reqs[i].launched_len)
                                                 for i in logprobs.rows]
    return logprobs.by_row(tokens, [r.params.logprobs or 0 for r in view.reqs], indices)


@dataclass
class LogprobsHost:
    """A batch's logprobs on the host, valid after copy_done: one entry per row in `rows`."""

    rows: list[int]  # batch rows these belong to, fixed at planning
    indices: list[int]  # the output index of each row's token, from the lengths at planning (the snapshot)
    chosen: torch.Tensor  # [L] logprob of the sampled token
    top_ids: torch.Tensor  # [L, k]
    top_logprobs: torch.Tensor  # [L, k]

    @classmethod
    def empty(cls, rows: list[int], indices: list[int], k: int, pin: bool) -> "LogprobsHost":
        n = len(rows)
        return cls(rows, indices, torch.empty(n, dtype=torch.float32, pin_memory=pin),
                   torch.empty(n, k, dtype=torch.int64, pin_memory=pin),
                   torch.empty(n, k, dtype=torch.float32, pin_memory=pin))

    def copy_from_device(self, logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
                         non_blocking: bool) -> None:
        """Runs on the engine stream: logprobs of `rows` of the raw logits, then the copy to the host."""
        logprobs = logits[rows].float().log_softmax(dim=-1)
        self.chosen.copy_(logprobs.gather(1, tokens[rows, None])[:, 0], non_blocking=non_blocking)
        top = logprobs.topk(self.top_ids.shape[1], dim=-1)
        self.top_ids.copy_(top.indices, non_blocking=non_blocking)
        self.top_logprobs.copy_(top.values, non_blocking=non_blocking)

    def by_row(self, tokens: list[int], ks: list[int], indices: list[int]) -> dict[int, tuple[int, TokenLogprob]]:
        """Batch row -> (output index, TokenLogprob), at commit. `indices`: the output index of each
        entry: the launch snapshot (`self.indices`), or with logprob_snapshot off a recomputation."""
        chosen, top_ids, top_lps = self.chosen.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        return {row: (index, TokenLogprob(tokens[row], chosen[i], list(zip(top_ids[i][:ks[row]], top_lps[i][:ks[row]]))))
                for i, (row, index) in enumerate(zip(self.rows, indices))}


class LogprobsFeature:
    """The logprobs seam (`Features.logprobs`): the rows at planning, their values at commit."""

    plan = staticmethod(plan_logprobs)
    by_row = staticmethod(logprobs_by_row)
