"""The device side of speculation: a prefill step and a verify step, each run in place of the
engine's forward and sampling (ForwardBatch.device_step).

A verify step, for B requests with K drafts each (SGLang: draft, verify, publish, draft extend):

1. the newly allocated KV slots enter the request table;
2. positions and KV slots come from the relay's lengths, on the device (`resolve_positions`);
3. the drafter proposes K tokens after the bonus token (the last sampled one);
4. one target forward over [bonus, d1..dK] gives the target's token after each of them;
5. accept: the longest run of drafts equal to the target's tokens, then the target's token
   after it (the new bonus): 1 to K+1 tokens;
6. publish the new lengths and bonus tokens, then the event the next plan waits for;
7. the drafter's own work for the next step, and the copy of (accept length, tokens) to the host
   (`runs_host`, the step's own buffer; the result's tokens are the new bonus tokens).

The host only queues this work: nothing in a step reads the device (no `.item()`, no masked
index, whose nonzero() reads a count back, no copy from pageable memory or index on the host). On
CUDA each such read makes the host wait for everything queued so far, in the middle of launching
the K + 1 draft forwards and the verify: host and device would take turns instead of overlapping.
The host reads the device only at the publish wait (relay.py) and at the commit (copy_done).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...models.attention import paged_metadata
from ...models.sampler import uniform_noise
from .relay import PublishEvent, SpecRelay

if TYPE_CHECKING:
    from ...engine import Engine, ForwardBatch
    from ...staging import DeviceInputs

_COIN_SEED = 0x5BD1E995  # the acceptance coins' hash stream, apart from the sampler's noise


def target_logits(engine: Engine, batch: ForwardBatch, inp: DeviceInputs, input_ids: torch.Tensor,
                  every_position: bool) -> torch.Tensor:
    """The target model's forward, eagerly (a verify is no decode step a CUDA graph holds): the
    logits of each request's last new token, or with `every_position` of every new token."""
    table = engine.req_to_token.table
    table[inp.token_rows, inp.positions] = inp.out_slots  # the positions' slots enter the table, in stream order
    meta = paged_metadata(batch.qo_lens, batch.kv_lens, batch.is_prefill, inp, table)
    engine.backend.plan(meta, batch.batch_id % 2)
    return engine.model(input_ids, meta, engine.kv, engine.backend, every_position)


def accept_greedy(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B] accept lengths: the drafts equal to the target's token before them, up to the first
    that differs, plus the target's own token after them (the bonus). drafts [B, K], target [B, K+1]."""
    # >>> exercise 11: the accept length
    agree = (drafts == target[:, :-1]).long()
    return agree.cumprod(1).sum(1) + 1
    # <<< exercise 11


def verify_sample(logits: torch.Tensor, drafts: torch.Tensor, inp: DeviceInputs, steps: torch.Tensor,
                  all_greedy: bool) -> torch.Tensor:
    """[B, K+1] the target's token at each verify position. Greedy rows: the argmax. Sampled rows:
    rejection sampling against the (deterministic) draft: draft i+1 stays with the target's
    probability of it; where it does not, the token is drawn from the target's distribution
    without it; that keeps the target's distribution exactly. `steps` [B, K+1]: output indices,
    the seeded sampler's steps."""
    B, width, vocab = logits.shape
    flat = logits.reshape(B * width, vocab)
    if all_greedy:
        return flat.argmax(-1).view(B, width)
    per_pos = {name: getattr(inp, name).repeat_interleave(width) for name in ("temperature", "top_k", "top_p", "seeds")}
    sampled_rows = per_pos["temperature"] > 0
    probs = _target_probs(flat.float(), per_pos)  # [B*width, V], top-k/top-p applied
    proposal = torch.cat([drafts, drafts[:, -1:]], 1).reshape(-1)  # the last position has no draft
    has_draft = torch.ones(B, width, dtype=torch.bool, device=flat.device)
    has_draft[:, -1] = False
    has_draft = has_draft.reshape(-1)
    coin = uniform_noise(per_pos["seeds"] ^ _COIN_SEED, steps.reshape(-1), 1)[:, 0]
    keep = has_draft & (coin < probs.gather(1, proposal[:, None])[:, 0])
    # a rejected draft: sample the rest of the distribution (the draft's probability moved to 0)
    rest = probs.clone()
    every = torch.arange(rest.shape[0], device=rest.device)  # a host index would be copied up, the host waiting
    rest[every, proposal] = torch.where(has_draft, 0.0, rest[every, proposal])
    gumbel = -torch.log(-torch.log(uniform_noise(per_pos["seeds"], steps.reshape(-1), vocab)))
    drawn = (rest.clamp_min(1e-30).log() + gumbel).masked_fill(rest <= 0, float("-inf")).argmax(-1)
    tokens = torch.where(keep, proposal, drawn)
    greedy = flat.argmax(-1)
    return torch.where(sampled_rows, tokens, greedy).view(B, width)


