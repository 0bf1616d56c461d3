"""Paged attention: the KV pool, the per-batch metadata, and a plain-torch backend.

The KV cache is a *pool* of slots. Each slot holds the key and value of one
token (for every layer). A request does not own a contiguous region: it owns a
list of slot ids, one per position, handed out by whoever manages memory. The
attention kernel therefore reads a request's past keys/values *through* that
list ("paged" attention with a page size of one token).

A batch mixes requests freely: some are prefilling a (chunk of a) prompt, some
are decoding one token. All new tokens of the batch are packed into one flat
tensor of T rows; `qo_indptr` says which rows belong to which request.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about one batched forward pass.

    Example: two requests, A with 3 new tokens (a fresh prompt) and B with 1
    new token after 4 cached ones:
        qo_indptr  = [0, 3, 4]        rows 0..2 are A, row 3 is B
        kv_indptr  = [0, 3, 8]        A has 3 kv positions, B has 5
        kv_indices = [a0 a1 a2 | b0 b1 b2 b3 b4]   (slot ids; b4 is B's new token)
        positions  = [0, 1, 2, 4]
        out_slots  = [a0, a1, a2, b4]
    """

    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_slots: torch.Tensor  # [T] int64, slot where each new token's K/V is written
    qo_indptr: torch.Tensor  # [B+1] int32, request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B+1] int32, request b's slots are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [sum kv_len] int64, slot of positions 0..kv_len-1, new tokens last
    qo_lens: list[int]  # host copies of the lengths, so Python loops need no GPU sync
    kv_lens: list[int]
    prefill: bool = False  # a batch of prompt chunks, even if every chunk is one token long

    @property
    def num_requests(self) -> int:
        return len(self.qo_lens)

    @property
    def is_decode(self) -> bool:
        """A decode step: one new token per request, none of them from a prompt. A prefill batch of
        1-token chunks is not one: in the deterministic mode a prompt position must take the
        prefill path however the loop chunked the prompt, or its numbers change with the chunking."""
        return not self.prefill and all(n == 1 for n in self.qo_lens)


class KVCache:
    """The KV pool: per layer, one K and one V buffer of shape [num_slots, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        # Zeros rather than empty: unused slots then never hold NaN garbage.
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class AttentionBackend(Protocol):
    """What the model calls once per layer. q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D].

    A backend must (1) write the new k/v into the pool at meta.out_slots (`store_new_kv`;
    k = v = None: a fused kernel has written them already) and
    (2) attend every new query to its request's kv positions up to its own.
    `plan(meta)` runs once per batch before the layers (FlashInfer builds its schedule there).
    `out`: where to write the result (a piecewise CUDA graph's fixed buffer), else a new tensor.
    """

    def plan(self, meta: AttentionMetadata, parity: int = 0) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                meta: AttentionMetadata, kv: KVCache, out: torch.Tensor | None = None) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Reference backend in plain torch: one small attention per request, in float32.

    Slow but easy to read and to trust; faster backends must produce the same numbers.
    `deterministic`: every request through `invariant_attention`, decode included: the batched
    decode pads every request's K/V to the batch's longest, and `causal_attention`'s shapes
    depend on how the prompt was chunked, so both round differently in different batches.
    """

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    def plan(self, meta: AttentionMetadata, parity: int = 0) -> None:
        pass  # nothing to prepare: every layer reads the metadata directly

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                meta: AttentionMetadata, kv: KVCache, out: torch.Tensor | None = None) -> torch.Tensor:
        result = self._attend(q, k, v, layer_id, meta, kv)
        return result if out is None else out.copy_(result)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        # 1) Store the new tokens' K/V first, so the gather below sees them too.
        k_pool, v_pool = store_new_kv(k, v, layer_id, meta, kv)

        if self.deterministic and q.device.type == "cpu":
            return batch_invariant_attention(q, k_pool, v_pool, meta)
        if meta.is_decode and not self.deterministic:
            return decode_attention(q, k_pool, v_pool, meta)
        attend = invariant_attention if self.deterministic else causal_attention
        out = torch.empty_like(q)
        q_start = kv_start = 0
        for q_len, kv_len in zip(meta.qo_lens, meta.kv_lens):
            # 2) Gather this request's whole K/V history through its slot list.
            slots = meta.kv_indices[kv_start : kv_start + kv_len]
            rows = slice(q_start, q_start + q_len)
            out[rows] = attend(q[rows], k_pool[slots], v_pool[slots])
            q_start += q_len
            kv_start += kv_len
        return out


