"""Building a planned batch: its id, its metadata in a staging buffer, the ForwardBatch the engine launches.

Planning never reads a token the host has not committed: an in-flight input id is a FutureMap placeholder."""

from __future__ import annotations

from itertools import accumulate

from .config import EngineConfig
from .engine import ForwardBatch
from .request import Req
from .seams import Features
from .staging import StagingRing, TokenColumns


class BatchBuilder:
    def __init__(self, config: EngineConfig) -> None:
        rows = config.max_running_requests
        self.staging = StagingRing(config.max_batch_tokens, rows, config.device, config.mechanisms)
        self.next_id = 0

    def build(self, reqs: list[Req], tokens: TokenColumns, qo_lens: list[int], kv_lens: list[int],
              is_prefill: bool, features: Features) -> ForwardBatch:
        batch_id = self.next_id
        self.next_id += 1
        params = [r.params for r in reqs]
        staging = self.staging.acquire()  # may wait: the write-after-read barrier
        staging.write(tokens, rows=[r.row for r in reqs], kv_lens=kv_lens,
                      qo_indptr=[0, *accumulate(qo_lens)], kv_indptr=[0, *accumulate(kv_lens)],
                      temperature=[p.temperature for p in params], top_p=[p.top_p for p in params],
                      top_k=[p.top_k for p in params], seeds=[r.sample_seed for r in reqs],
                      sample_steps=[r.next_sample_index for r in reqs])
        forward = ForwardBatch(batch_id, is_prefill, qo_lens, kv_lens, staging,
                               all_greedy=all(p.temperature == 0 for p in params))
        # The seams: with no grammar and no logprobs asked for, a batch never enters a feature.
        if any(p.grammar is not None for p in params):
            forward.delay_sample, forward.mask = features.grammar.plan(reqs)
        if any(p.logprobs is not None for p in params):
            # the rows and output indices fixed now, from the lengths at planning: the launch snapshot
            forward.logprobs = features.logprobs.plan(reqs, kv_lens)
        forward.device_step = features.speculation.prefill_step() if is_prefill and features.speculation else None
        return forward
