"""CUDA graphs for decode: capture the model forward once per batch size, replay it later.

A decode step of a small model is hundreds of tiny kernels; launching them one by one from
Python costs more host time than the GPU needs to run them. A captured graph replays them
all with one launch. Graphs have fixed shapes and fixed addresses, so:

- inputs are copied into static buffers, and a batch of B requests runs the graph captured
  for the smallest size >= B, padded with dummy requests that read and write KV slot 0
  (reserved for exactly this in `KVPool`) and are dropped from the logits;
- FlashInfer's decode wrapper for each size keeps its metadata in fixed buffers
  (`use_cuda_graph=True`) and is re-planned, on the host, before each replay;
- like the eager wrappers (see flashinfer_backend.py), every size exists twice and batches
  alternate between the two (parity), so planning batch n+1 never overwrites the plan that
  batch n has yet to copy.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..models.attention import AttentionMetadata, KVCache
from .flashinfer_backend import WORKSPACE_BYTES, FlashInferBackend


@contextmanager
def capture_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """The side stream graphs are captured on, current inside the block; the device is synchronized after it."""
    stream = torch.cuda.Stream(device=device)
    # The side stream starts after everything queued so far (the KV pool's zeroing, the
    # weights): a new stream does not wait for the default one by itself.
    stream.wait_stream(torch.cuda.current_stream(device))
    # No garbage collection while capturing: collecting an earlier engine's leftovers here
    # would free its graphs and their pool in the middle of this capture (it crashed the
    # process: "illegal memory access"). Engine.__init__ collects before we start.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        if gc_was_enabled:
            gc.enable()
    torch.cuda.synchronize(device)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes captured: a batch runs at the next one up, its extra rows padding.
    Every 8 rows: on a model whose decode GEMMs are bound by their FLOPs (an 8B shape at 256
    rows), a padded row costs what a real one does."""
    sizes = [1, 2, 4] + list(range(8, max_batch + 1, 8))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, backend: FlashInferBackend, max_batch: int,
                 num_slots: int, device: torch.device) -> None:
        import flashinfer

        self.model, self.kv, self.backend = model, kv, backend
        self.batch_sizes = graph_batch_sizes(max_batch)
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(n, dtype=torch.int64, device=device)  # slot 0: the dummy slot
        self.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.kv_indptr_buf = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.kv_indices_buf = torch.zeros(num_slots + n, dtype=torch.int32, device=device)
        self.last_page_len_buf = torch.ones(n, dtype=torch.int32, device=device)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrappers = [{
            bs: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=backend.tensor_cores_for(bs),
                paged_kv_indptr_buffer=self.kv_indptr_buf[:bs + 1], paged_kv_indices_buffer=self.kv_indices_buf,
                paged_kv_last_page_len_buffer=self.last_page_len_buf[:bs])
            for bs in self.batch_sizes} for _parity in range(2)]
        self.graphs: list[dict[int, torch.cuda.CUDAGraph]] = [{}, {}]
        self.logits: list[dict[int, torch.Tensor]] = [{}, {}]
        self._capture_all(device)

    def _static_meta(self, bs: int, kv_lens: list[int], kv_indices: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(positions=self.positions[:bs], out_slots=self.out_slots[:bs],
                                 qo_indptr=self.qo_indptr[:bs + 1], kv_indptr=self.kv_indptr_buf[:bs + 1],
                                 kv_indices=kv_indices, qo_lens=[1] * bs, kv_lens=kv_lens)

    def _capture_all(self, device: torch.device) -> None:
        pool = None
        with capture_stream(device) as stream:
            for parity in range(2):
                for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs fit in its pool
                    pool = self._capture(parity, bs, pool, stream, device)

    def _capture(self, parity: int, bs: int, pool, stream: torch.cuda.Stream, device: torch.device):
        """Plan, warm up and capture the graph for batch size bs; returns the memory pool to share."""
        wrapper = self.wrappers[parity][bs]
        meta = self._static_meta(bs, [1] * bs, torch.zeros(bs, dtype=torch.int64, device=device))
        self.backend.plan(meta, decode_wrapper=wrapper)
        self.model(self.input_ids[:bs], meta, self.kv, self.backend)  # warm-up outside the graph
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.logits[parity][bs] = self.model(self.input_ids[:bs], meta, self.kv, self.backend)
        self.graphs[parity][bs] = graph
        return graph.pool()

    def padded_size(self, num_reqs: int) -> int:
        """The captured batch size a decode batch of num_reqs requests runs at."""
        return next((s for s in self.batch_sizes if s >= num_reqs), num_reqs)

    def close(self) -> None:
        """Free the graphs, their private memory pool, and the static buffers. Without it the
        pool stays reserved until the garbage collector happens to run, which may be in the
        middle of the next engine's capture."""
        for graphs in self.graphs:
            for graph in graphs.values():
                graph.reset()
        self.graphs, self.logits, self.wrappers = [{}, {}], [{}, {}], []
        self.workspace = self.kv_indices_buf = self.kv_indptr_buf = None  # type: ignore[assignment]

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode and meta.num_requests <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata, parity: int) -> torch.Tensor:
        """Replay on the current (engine) stream; returns logits [B, vocab] (a view of a static buffer)."""
        B = meta.num_requests
        bs = self.padded_size(B)
        pad = bs - B
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(meta.positions)
        self.out_slots[:B].copy_(meta.out_slots)
        if pad:
            self.input_ids[B:bs].zero_()
            self.positions[B:bs].zero_()
            self.out_slots[B:bs].zero_()
        kv_indices = meta.kv_indices
        if pad:  # each dummy request attends to one position: slot 0
            kv_indices = torch.cat([kv_indices, kv_indices.new_zeros(pad)])
        padded = self._static_meta(bs, meta.kv_lens + [1] * pad, kv_indices)
        self.backend.plan(padded, parity, decode_wrapper=self.wrappers[parity][bs])
        self.graphs[parity][bs].replay()
        return self.logits[parity][bs][:B]