def store_new_kv(k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, meta: AttentionMetadata,
                 kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the batch's new K/V into the layer's pools at meta.out_slots (None: written already,
    by the fused q/k/v kernel); returns the two pools."""
    k_pool, v_pool = kv.k[layer_id], kv.v[layer_id]
    if k is not None:
        k_pool[meta.out_slots] = k.to(k_pool.dtype)
        v_pool[meta.out_slots] = v.to(v_pool.dtype)
    return k_pool, v_pool


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one request. q: [Q, Hq, D]; k, v: [K, Hkv, D] with K >= Q.

    The Q queries are the *last* Q of the K positions, so query i sits at
    position K - Q + i and may look at kv positions 0 ..= K - Q + i.
    """
    num_q, num_heads, head_dim = q.shape
    num_kv = k.shape[0]
    # Grouped-query attention: query head h reads kv head h // group.
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)

    # float32 for the softmax, whatever the model dtype, to keep it accurate.
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(head_dim)
    q_pos = torch.arange(num_kv - num_q, num_kv, device=q.device)
    kv_pos = torch.arange(num_kv, device=q.device)
    future = kv_pos[None, :] > q_pos[:, None]  # [Q, K], True where the key is in the future
    scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out.to(q.dtype)


Q_TILE, KV_TILE = 64, 256  # the fixed shapes of invariant_attention
CPU_KV_TILE = 64  # the key tile of batch_invariant_attention (short prompts pad less)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal_attention` whose numbers for a query depend only on its position and its keys.

    In the overlap loop a prompt may be chunked differently than in the normal loop (arrivals
    and radix hits land in other batches), so a query at position p arrives with a different
    number of neighbours and keys. Here every matmul has the same shape whatever the chunk:
    queries go in slabs of Q_TILE rows (zero-padded), keys in tiles of KV_TILE aligned to
    absolute positions (tile t holds positions t*KV_TILE ...), folded in order by an online
    softmax. A tile past a query's position is an exact no-op for it (weights exp(-inf) = 0,
    rescale exp(0) = 1), so where the chunk ends changes nothing either.
    """
    num_q, num_heads, head_dim = q.shape
    num_kv = k.shape[0]
    group = num_heads // k.shape[1]
    tiles = -(-num_kv // KV_TILE)
    pad = tiles * KV_TILE - num_kv
    k = F.pad(k.float().repeat_interleave(group, dim=1), (0, 0, 0, 0, 0, pad))
    v = F.pad(v.float().repeat_interleave(group, dim=1), (0, 0, 0, 0, 0, pad))
    out = torch.empty_like(q)
    for start in range(0, num_q, Q_TILE):
        rows = min(Q_TILE, num_q - start)
        q_slab = F.pad(q[start:start + rows].float(), (0, 0, 0, 0, 0, Q_TILE - rows))
        # absolute positions; the padding rows copy the last real one (their output is dropped)
        q_pos = (num_kv - num_q + start + torch.arange(Q_TILE, device=q.device)).clamp(max=num_kv - 1)
        best = torch.full((num_heads, Q_TILE, 1), float("-inf"), device=q.device)
        total = torch.zeros(num_heads, Q_TILE, 1, device=q.device)
        acc = torch.zeros(num_heads, Q_TILE, head_dim, device=q.device)
        last = num_kv - num_q + start + rows - 1  # this slab's last query, from host ints: no device read
        for t in range(last // KV_TILE + 1):  # the tiles up to it
            keys = slice(t * KV_TILE, (t + 1) * KV_TILE)
            scores = torch.einsum("qhd,khd->hqk", q_slab, k[keys]) / math.sqrt(head_dim)
            kv_pos = torch.arange(t * KV_TILE, (t + 1) * KV_TILE, device=q.device)
            scores = scores.masked_fill(kv_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            best, total, acc = fold_key_tile(best, total, acc, scores,
                                             lambda weights: torch.einsum("hqk,khd->hqd", weights, v[keys]))
        out[start:start + rows] = (acc / total).transpose(0, 1)[:rows].to(q.dtype)
    return out


def fold_key_tile(best: torch.Tensor, total: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                  weigh_values: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the online softmax: fold a tile's masked scores [..., Q, KV_TILE] into the
    running max `best` and sum `total` [..., Q, 1] and the weighted values `acc` [..., Q, D];
    `weigh_values(weights)` is weights @ the tile's values."""
    new_best = torch.maximum(best, scores.amax(dim=-1, keepdim=True))
    rescale = torch.exp(best - new_best)
    weights = torch.exp(scores - new_best)
    total = total * rescale + weights.sum(dim=-1, keepdim=True)
    acc = acc * rescale + weigh_values(weights)
    return new_best, total, acc


