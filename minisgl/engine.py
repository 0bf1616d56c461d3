"""The engine: model forward and sampling, queued on a dedicated stream.

`Engine.launch(batch)` returns at once (lessons/readings §11: mini-SGLang's `_forward()`
inside `engine_stream_ctx`). What it returns is a *handle*: the sampled tokens on the device
(already published into the FutureMap for the next batch), a host tensor that the
device-to-host copy will fill, and `copy_done`, the event after that copy. Only after
`copy_done.synchronize()` may the host read the tokens.

`Engine.close()` gives every device resource back (graphs and their memory pool, FlashInfer
workspaces, the KV pool, the request table, the weights) and stops the stream's thread.

Keep-alive (article 000): a tensor that one stream creates and another stream reads must
stay allocated until the reader has run, or the caching allocator hands its memory to the
next allocation while the read is still queued. Here every tensor the engine stream reads
is either created on the engine stream itself (the staging copies, the sampled tokens, the
attention metadata: allocated under `self.stream`, so the allocator orders reuse after
them), or owned by a long-lived object (the staging buffers, the plans, the CUDA-graph
buffers), whose reuse the write-after-read waits and the plan parity protect.

On CPU the "device" is the stream's worker thread; `device_delay_ms` adds a sleep at the
start of every forward there (GIL released) to emulate a slower device. That is a teaching
aid: it makes device time large and predictable, so the overlap and its race windows are
visible and deterministic.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .models.attention import AttentionBackend, AttentionMetadata, KVCache, TorchAttentionBackend
from .gpu.cuda_graph import CudaGraphRunner
from .config import EngineConfig
from .gpu.flashinfer_backend import FlashInferBackend
from .gpu.fused_ops import decoder_kernels
from .future_map import FutureMap
from .kv_pool import KVPool, ReqToTokenPool
from .models.sampler import sample
from .staging import DeviceInputs, StagingBuffer
from .streams import Event, Stream, make_device_stream
from .models.decoder import DETERMINISTIC_ROWS, load_model, set_fixed_rows
from .tracer import BatchRecord, SpanName, Tracer


@dataclass
class ForwardBatch:
    """What crosses from the scheduler to the engine. Host lists here are never rewritten."""

    batch_id: int
    is_prefill: bool
    qo_lens: list[int]  # new tokens per request
    kv_lens: list[int]  # positions per request after this batch (prefix + new)
    staging: StagingBuffer  # device-bound metadata, written by the scheduler
    all_greedy: bool
    # The feature seams (seams.py), all unset in a plain batch. A grammar in the batch: sampling
    # waits for the host's masks (Engine.launch_sample), or `mask` was built at planning.
    delay_sample: bool = False
    mask: Any = None  # features/grammar.py TokenMask
    logprobs: Any = None  # features/logprobs.py LogprobsPlan: rows and output indices fixed at planning

    @property
    def num_tokens(self) -> int:
        return sum(self.qo_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.qo_lens)


@dataclass
class DelayedSample:
    """A forward whose sampling waits for the host's masks: its logits (and staged inputs) stay
    on the device, in `held`, until Engine.launch_sample queues the sampling."""

    batch: ForwardBatch
    held: list[tuple[torch.Tensor, DeviceInputs]]  # filled by the forward, on the engine stream


@dataclass
class ForwardResult:
    batch_id: int
    next_tokens: torch.Tensor  # [B] on the device
    next_tokens_host: torch.Tensor  # [B] on the host, valid after copy_done
    copy_done: Event  # after the last device work of the batch (its sampling's copy to the host)
    logprobs: Any = None  # features/logprobs.py LogprobsHost, valid after copy_done
    delayed: DelayedSample | None = None  # set until the delayed sampling is launched


# CUDA engines not yet closed (weak: a dropped engine leaves the set by itself).
_LIVE_CUDA_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


class Engine:
    """Owns everything on the device: the weights, the KV cache, the request table, the
    FutureMap, the attention backend and its CUDA graphs, and the stream they run on."""

    def __init__(self, config: EngineConfig) -> None:
        self.closed = False
        # Set by the LLM when a second Ctrl-C gave up on the device (a hung forward): close()
        # then leaves the work in progress running instead of waiting for it.
        self.hung = False
        device = config.device
        if device.type == "cuda":
            # An earlier engine that was dropped without close() may still sit in reference
            # cycles: collect it now, at a safe point, not during this engine's graph capture.
            gc.collect()
            torch.cuda.empty_cache()
        self.config = config
        self.device = device
        self.dtype = config.dtype
        self.mechanisms = config.mechanisms
        self.model = load_model(config.model_path, config.dtype, device)[0]
        self.model.kernels = decoder_kernels(device, config.dtype)  # fused GPU kernels, or the torch reference
        if config.deterministic:
            # Batch-invariant kernels: a request's tokens then do not depend on which other
            # requests share its batches (see models/decoder.py Linear).
            set_fixed_rows(self.model, DETERMINISTIC_ROWS)
        self.device_delay_s = config.device_delay_ms / 1000.0
        self.backend = self._make_backend()
        # Device memory, allocated in one phase from the config; the scheduler receives the KV
        # pool's free list and the request table, and close() frees them all.
        m = self.model
        self.kv_pool = KVPool(config.kv_tokens)
        self.kv = KVCache(m.num_layers, self.kv_pool.num_slots, m.num_kv_heads, m.head_dim, self.dtype, device)
        self.req_to_token = ReqToTokenPool(config.max_running_requests, config.table_width, device)
        self.future_map = FutureMap(config.max_running_requests, device)
        self.graphs: CudaGraphRunner | None = None
        # Deterministic decode runs eagerly: FlashInfer's unsplit tensor-core decode inside the
        # CUDA-graph wrappers crashed the warm-up of every engine after the first one in a process
        # on the H200 ("illegal memory access"; benchmarks/RESULTS.md), so graphs are left out there.
        if isinstance(self.backend, FlashInferBackend) and self.mechanisms.on("cuda_graph") and not config.deterministic:
            self.graphs = CudaGraphRunner(m, self.kv, self.backend, config.max_running_requests,
                                          self.kv_pool.num_slots, device)
        # Last: on CPU the stream starts a worker thread, which a failure above would leak.
        self.stream: Stream = make_device_stream("engine", device)
        self.tracer = Tracer(enabled=False)
        if device.type == "cuda":
            _LIVE_CUDA_ENGINES.add(self)

    def _make_backend(self) -> AttentionBackend:
        """The attention backend the config resolved ("auto" is already torch or flashinfer)."""
        config = self.config
        if config.attention_backend == "flashinfer":
            m = self.model
            return FlashInferBackend(m.config.num_attention_heads, m.num_kv_heads, m.head_dim, self.dtype, self.device,
                                     config.max_running_requests, deterministic=config.deterministic)
        return TorchAttentionBackend(deterministic=config.deterministic)

    def launch(self, batch: ForwardBatch, after: Stream) -> ForwardResult:
        """Queue batch's forward + sampling on the engine stream; return without waiting."""
        B = batch.num_reqs
        # Allocated here, on the host's stream, written on the engine stream. Keep-alive by a
        # kept reference: the ForwardResult holds both until commit, which waits for copy_done,
        # the event after their last use (and close() synchronizes before anything is freed).
        next_tokens = torch.empty(B, dtype=torch.int64, device=self.device)
        pinned = self.device.type == "cuda" and self.mechanisms.on("pinned_copy")
        next_tokens_host = torch.empty(B, dtype=torch.int64, pin_memory=pinned)
        logprobs = batch.logprobs.allocate(pinned) if batch.logprobs is not None else None
        held: list[tuple[torch.Tensor, DeviceInputs]] = []  # a delayed sampling's logits (launch_sample)
        inputs: list[DeviceInputs] = []
        span: list[object] = []
        iteration = self.tracer.iteration
        if self.tracer.enabled:
            padded = self.graphs.padded_size(B) if self.graphs is not None and not batch.is_prefill else B
            self.tracer.batches.append(BatchRecord(batch.batch_id, batch.is_prefill, B, batch.num_tokens,
                                              sum(batch.kv_lens), sum(q * k for q, k in zip(batch.qo_lens, batch.kv_lens)),
                                              padded))
        # The engine first waits for the scheduler's stream, so that everything the scheduler
        # wrote for this batch (request-table rows of new requests) is visible
        # (lessons/readings §3, §12: SGLang's forward stream waits on its schedule stream).
        # >>> exercise 8: the engine stream waits for the scheduler stream
        self.stream.wait_stream(after)
        # <<< exercise 8

        def copy_in() -> None:
            span.append(self.tracer.device_begin(self.device))
            if self.device_delay_s:
                self._emulated_delay()
            inputs.append(batch.staging.to_device(batch.num_tokens, B))

        self.stream.launch(copy_in)
        # The host may rewrite this staging buffer once the device has passed this point.
        batch.staging.consumed = self.stream.record_event()

        def forward() -> None:
            self._forward_and_sample(batch, inputs.pop(), next_tokens, next_tokens_host, logprobs, held)
            self.tracer.device_end(span.pop(), SpanName.FORWARD, self.stream.name, self.device, iteration, batch.batch_id)

        self.stream.launch(forward)
        copy_done = self.stream.record_event()  # a delayed sampling replaces it (launch_sample)
        return ForwardResult(batch.batch_id, next_tokens, next_tokens_host, copy_done, logprobs,
                             DelayedSample(batch, held) if batch.delay_sample else None)

    def launch_sample(self, result: ForwardResult, mask: Any) -> None:
        """Queue the delayed sampling of a launched forward, with masks the host built after the
        forward was launched (SGLang's launch_batch_sample_if_needed). Returns without waiting.

        Must be queued before the next batch's forward: that forward reads this batch's tokens
        from the FutureMap, and a CUDA-graph replay rewrites the logits buffer held here."""
        delayed = result.delayed
        assert delayed is not None, f"batch {result.batch_id}: its sampling was not delayed, or was launched already"
        result.delayed = None
        iteration = self.tracer.iteration

        def sample_held() -> None:
            begin = self.tracer.device_begin(self.device)
            logits, inp = delayed.held.pop()
            self._sample(delayed.batch, inp, logits, mask, result.next_tokens, result.next_tokens_host,
                         result.logprobs)
            self.tracer.device_end(begin, SpanName.SAMPLE, self.stream.name, self.device, iteration, result.batch_id)

        self.stream.launch(sample_held)
        result.copy_done = self.stream.record_event()

    def close(self) -> None:
        """Give back everything this engine holds on the device, and stop the stream's thread.

        Idempotent, and a close() cut short is finished by the next one. Waits for queued work
        first (nothing freed here may still be read by a kernel), unless `hung`: a CPU worker
        then finishes its closure on its own (daemon thread, its tensors kept alive by it)."""
        if self.closed:
            return
        cuda_ok = self.device.type == "cuda" and not self.hung
        if cuda_ok:
            try:
                self.stream.synchronize()
            except RuntimeError as exc:  # a failed kernel: the context is lost, free what we can
                warnings.warn(f"Engine.close(): queued device work failed: {exc}", RuntimeWarning, stacklevel=2)
                cuda_ok = False
        self.stream.close(wait=not self.hung)  # CPU: the worker skips its queue, then exits
        if self.graphs is not None:
            self.graphs.close()
        if isinstance(self.backend, FlashInferBackend):
            self.backend.close()
        # The scheduler still refers to the request table's object (host free list included):
        # its device table is dropped here with the rest (a closed LLM is never used again).
        self.req_to_token.table = self.req_to_token.table.new_empty(0)
        self.graphs = None
        self.model = self.kv = self.future_map = self.backend = None  # type: ignore[assignment]
        self.closed = True
        if self.device.type == "cuda":
            # Reference cycles (FlashInfer wrappers, closures) would otherwise keep tensors alive
            # until some later collection, possibly in the middle of the next engine's graph capture.
            gc.collect()
        if cuda_ok:
            torch.cuda.synchronize(self.device)
            _LIVE_CUDA_ENGINES.discard(self)
            if not _LIVE_CUDA_ENGINES:
                # cuBLAS keeps a workspace per (handle, stream), 32 MiB each on an H200, in the
                # caching allocator: our engine and capture streams left 64 MiB per engine behind
                # (measured: benchmarks/RESULTS.md). Captured graphs hold those addresses, so they
                # are dropped only when no other engine (whose graphs may use them) is alive.
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()

    def _emulated_delay(self) -> None:
        """Extra device time: a sleep on the CPU stream's thread, a spinning kernel on CUDA."""
        if self.device.type == "cuda":
            torch.cuda._sleep(int(self.device_delay_s * self._cuda_cycles_per_s()))
        else:
            time.sleep(self.device_delay_s)  # releases the GIL, like a long kernel would

    def _cuda_cycles_per_s(self) -> float:
        """Calibrate torch.cuda._sleep once: the second of two timed sleeps, so that the
        GPU's clock has ramped up from idle (the first one runs slow and would make every
        emulated delay too short)."""
        if not hasattr(self, "_cycles_per_s"):
            for _ in range(2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(50_000_000)
                end.record()
                end.synchronize()
                self._cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1000.0)
        return self._cycles_per_s

    def _forward_and_sample(self, batch: ForwardBatch, inp: DeviceInputs, next_tokens: torch.Tensor,
                            next_tokens_host: torch.Tensor, logprobs: Any,
                            held: list[tuple[torch.Tensor, DeviceInputs]]) -> None:
        """Runs on the engine stream (device side): the forward, then its sampling, unless the
        batch delays it: then the logits wait in `held` for launch_sample."""
        table = self.req_to_token.table
        input_ids = self.future_map.resolve(inp.input_ids)
        # The slots of this batch's new positions enter the request table on the device, in
        # stream order. (Prefix slots of a new request were written by the scheduler.)
        table[inp.token_rows, inp.positions] = inp.out_slots
        meta = self._attention_metadata(batch, inp, table)
        parity = batch.batch_id % 2  # alternate plan buffers: see flashinfer_backend.py
        if self.graphs is not None and self.graphs.can_run(meta):
            logits = self.graphs.run(input_ids, meta, parity)  # one launch for the whole decode step
        else:
            self.backend.plan(meta, parity)
            logits = self.model(input_ids, meta, self.kv, self.backend)
        if batch.delay_sample:
            held.append((logits, inp))  # sampled later: launch_sample
        else:
            self._sample(batch, inp, logits, batch.mask, next_tokens, next_tokens_host, logprobs)

    def _sample(self, batch: ForwardBatch, inp: DeviceInputs, logits: torch.Tensor, mask: Any,
                next_tokens: torch.Tensor, next_tokens_host: torch.Tensor, logprobs: Any) -> None:
        """Runs on the engine stream: mask, sample, publish, copy the tokens (and logprobs) to the host."""
        masked = logits
        if mask is not None and mask.constrains:
            masked = mask.apply(logits, self._to_device)
        tokens = sample(masked, inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.sample_steps,
                        batch.all_greedy)
        self.future_map.publish(inp.rows, tokens)  # materialized: batch n+1 may now read it
        next_tokens.copy_(tokens)
        # Device-to-host into pinned memory, queued like a kernel: the host learns the values
        # only at copy_done. Off ("pinned_copy", GPU only), the copy blocks the host right here,
        # inside launch(), until the forward is done: no overlap is possible any more.
        non_blocking = self.mechanisms.on("pinned_copy")
        next_tokens_host.copy_(tokens, non_blocking=non_blocking)
        if logprobs is not None:  # of the raw logits: the model's distribution, not the mask's
            logprobs.copy_from_device(logits, tokens, self._to_device(logprobs.rows), non_blocking)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """A host list as an int64 device tensor, on the engine stream. On CUDA through pinned
        memory, so the copy is queued and the host does not wait for the stream (the caching
        host allocator keeps the pinned block until the copy has run)."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _attention_metadata(self, batch: ForwardBatch, inp: DeviceInputs, table: torch.Tensor) -> AttentionMetadata:
        """Gather every request's KV slots from its row of the request table."""
        total_kv = sum(batch.kv_lens)  # from the host lists: no device-to-host sync
        kv_ids = torch.arange(total_kv, device=self.device)
        # Request of every KV entry, then its position inside that request. Clamped, so that
        # metadata overwritten under our feet ("staging_double_buffer" off) reads wrong slots,
        # as a GPU kernel would, instead of raising.
        req_of_kv = torch.searchsorted(inp.kv_indptr[1:], kv_ids, right=True).clamp(max=batch.num_reqs - 1)
        pos_in_req = (kv_ids - inp.kv_indptr[req_of_kv]).clamp(0, table.shape[1] - 1)
        kv_indices = table[inp.rows[req_of_kv], pos_in_req]
        return AttentionMetadata(positions=inp.positions, out_slots=inp.out_slots,
                                 qo_indptr=inp.qo_indptr.to(torch.int32), kv_indptr=inp.kv_indptr.to(torch.int32),
                                 kv_indices=kv_indices, qo_lens=batch.qo_lens, kv_lens=batch.kv_lens,
                                 prefill=batch.is_prefill)
