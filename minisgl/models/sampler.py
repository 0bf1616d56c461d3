"""Sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Randomness comes from a counter-based hash of (seed, output step, vocabulary id), not from
a shared generator. So a request's tokens depend only on its own seed and logits, never on
which other requests share the batch or in which order they ran: that is what lets
`overlap` and `normal` (whose batches differ) produce identical seeded samples.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


_K_SEED, _K_STEP, _K_VOCAB = (_signed(0x9E3779B97F4A7C15), _signed(0xC2B2AE3D27D4EB4F),
                              _signed(0x165667B19E3779F9))
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from a splitmix64-style hash; int64 products wrap around."""
    vocab_ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _K_SEED + steps[:, None] * _K_STEP + vocab_ids[None, :] * _K_VOCAB
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    mantissa = _shr(x, 11).to(torch.float64)  # 53 random bits
    return ((mantissa + 0.5) / float(1 << 53)).to(torch.float32)


def apply_token_mask(logits: torch.Tensor, constrained_rows: torch.Tensor, mask_rows: torch.Tensor,
                     mask_tokens: torch.Tensor) -> torch.Tensor:
    """Constrained decoding: in `constrained_rows` only the (mask_rows[i], mask_tokens[i]) entries
    keep their logit, every other token gets -inf; the other rows are left as they are."""
    allowed = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[constrained_rows] = False
    allowed[mask_rows, mask_tokens] = True
    return logits.masked_fill(~allowed, float("-inf"))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, steps: torch.Tensor, all_greedy: bool) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int64. Rows with temperature 0 are greedy. The argmax is
    exact in any dtype; the sampling arithmetic below is done in float32."""
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        return greedy
    logits = logits.float()
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp(min=1e-6)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    keep_sorted = (top_k[:, None] < 0) | (ranks < top_k[:, None])
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted &= mass_before < top_p[:, None]  # the top token always stays (mass_before == 0)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    # Gumbel-max: argmax(logit/T + Gumbel noise) is a sample from softmax(logit/T).
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, vocab)))
    sampled = (scaled + gumbel).masked_fill(~keep, float("-inf")).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