def _target_probs(logits: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sampler's distribution (temperature, top-k, top-p: models/sampler.py) as probabilities."""
    scaled = logits / p["temperature"].clamp(min=1e-6)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=logits.device)[None, :]
    keep_sorted = (p["top_k"][:, None] < 0) | (ranks < p["top_k"][:, None])
    probs = sorted_logits.softmax(dim=-1)
    keep_sorted &= (probs.cumsum(dim=-1) - probs) < p["top_p"][:, None]
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf")).softmax(-1)


@dataclass
class PrefillStep:
    """A prefill batch under speculation: the plain forward and sampling, then the drafter's prefill,
    the history and the lengths published (the first verify reads them)."""

    engine: Engine
    relay: SpecRelay
    drafter: Any
    event: PublishEvent

    def _forward_and_sample(self, batch: ForwardBatch, inp: DeviceInputs, next_tokens: torch.Tensor,
                            next_tokens_host: torch.Tensor, logprobs: Any, held: Any) -> None:
        """Runs on the engine stream in place of Engine._forward_and_sample (no logprobs, no delayed sampling)."""
        engine = self.engine
        try:
            input_ids = engine.future_map.resolve(inp.input_ids)
            logits = target_logits(engine, batch, inp, input_ids, every_position=False)
            self.drafter.prefill(engine, batch, inp, input_ids)
            engine.sample(batch, inp, logits, None, next_tokens, next_tokens_host, None)
            self.relay.record_tokens(inp.token_rows, inp.positions, input_ids)
            self.relay.record_tokens(inp.rows, inp.kv_lens, next_tokens)  # the sampled token, at its position
            self.relay.publish(inp.rows, inp.kv_lens, self.event)
        finally:
            self.event.record()  # a failed step still lets the host go on (the error surfaces at copy_done)


@dataclass
class VerifyStep:
    engine: Engine
    relay: SpecRelay
    drafter: Any
    event: PublishEvent
    num_steps: int
    host_lens: list[int]  # each row's length as the host resolved it (the attention metadata's)
    prompt_lens: list[int]  # output index = position + 1 - prompt length (the seeded sampler's step)
    fills: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))  # new slots
    # per row: the accept length, then the target's K+1 tokens; valid after the batch's copy_done
    runs_host: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    def _forward_and_sample(self, batch: ForwardBatch, inp: DeviceInputs, next_tokens: torch.Tensor,
                            next_tokens_host: torch.Tensor, logprobs: Any, held: Any) -> None:
        """Runs on the engine stream in place of Engine._forward_and_sample (no logprobs, no delayed sampling)."""
        try:
            self._run(self.engine, batch, inp, next_tokens, next_tokens_host)
        finally:
            self.event.record()

    def _run(self, engine: Engine, batch: ForwardBatch, inp: DeviceInputs, next_tokens: torch.Tensor,
             next_tokens_host: torch.Tensor) -> None:
        K, table, relay = self.num_steps, engine.req_to_token.table, self.relay
        rows, B = inp.rows, batch.num_reqs
        fill_rows, fill_positions, fill_slots = (engine._to_device(x) for x in self.fills)
        table[fill_rows, fill_positions] = fill_slots
        positions = relay.resolve_positions(rows, K + 1).clamp(max=table.shape[1] - 1)  # [B, K+1]
        lens = positions[:, 0]
        inp.positions = positions.reshape(-1)
        inp.out_slots = table[inp.token_rows, inp.positions]
        bonus = engine.future_map.tokens[rows]
        drafts = self.drafter.draft(engine, batch, rows, lens, self.host_lens, bonus)  # [B, K]
        ids = torch.cat([bonus[:, None], drafts], 1)
        logits = target_logits(engine, batch, inp, ids.reshape(-1), every_position=True).view(B, K + 1, -1)
        steps = positions + 1 - engine._to_device(self.prompt_lens)[:, None]
        target = verify_sample(logits, drafts, inp, steps, batch.all_greedy)
        accept = accept_greedy(drafts, target)  # [B] 1..K+1
        new_bonus = target.gather(1, (accept - 1)[:, None])[:, 0]
        engine.future_map.publish(rows, new_bonus)
        relay.record_tokens(inp.token_rows, inp.positions, ids.reshape(-1))
        relay.record_tokens(rows, lens + accept, new_bonus)
        relay.publish(rows, lens + accept, self.event)
        self.drafter.after_verify(engine, batch, rows, lens, self.host_lens, drafts[:, -1])
        non_blocking = engine.mechanisms.on("pinned_copy")
        next_tokens.copy_(new_bonus)
        next_tokens_host.copy_(new_bonus, non_blocking=non_blocking)
        self.runs_host.copy_(torch.cat([accept[:, None], target], 1), non_blocking=non_blocking)
