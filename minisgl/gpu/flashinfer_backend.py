"""FlashInfer attention on CUDA (the `cuda` extra): paged prefill and decode kernels.

Same contract as `TorchAttentionBackend` (which stays the portable reference): write the
new K/V at `out_slots`, then attend through each request's slot list. The difference is the
*plan*: FlashInfer splits the work across thread blocks once per batch, on the host, from
host-side lengths. We pass it pinned host tensors filled from the batch's host lists, so
planning never waits for the device (a device-to-host read here, or an upload from pageable
memory, could stall the overlap pipeline).
Page size is 1: a "page" is one token slot, so every last_page_len is 1.

Planning writes the schedule into pinned host memory that the device copies when it reaches
the batch: the same write-after-read hazard as our staging buffers (lessons/readings §4).
In the overlap loop the host plans batch n+1 while batch n may not have copied its plan yet,
so there are two sets of wrappers and batches alternate between them (`parity` = batch id
% 2). A set is reused by batch n+2, which is planned only after batch n was committed, i.e.
after its copy_done. A backend that plans several forwards per batch (a speculative draft
model: K + 1 steps) takes twice that many sets (`plan_sets`): one per forward and parity.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ..models.attention import AttentionMetadata, KVCache, TorchAttentionBackend, store_new_kv

WORKSPACE_BYTES = 256 << 20
# FlashInfer has no kernels for head sizes as small as the demo model's 32 (its decode kernels
# refuse them; benchmarks/history/ records the errors). "auto" takes the torch backend below this (config.py).
FLASHINFER_MIN_HEAD_DIM = 64


def decode_on_tensor_cores(batch_size: int, grouped: bool, deterministic: bool, min_batch: int | None) -> bool:
    """Which decode kernel a batch of `batch_size` requests runs: tensor cores (FlashInfer's prefill
    kernel with one query per request) from `min_batch` up (the setting tensor_core_decode_min_batch;
    None: never), else the plain decode kernel. Both loops run the same kernel for the same batch.

    `grouped`: query heads share KV heads (GQA), the case the tensor-core kernel is for. The
    deterministic mode always needs it: only that kernel can switch the KV split off."""
    if deterministic:
        return True
    return grouped and min_batch is not None and batch_size >= min_batch


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def fill_indptr(lengths: list[int], out: np.ndarray) -> int:
    """Write the offsets [0, l0, l0+l1, ...] into out[:len(lengths) + 1]; returns that length."""
    out[0] = 0
    np.cumsum(lengths, out=out[1:len(lengths) + 1])
    return len(lengths) + 1


class FlashInferBackend:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_batch: int, deterministic: bool = False, *,
                 tensor_core_min_batch: int | None, fast_decode_plan: bool, plan_sets: int = 2) -> None:
        import flashinfer

        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("FlashInfer needs float16 or bfloat16; use the torch backend for float32")
        self.shape = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        # One float workspace: it is used only while kernels run, and batches run in order.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.grouped = num_qo_heads > num_kv_heads
        self.deterministic = deterministic
        self.tensor_core_min_batch = tensor_core_min_batch
        self.fast_decode_plan = fast_decode_plan  # the setting fast_decode_plan (_fast_plan)
        self._planned: weakref.WeakSet = weakref.WeakSet()  # decode wrappers FlashInfer's own plan() has set up once
        self.prefill_reference = TorchAttentionBackend(deterministic=True) if deterministic else None
        self.prefill = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD") for _ in range(plan_sets)]
        # Eager decode wrappers for each kernel some batch size may run (the smallest and the
        # largest batch tell, the rule being a threshold), one per plan set: see parity above.
        kinds = {self.tensor_cores_for(1), self.tensor_cores_for(max_batch)}
        self.decode = {tc: [flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc)
                            for _ in range(plan_sets)] for tc in kinds}
        self._active = self.prefill[0]  # the wrapper the layers run: planned for the current batch
        # The plans' host inputs, pinned. FlashInfer uploads them with non_blocking copies, and a
        # copy from pageable memory may make the host wait for the stream first (CUDA's "API
        # synchronization behavior"), i.e. for the batch in flight: the very stall the overlap
        # loop exists to avoid. One per plan set, like the wrappers: batch n+2 rewrites it.
        pinned = dict(dtype=torch.int32, pin_memory=True)
        self._kv_indptr = [torch.zeros(max_batch + 1, **pinned) for _ in range(plan_sets)]
        self._qo_indptr = [torch.zeros(max_batch + 1, **pinned) for _ in range(plan_sets)]
        # The KV lengths, passed as `seq_lens`: without them FlashInfer derives the lengths from the
        # indptr into a new pageable tensor, and its prefill plan uploads that one (non_blocking
        # from pageable memory: the wait above, once per prefill batch).
        self._kv_lens = [torch.zeros(max_batch, **pinned) for _ in range(plan_sets)]
        self._last_page_len = torch.ones(max_batch, **pinned)  # page size 1: never rewritten
        self._last_page_len_device = torch.ones(max_batch, dtype=torch.int32, device=device)  # the same, for fast plans

    def tensor_cores_for(self, batch_size: int) -> bool:
        """Does a decode batch of this size run on tensor cores? (decode_on_tensor_cores)"""
        return decode_on_tensor_cores(batch_size, self.grouped, self.deterministic, self.tensor_core_min_batch)

    def plan(self, meta: AttentionMetadata, parity: int = 0, decode_wrapper=None) -> None:
        """Once per forward. `parity`: which set of plan buffers (batch id % 2 for the engine's model).
        `decode_wrapper`: a CUDA-graph wrapper with its own fixed buffers."""
        num_qo, num_kv, head_dim = self.shape
        # Keep-alive: the pinned inputs below are read by FlashInfer's queued uploads, and their
        # parity's set is rewritten only by batch n+2; kv_indices was made on the engine stream,
        # which runs this plan's copies and kernels; the plan's own pinned buffer belongs to the
        # wrapper, of the same parity.
        kv_indptr = self._kv_indptr[parity][:fill_indptr(meta.kv_lens, self._kv_indptr[parity].numpy())]
        last_page_len = self._last_page_len[:meta.num_requests]
        kv_lens = self._kv_lens[parity][:meta.num_requests]
        kv_lens.numpy()[:] = meta.kv_lens
        kv_indices = meta.kv_indices.to(torch.int32)
        if meta.is_decode:
            self._active = decode_wrapper or self.decode[self.tensor_cores_for(meta.num_requests)][parity]
            if self.fast_decode_plan and self._active in self._planned:
                self._fast_plan(self._active, kv_indptr, kv_indices)
                return
            self._active.plan(kv_indptr, kv_indices, last_page_len, num_qo, num_kv, head_dim, 1,
                              q_data_type=self.dtype, kv_data_type=self.dtype, disable_split_kv=self.deterministic,
                              seq_lens=kv_lens)
            self._planned.add(self._active)
        elif self.prefill_reference is None:
            self._active = self.prefill[parity]
            qo_indptr = self._qo_indptr[parity][:fill_indptr(meta.qo_lens, self._qo_indptr[parity].numpy())]
            self._active.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo, num_kv,
                              head_dim, 1, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
                              seq_lens=kv_lens)

    def _fast_plan(self, wrapper, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
        """A decode wrapper's plan without FlashInfer's host-side Python over the lengths (its
        plan() takes Python's `max` over them, one tensor element at a time, a value the fa2
        kernels never read): FlashInfer's `fast_decode_plan`, after the uploads plan() makes.
        It reuses what the wrapper's first plan() set up (kernel module, dtypes), so that one
        goes through plan()."""
        from flashinfer.decode import fast_decode_plan

        num_qo, num_kv, head_dim = self.shape
        n = len(kv_indptr) - 1
        if wrapper.is_cuda_graph_enabled:
            # The graph reads fixed buffers: copy in as plan() does (FlashInfer 0.6.6's names;
            # last_page_len's buffer holds ones from its creation, and page size 1 keeps them).
            wrapper._paged_kv_indptr_buf.copy_(kv_indptr, non_blocking=True)
            wrapper._paged_kv_indices_buf[:len(kv_indices)].copy_(kv_indices, non_blocking=True)
            indptr, indices = wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf
        else:  # the wrapper keeps these device tensors until its next plan (same parity: batch n+2)
            indptr, indices = kv_indptr.to(self.workspace.device, non_blocking=True), kv_indices
        fast_decode_plan(wrapper, indptr, indices, self._last_page_len_device[:n], num_qo, num_kv, head_dim, 1,
                         q_data_type=self.dtype, kv_data_type=self.dtype, disable_split_kv=self.deterministic,
                         global_override_indptr_cpu=kv_indptr)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                meta: AttentionMetadata, kv: KVCache, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.prefill_reference is not None and not meta.is_decode:
            return self.prefill_reference.forward(q, k, v, layer_id, meta, kv, out)
        k_pool, v_pool = store_new_kv(k, v, layer_id, meta, kv)
        # [slots, heads, dim] viewed as [pages, page_size=1, heads, dim] (the "NHD" layout)
        paged = (k_pool.unsqueeze(1), v_pool.unsqueeze(1))
        q = q.contiguous()
        # Prefill: FlashInfer's run() zero-fills the output it allocates (a memset kernel per layer);
        # every row is written anyway (a causal query sees at least its own key), so pass it empty.
        if out is None and not meta.is_decode:
            out = torch.empty_like(q)
        return self._active.run(q, paged, out=out)

    def close(self) -> None:
        """Drop the wrappers (they hold the workspace and their plans' buffers)."""
        self.prefill, self.decode, self._active = [], {}, None
        self._planned.clear()
        self.workspace = None