def batch_invariant_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              meta: AttentionMetadata) -> torch.Tensor:
    """Attention whose numbers for a query depend only on its position and its keys: not on the
    batch, the chunking, or whether it is a decode row. The CPU's batch-invariant path: a few
    batched matmuls per layer, where a Python loop per request would hold the GIL the host needs.

    Every (query, kv head) pair is one matmul problem of the same shape: the kv head's `group`
    query heads against a tile of CPU_KV_TILE keys aligned to absolute positions (tile t holds
    positions t*CPU_KV_TILE ...), folded in order by an online softmax; a tile past a query's
    position is an exact no-op for it (weights 0, rescale 1). Only how the problems are batched
    differs: the one-token requests (decode rows) in one batched matmul, each longer chunk in one
    per kv head, its queries sharing one copy of the keys; the softmax folds them all at once.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    device = q.device
    # Problems in order, as flat (token, kv head) indices into q and the output; and their key
    # sets: (first problem, problems, keys [n or 1, L, D], values) per batched matmul.
    order: list[int] = []
    sets: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    q_starts = [0, *itertools.accumulate(meta.qo_lens)]
    singles = [b for b, n in enumerate(meta.qo_lens) if n == 1]
    if singles:
        keys, values = _gather_keys(k_pool, v_pool, meta, singles, max(meta.kv_lens[b] for b in singles))
        n = len(singles) * num_kv_heads
        sets.append((0, n, keys.view(n, -1, head_dim), values.view(n, -1, head_dim)))
        order += [q_starts[b] * num_kv_heads + h for b in singles for h in range(num_kv_heads)]
    for b, q_len in enumerate(meta.qo_lens):
        if q_len > 1:
            keys, values = _gather_keys(k_pool, v_pool, meta, [b], meta.kv_lens[b])
            for h in range(num_kv_heads):  # one kv head's keys, shared by the chunk's queries (no copy)
                sets.append((len(order), q_len, keys[0, h][None], values[0, h][None]))
                order += range(q_starts[b] * num_kv_heads + h, q_starts[b + 1] * num_kv_heads, num_kv_heads)
    # Clamped (here and in _gather_keys): the host's lengths and the device's metadata disagree
    # only with a staging protection switched off, whose symptom is wrong tokens, not an IndexError.
    index = torch.tensor(order, device=device).clamp(max=num_tokens * num_kv_heads - 1)
    queries = q.float().view(num_tokens * num_kv_heads, group, head_dim)[index]  # [P, group, D]
    q_pos = meta.positions[index // num_kv_heads]
    num = len(order)
    best = torch.full((num, group, 1), float("-inf"), device=device)
    total = torch.zeros(num, group, 1, device=device)
    acc = torch.zeros(num, group, head_dim, device=device)
    for t in range(max(keys.shape[1] for _, _, keys, _ in sets) // CPU_KV_TILE):
        tile = slice(t * CPU_KV_TILE, (t + 1) * CPU_KV_TILE)
        live = [(first, n, keys[:, tile].expand(n, -1, -1), values[:, tile].expand(n, -1, -1))
                for first, n, keys, values in sets if keys.shape[1] > t * CPU_KV_TILE]
        scores = torch.full((num, group, CPU_KV_TILE), float("-inf"), device=device)  # a set without this tile: masked
        for first, n, keys, _ in live:
            torch.bmm(queries[first:first + n], keys.transpose(1, 2), out=scores[first:first + n])
        scores = scores / math.sqrt(head_dim)
        kv_pos = torch.arange(t * CPU_KV_TILE, (t + 1) * CPU_KV_TILE, device=device)
        scores = scores.masked_fill(kv_pos[None, None, :] > q_pos[:, None, None], float("-inf"))

        def weigh_values(weights: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(num, group, head_dim, device=device)
            for first, n, _, values in live:
                torch.bmm(weights[first:first + n], values, out=out[first:first + n])
            return out

        best, total, acc = fold_key_tile(best, total, acc, scores, weigh_values)
    out = torch.empty(num_tokens * num_kv_heads, group, head_dim, dtype=q.dtype, device=device)
    out[index] = (acc / total).to(q.dtype)
    return out.view(num_tokens, num_heads, head_dim)


def _gather_keys(k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, reqs: list[int],
                 longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of requests `reqs`, float32 [R, Hkv, L, D] with L = `longest` rounded up to
    whole tiles; past a request's end any of its slots (its tiles there are masked)."""
    length = -(-longest // CPU_KV_TILE) * CPU_KV_TILE
    index = torch.tensor(reqs, device=meta.kv_indptr.device).clamp(max=meta.kv_indptr.numel() - 2)
    starts, ends = meta.kv_indptr[:-1].long()[index], meta.kv_indptr[1:].long()[index]
    offsets = torch.arange(length, device=index.device)
    positions = (starts[:, None] + offsets[None, :]).minimum(ends[:, None] - 1)
    slots = meta.kv_indices[positions.clamp(0, meta.kv_indices.numel() - 1)]
    return (k_pool[slots].float().permute(0, 2, 1, 3).contiguous(),
            v_pool[slots].float().permute(0, 2, 1, 3).contiguous())


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
    """All requests of a decode batch at once (one query each), K/V padded to the longest.

    Same numbers as `causal_attention` per request, but a handful of kernels instead of a
    Python loop: that matters on the CPU stream, where Python holds the GIL the host needs.
    """
    num_reqs, num_heads, head_dim = q.shape
    max_kv = max(meta.kv_lens)
    offsets = torch.arange(max_kv, device=q.device)
    starts = meta.kv_indptr[:-1].long()
    lengths = meta.kv_indptr[1:].long() - starts
    valid = offsets[None, :] < lengths[:, None]  # [B, max_kv]
    index = (starts[:, None] + offsets[None, :]).clamp(max=meta.kv_indices.numel() - 1)
    slots = meta.kv_indices[index]  # [B, max_kv]
    group = num_heads // k_pool.shape[1]
    k = k_pool[slots].float().repeat_interleave(group, dim=2)  # [B, max_kv, Hq, D]
    v = v_pool[slots].float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bkhd->bhk", q.float(), k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhk,bkhd->bhd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def paged_metadata(qo_lens: list[int], kv_lens: list[int], prefill: bool, inp, table: torch.Tensor) -> AttentionMetadata:
    """Gather every request's KV slots from its row of the request table (`table`), on the device.
    `inp`: the batch's staged inputs on the device (staging.DeviceInputs)."""
    kv_ids = torch.arange(sum(kv_lens), device=table.device)  # the host lists: no device-to-host sync
    # Request of every KV entry, then its position inside that request. Clamped, so that metadata
    # overwritten under our feet ("staging_double_buffer" off) reads wrong slots, as a GPU kernel
    # would, instead of raising.
    req_of_kv = torch.searchsorted(inp.kv_indptr[1:], kv_ids, right=True).clamp(max=len(qo_lens) - 1)
    pos_in_req = (kv_ids - inp.kv_indptr[req_of_kv]).clamp(0, table.shape[1] - 1)
    return AttentionMetadata(positions=inp.positions, out_slots=inp.out_slots,
                             qo_indptr=inp.qo_indptr.to(torch.int32), kv_indptr=inp.kv_indptr.to(torch.int32),
                             kv_indices=table[inp.rows[req_of_kv], pos_in_req], qo_lens=qo_lens, kv_lens=kv_lens,
                             prefill=prefill)
