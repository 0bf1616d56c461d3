"""CUDA graphs for prefill, cut at attention: the layers captured piece by piece, attention eager.

An eager forward launches about ten kernels per layer, each from Python; on the H200 the launch
of a 28-layer prefill took 10-15 ms of host time whatever the chunk's size (benchmarks/RESULTS.md),
host work that the overlap loop cannot hide behind a shorter device step. Decode steps replay
whole-forward graphs (cuda_graph.py), but a prefill's attention cannot be captured once for all
batches: FlashInfer's prefill plan, and the launch it makes, depend on every request's lengths.
So the forward is cut at attention, as CausalLM.forward's layer halves are:

  piece 0      the embedding, then layer 0 up to attention (norm, q/k/v projection, qkv epilogue)
  piece i      layer i-1 after attention (o_proj, add-norm, MLP), then layer i up to attention
  piece L      the last layer after attention

Each piece is captured once per token bucket (`prefill_token_buckets`), and a batch runs at the
smallest bucket that holds it, its extra tokens padding: position 0 and KV slot 0, reserved for
them in KVPool (the decode graphs' dummy requests use it too). Between two pieces attention runs
eagerly on the real tokens only, from one fixed buffer (q) into another (attended) that the next
piece reads. A forward is then L + 1 graph launches and L attention calls; the logits, a few rows,
are eager too. Between pieces only the residual stream passes: piece 0's embedding output, which
the fused add-and-norm kernels update in place in every later piece, so each graph reads it at the
address it was captured with. (The padding rows of `attended` keep stale values; only padding reads them.)

`capture=False` runs the same pieces without graphs: the CPU tests check there that the cut, the
padding and the fixed buffers change no number.
"""

from __future__ import annotations

import torch

from ..models.attention import AttentionBackend, AttentionMetadata, KVCache
from ..models.decoder import CausalLM
from .cuda_graph import capture_stream

SMALLEST_BUCKET = 64
BUCKET_STEP = 1024  # above it, buckets every BUCKET_STEP tokens: a batch pads by less than one step


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """The token counts captured: powers of two from SMALLEST_BUCKET up to BUCKET_STEP, then every
    BUCKET_STEP tokens, and max_tokens. Below BUCKET_STEP a prefill is launch-bound, and doubling its
    rows costs little device time; above it every padded row costs about what a real one does."""
    sizes = {max_tokens}
    size = SMALLEST_BUCKET
    while size < min(BUCKET_STEP, max_tokens):
        sizes.add(size)
        size *= 2
    sizes.update(range(BUCKET_STEP, max_tokens, BUCKET_STEP))
    return sorted(sizes)


class PiecewisePrefill:
    def __init__(self, model: CausalLM, kv: KVCache, backend: AttentionBackend, max_tokens: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model, self.kv, self.backend = model, kv, backend
        self.buckets = prefill_token_buckets(max_tokens)
        self.num_pieces = model.num_layers + 1
        n = self.buckets[-1]
        heads, head_dim = model.config.num_attention_heads, model.head_dim
        dtype = model.model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(n, dtype=torch.int64, device=device)  # slot 0: the padding's
        self.q = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)  # a piece's q, attention's input
        self.attended = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)  # attention's output
        # Per bucket: each piece's graph and the outputs it refills on replay (captured), or nothing.
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, list[tuple]] = {}
        if capture:
            self._capture_all(device)

    def _piece(self, i: int, bucket: int, previous: tuple | None, rope) -> tuple:
        """Piece i over the first `bucket` tokens of the fixed buffers; `previous`: piece i-1's
        outputs. Returns (q, k, v, residual), or (h, residual) from the last piece."""
        layers, kernels = self.model.model.layers, self.model.kernels
        if i == 0:
            h, residual = self.model.model.embed_tokens(self.input_ids[:bucket]), None
        else:
            h, residual = layers[i - 1].after_attention(self.attended[:bucket], previous[-1], kernels)
        if i == len(layers):
            return h, residual
        (q, k, v), residual = layers[i].before_attention(h, residual, rope, self.out_slots[:bucket], self.kv,
                                                         kernels, self.q[:bucket])
        return q, k, v, residual

    def _rotation(self, bucket: int):
        return self.model.kernels.rotation(self.model.model.rotary, self.positions[:bucket], self.q.dtype)

    def _capture_all(self, device: torch.device) -> None:
        pool = None
        with capture_stream(device) as stream:
            for bucket in reversed(self.buckets):  # largest first, so smaller graphs fit in its pool
                # The fused rotation reads the positions buffer when it runs: one object serves every replay.
                rope = self._rotation(bucket)
                previous = None
                for i in range(self.num_pieces):  # warm-up outside the graphs (Triton compiles, cuBLAS plans)
                    previous = self._piece(i, bucket, previous, rope)
                stream.synchronize()
                graphs, outputs, previous = [], [], None
                for i in range(self.num_pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        previous = self._piece(i, bucket, previous, rope)
                    pool = graph.pool()
                    graphs.append(graph)
                    outputs.append(previous)
                self.graphs[bucket], self.outputs[bucket] = graphs, outputs

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return sum(meta.qo_lens) <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward on the current (engine) stream, its attention planned already (backend.plan);
        returns what CausalLM.forward does: each request's last token's logits."""
        num_tokens = sum(meta.qo_lens)
        bucket = self.bucket_for(num_tokens)
        for buffer, values in ((self.input_ids, input_ids), (self.positions, meta.positions),
                               (self.out_slots, meta.out_slots)):
            buffer[:num_tokens].copy_(values)
            buffer[num_tokens:bucket].zero_()  # padding: token 0 at position 0, its K/V into slot 0
        graphs = self.graphs.get(bucket)
        rope = None if graphs else self._rotation(bucket)
        q, attended = self.q[:num_tokens], self.attended[:num_tokens]  # the real tokens' rows
        previous = None
        for i in range(self.num_pieces):
            if i:  # layer i-1's attention, on the real tokens only: q and attended are fixed buffers
                _, k, v, _ = previous
                self.backend.forward(q, None if k is None else k[:num_tokens], None if v is None else v[:num_tokens],
                                     i - 1, meta, self.kv, attended)
            if graphs:
                graphs[i].replay()
                previous = self.outputs[bucket][i]
            else:
                previous = self._piece(i, bucket, previous, rope)
        h, residual = previous
        return self.model.logits(h[:num_tokens], residual[:num_tokens], meta)

    def close(self) -> None:
        """Free the graphs, their memory pool and the fixed buffers (see CudaGraphRunner.close)."""
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs, self.outputs = {}, {}
        self.q = self.attended = None  # type: ignore[assignment]
