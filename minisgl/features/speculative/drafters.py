"""The two drafters: K draft tokens per request, one chain (top-k 1), made on the device.

- `NgramDrafter` (SGLang's NGRAM): no model. It looks for the latest earlier occurrence of the
  request's last few tokens in its own history and proposes the tokens that followed it.
- `StandaloneDrafter` (SGLang's STANDALONE): a small language model with its own KV cache, indexed
  by the same slots as the target's (one request table for both). It prefills every prompt
  chunk the target prefills, then drafts K tokens one decode step at a time.

Both are deterministic, so a draft token's proposal probability is 1: the verify's rejection
sampling then accepts it with the target's probability (verify.py).
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from ...gpu.flashinfer_backend import FLASHINFER_MIN_HEAD_DIM, FlashInferBackend
from ...gpu.fused_ops import decoder_kernels
from ...models.attention import KVCache, TorchAttentionBackend, paged_metadata
from ...models.decoder import load_model

if TYPE_CHECKING:
    from ...engine import Engine, ForwardBatch
    from ...staging import DeviceInputs
    from .relay import SpecRelay

NGRAM_MAX = 3  # the longest suffix matched; shorter ones are tried when it does not occur


class NgramDrafter:
    def __init__(self, relay: SpecRelay, num_steps: int) -> None:
        self.relay, self.num_steps = relay, num_steps

    def prefill(self, engine: Engine, batch: ForwardBatch, inp: DeviceInputs, input_ids: torch.Tensor) -> None:
        pass  # the history is the relay's, written at every publish

    def draft(self, engine: Engine, batch: ForwardBatch, rows: torch.Tensor, lens: torch.Tensor,
              host_lens: list[int], bonus: torch.Tensor) -> torch.Tensor:
        """[B, K] drafts: the tokens after the latest earlier match of the last n tokens (bonus included)."""
        history = self.relay.history[rows]  # [B, W]; positions 0..lens hold ids (the bonus at lens)
        width, K = history.shape[1], self.num_steps
        drafts = bonus[:, None].expand(-1, K).clone()  # no match: repeat the bonus
        found = torch.zeros_like(bonus, dtype=torch.bool)
        for n in range(NGRAM_MAX, 0, -1):
            if width <= n:
                continue
            ends = lens  # the suffix is positions lens-n+1 .. lens
            suffix_pos = (ends[:, None] - n + 1 + torch.arange(n, device=rows.device)).clamp(min=0)
            suffix = history.gather(1, suffix_pos)  # [B, n]
            windows = history.unfold(1, n, 1)  # [B, W-n+1, n]: window j covers j .. j+n-1
            starts = torch.arange(windows.shape[1], device=rows.device)
            match = (windows == suffix[:, None, :]).all(-1) & (starts[None, :] + n - 1 < ends[:, None]) \
                & (ends[:, None] >= n - 1)
            last = torch.where(match, starts[None, :], -1).amax(1)  # latest earlier occurrence
            use = (last >= 0) & ~found
            follow = (last[:, None] + n + torch.arange(K, device=rows.device)).clamp(max=width - 1)
            proposed = history.gather(1, follow)
            # a follower past the request's last known position is unknown: repeat the last known one
            known = follow <= ends[:, None]
            proposed = torch.where(known, proposed, history.gather(1, ends[:, None].clamp(max=width - 1)))
            drafts = torch.where(use[:, None], proposed, drafts)
            found |= use
        return drafts

    def after_verify(self, engine: Engine, batch: ForwardBatch, rows: torch.Tensor, lens: torch.Tensor,
                     host_lens: list[int], last_draft: torch.Tensor) -> None:
        pass


class StandaloneDrafter:
    def __init__(self, engine: Engine, path: Path, num_steps: int) -> None:
        config = engine.config
        self.model = load_model(path, config.dtype, config.device)[0]
        # The target's fused GPU kernels, not the torch reference: on CUDA the reference is several
        # launches per RMSNorm, rotary and SiLU step, and a draft runs K + 1 eager forwards a cycle.
        self.model.kernels = decoder_kernels(config.device, config.dtype, config.fused_kernels)
        if self.model.vocab_size != engine.model.vocab_size:
            raise ValueError(f"the draft model {str(path)!r} has a vocabulary of {self.model.vocab_size}, "
                             f"the target {engine.model.vocab_size}: they must share one tokenizer")
        m = self.model
        self.kv = KVCache(m.num_layers, engine.kv_pool.num_slots, m.num_kv_heads, m.head_dim, config.dtype,
                          config.device)
        self.num_steps = num_steps
        self.backend = self._attention_backend(engine)

    def _attention_backend(self, engine: Engine) -> FlashInferBackend | TorchAttentionBackend:
        """FlashInfer where the target runs it and the draft's heads fit its kernels, else the torch
        reference (on CUDA: K/V gathered, padded and cast to float32, many launches a layer)."""
        if isinstance(engine.backend, FlashInferBackend) and self.model.head_dim >= FLASHINFER_MIN_HEAD_DIM:
            # A set of plan buffers per forward of a batch (the K steps, the one after the verify)
            # and parity: the host plans all of them before the device has run the first, so two
            # forwards sharing a set would rewrite its pinned plan before the upload read it.
            return engine.flashinfer_backend(self.model, plan_sets=2 * (self.num_steps + 1))
        return TorchAttentionBackend(deterministic=engine.config.deterministic)

    def _plan_set(self, batch: ForwardBatch, forward: int) -> int:
        """The plan buffers of the batch's forward number `forward` (0..K; a prefill: 0)."""
        return batch.batch_id % 2 * (self.num_steps + 1) + forward

    def prefill(self, engine: Engine, batch: ForwardBatch, inp: DeviceInputs, input_ids: torch.Tensor) -> None:
        """The draft model's KV for a prompt chunk: the target's metadata, the draft's cache."""
        meta = paged_metadata(batch.qo_lens, batch.kv_lens, batch.is_prefill, inp, engine.req_to_token.table)
        self.backend.plan(meta, self._plan_set(batch, 0))
        self.model(input_ids, meta, self.kv, self.backend)

    def _step(self, engine: Engine, ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
              kv_lens: list[int], plan_set: int) -> torch.Tensor:
        """One draft decode step: token ids at positions (device), `kv_lens` on the host."""
        table = engine.req_to_token.table
        positions = positions.clamp(max=table.shape[1] - 1)
        B, device = len(kv_lens), rows.device
        # The offsets go up through pinned memory (engine._to_device): torch.tensor(..., device=cuda)
        # copies from pageable memory and waits for the stream, i.e. for every draft step queued so
        # far, which would serialize the host's launches with the device's work at every step.
        inp = SimpleNamespace(rows=rows, positions=positions, out_slots=table[rows, positions],
                              qo_indptr=torch.arange(B + 1, device=device),
                              kv_indptr=engine._to_device([0, *accumulate(kv_lens)]))
        meta = paged_metadata([1] * B, kv_lens, False, inp, table)
        self.backend.plan(meta, plan_set)
        return self.model(ids, meta, self.kv, self.backend).argmax(-1)

    def draft(self, engine: Engine, batch: ForwardBatch, rows: torch.Tensor, lens: torch.Tensor,
              host_lens: list[int], bonus: torch.Tensor) -> torch.Tensor:
        """K decode steps of the draft model from the bonus token at position `lens`."""
        drafts, token = [], bonus
        for j in range(self.num_steps):
            token = self._step(engine, token, rows, lens + j, [n + j + 1 for n in host_lens], self._plan_set(batch, j))
            drafts.append(token)
        return torch.stack(drafts, 1)

    def after_verify(self, engine: Engine, batch: ForwardBatch, rows: torch.Tensor, lens: torch.Tensor,
                     host_lens: list[int], last_draft: torch.Tensor) -> None:
        """The draft's KV for the last draft token (position lens + K), needed when all K are
        accepted: the next chain starts after it (SGLang: the draft extend after the publish)."""
        K = self.num_steps
        self._step(engine, last_draft, rows, lens + K, [n + K + 1 for n in host_lens], self._plan_set(batch, K))
