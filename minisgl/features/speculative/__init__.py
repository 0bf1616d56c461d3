"""Speculative decoding under both loops, the way SGLang's Spec V2 runs it (lesson 12).

A decode step becomes a *verify* step: per request, the bonus token and K draft tokens go
through the target in one forward, and 1 to K+1 of them are accepted. One step is no longer
one token, and in the overlap loop batch n+1 is planned before batch n's accept lengths exist.
What makes that safe, each a switch in minisgl/mechanisms.py:

- KV for the most a step can accept (`spec_alloc_reserve`): batch n+1 is given slots up to two
  steps past the host's committed length, since batch n may still add K+1 positions;
- positions and lengths resolve on the device from the relay (relay.py), and the host reads its
  mirror of the lengths only after their publish event (`spec_publish_wait`);
- the commit takes the accepted run, cut at a stop token, EOS or max_new_tokens inside it; the
  rejected positions' slots stay with the request, the next verify writes them again, and the
  release gives back everything past the committed KV (`release_allocated`).

`SpeculativeDecoding` is the seam the scheduler asks (`Features.speculation`): `prefill_step`
for each prefill batch, `plan_decode` in place of the plain decode step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...batch import BatchView, Planned
from ...demo.paths import DEMO_DRAFT_DIR
from ...future_map import placeholder
from ...sampling_params import SPECULATIVE_WHY, speculative_refuses
from ...staging import TokenColumns
from .drafters import NgramDrafter, StandaloneDrafter
from .relay import SpecRelay
from .verify import PrefillStep, VerifyStep

if TYPE_CHECKING:
    from ...engine import ForwardResult
    from ...request import Req
    from ...sampling_params import SamplingParams
    from ...scheduler import Scheduler


class SpeculativeDecoding:
    def __init__(self, sched: Scheduler) -> None:
        config = sched.config
        self.sched = sched
        self.num_steps = K = config.speculative_num_steps
        self.mechanisms = sched.mechanisms
        self.relay = SpecRelay(config.max_running_requests, config.table_width, config.device, sched.mechanisms)
        if config.speculative_algorithm == "ngram":
            self.drafter: NgramDrafter | StandaloneDrafter = NgramDrafter(self.relay, K)
        else:
            # the config checked that only the demo model goes without a draft path
            path = config.speculative_draft_model_path or DEMO_DRAFT_DIR
            self.drafter = StandaloneDrafter(sched.engine, path, K)
        self.verifying: dict[int, VerifyStep] = {}  # launched verify steps by batch id, until their commit
        self.accept_lengths: deque[list[int]] = deque(maxlen=256)  # per committed verify batch, per row
        self.unallocated_writes = 0  # verify rows that wrote past their request's slots (spec_alloc_reserve off)

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.on(mechanism)

    @staticmethod
    def check_params(params: SamplingParams) -> None:
        """What a verify step cannot do yet is refused at add(), with one clear error."""
        if speculative_refuses(params.grammar, params.logprobs) is not None:
            raise ValueError(f"speculative decoding in minisgl takes no grammar and no logprobs: {SPECULATIVE_WHY}; "
                             f"leave speculative_algorithm=None for such requests")

    def prefill_step(self) -> PrefillStep:
        return PrefillStep(self.sched.engine, self.relay, self.drafter, self.relay.next_publish())

    def step_need(self, reqs: list[Req]) -> int:
        """KV slots the next verify step of `reqs` may allocate (what retraction must find)."""
        return sum(max(0, self._slots_wanted(r) - r.allocated_len) for r in reqs)

    def _slots_wanted(self, req: Req) -> int:
        # The host's committed length lags the device by the verify in flight (up to K+1
        # positions), and the step planned now writes K+1 more from wherever that one ended.
        # >>> exercise 11: allocate for the most a step can accept
        width = self.num_steps + 1
        reserve = 2 * width if self.on("spec_alloc_reserve") else width
        return max(req.kv_committed_len, req.prefill_len) + reserve
        # <<< exercise 11

    def plan_decode(self, sched: Scheduler) -> Planned:
        """A verify batch of every running request: K+1 tokens each, positions resolved later."""
        reqs, K = list(sched.running.reqs), self.num_steps
        sched.stats.overshoot_steps += sum(r.will_finish_by_length() for r in reqs)
        fills: tuple[list[int], list[int], list[int]] = ([], [], [])
        for req in reqs:
            start, want = req.allocated_len, self._slots_wanted(req)
            if want > start:
                slots = sched.kv_ledger.allocate(req, want - start)
                fills[0].extend([req.row] * len(slots))
                fills[1].extend(range(start, want))
                fills[2].extend(slots)
            req.inflight_samples += 1
        rows = [r.row for r in reqs]
        pinned = sched.device.type == "cuda" and self.on("pinned_copy")
        lens = self.relay.host_lengths(rows)  # SGLang's resolve_seq_lens_cpu: after the publish event
        tokens = TokenColumns()
        for req, n in zip(reqs, lens):
            if n + K + 1 > req.allocated_len:  # the verify writes positions no slot was given for
                self.unallocated_writes += 1
            slots = (req.slot_ids[n:n + K + 1] + [0] * (K + 1))[:K + 1]  # the host's guess; the device reads the table
            tokens.add(req.row, [placeholder(req.row)] + [0] * K, n, slots)
            req.launched_len = max(req.launched_len, n + K + 1)
        sched.stats.decode_batches += 1
        sched.stats.decode_rows += len(reqs)
        forward = sched.batch_builder.build(reqs, tokens, [K + 1] * len(reqs), [n + K + 1 for n in lens], False,
                                            sched.features)
        step = VerifyStep(sched.engine, self.relay, self.drafter, self.relay.next_publish(), K, lens,
                          [r.prompt_len for r in reqs],
                          fills, torch.empty(len(reqs), K + 2, dtype=torch.int64, pin_memory=pinned))
        forward.device_step = self.verifying[forward.batch_id] = step
        view = BatchView(forward.batch_id, False, reqs, rows, [r.row_generation for r in reqs], [True] * len(reqs),
                         [K + 1] * len(reqs))
        return Planned(forward, view)

    def accepted(self, view: BatchView, result: ForwardResult) -> tuple[BatchView, ForwardResult]:
        """A verify batch's result as the commit reads it: each accepted token one row, of one
        position, so the commit's checks (a retracted or recycled row, a finished request) and its
        stop at a stop token, EOS or max_new_tokens apply token by token, and the rejected drafts'
        positions are never committed. (Result layout per row: accept length, then K+1 tokens.)"""
        flat, width = self.verifying.pop(view.batch_id).runs_host.reshape(-1).tolist(), self.num_steps + 2
        reqs, rows, generations, qo_lens, tokens = [], [], [], [], []
        self.accept_lengths.append([flat[i * width] for i in range(len(view.reqs))])
        for i, (req, row, generation) in enumerate(zip(view.reqs, view.rows, view.generations)):
            run = flat[i * width + 1:i * width + 1 + flat[i * width]]
            self.sched.stats.spec_verify_rows += 1
            self.sched.stats.spec_accepted_tokens += len(run)
            if (req.row, req.row_generation) == (row, generation):
                req.inflight_samples += len(run) - 1  # one step launched, len(run) samples committed
            # a position past the request's slots (spec_alloc_reserve off) holds no KV of its own
            written = [int(req.kv_committed_len + j < req.allocated_len) for j in range(len(run))]
            reqs += [req] * len(run)
            rows += [row] * len(run)
            generations += [generation] * len(run)
            qo_lens += written
            tokens += run
        expanded = BatchView(view.batch_id, False, reqs, rows, generations, [True] * len(reqs), qo_lens)
        return expanded, replace(result, next_tokens_host=torch.tensor(tokens, dtype=torch.int64))
