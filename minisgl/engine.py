"""The engine: model forward and sampling, queued on a dedicated stream (lessons/readings §11).

`Engine.launch(batch)` returns at once with a handle: the sampled tokens on the device (already
published into the FutureMap), a host tensor the device-to-host copy fills, and `copy_done`; the host
reads the tokens only after `copy_done.synchronize()`. Keep-alive (lessons/readings §4): every tensor
the engine stream reads is created on that stream, or owned by a long-lived object whose reuse the
write-after-read waits and the plan parity protect. On CPU the device is the stream's worker thread."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .models.attention import AttentionBackend, KVCache, TorchAttentionBackend, paged_metadata
from . import host_memory
from .gpu import cuda_lifecycle
from .gpu.cuda_graph import CudaGraphRunner
from .config import EngineConfig
from .gpu.flashinfer_backend import FlashInferBackend
from .gpu.fused_ops import decoder_kernels, writes_kv_in_epilogue
from .gpu.piecewise_graph import PiecewisePrefill
from .future_map import FutureMap
from .kv_pool import KVPool, ReqToTokenPool
from .models.sampler import sample
from .staging import DeviceInputs, StagingBuffer
from .streams import Event, Stream, make_device_stream
from .models.decoder import CPU_INVARIANT_ROWS, DETERMINISTIC_ROWS, CausalLM, load_model, set_fixed_rows
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
    # The feature seams (seams.py), all unset in a plain batch; `mask` is a grammar's, built at planning.
    delay_sample: bool = False
    mask: Any = None  # features/grammar.py TokenMask
    logprobs: Any = None  # features/logprobs.py LogprobsPlan: rows and output indices fixed at planning
    device_step: Any = None  # speculation's own forwards and sampling, in place of the engine's

    @property
    def num_tokens(self) -> int:
        return sum(self.qo_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.qo_lens)


@dataclass
class DelayedSample:
    """A forward whose sampling waits for the host's masks: its logits stay in `held` until launch_sample."""

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


class Engine:
    """Owns everything on the device (weights, KV cache, request table, FutureMap, backend) and its stream."""

    def __init__(self, config: EngineConfig) -> None:
        self.closed = False
        # Set when a second Ctrl-C gave up on a hung forward: close() then does not wait for it.
        self.hung = False
        device = config.device
        if device.type == "cuda":
            cuda_lifecycle.before_engine_start()
        else:
            host_memory.keep_freed_blocks()  # else the first engine in a process pays a page fault per tensor page
        self.config = config
        self.device = device
        self.dtype = config.dtype
        self.mechanisms = config.mechanisms
        self.model = load_model(config.model_path, config.dtype, device)[0]
        self.model.kernels = decoder_kernels(device, config.dtype, config.fused_kernels)  # or the torch reference
        # Batch-invariant kernels (models/decoder.py Linear, models/attention.py): always on the CPU.
        self.invariant = config.deterministic or device.type == "cpu"
        if self.invariant:
            set_fixed_rows(self.model, DETERMINISTIC_ROWS if device.type == "cuda" else CPU_INVARIANT_ROWS)
        self.device_delay_s = config.device_delay_ms / 1000.0
        self.backend = self._make_backend()
        # Device memory, allocated once from the config; close() frees it all.
        m = self.model
        self.kv_pool = KVPool(config.kv_tokens)
        self.kv = KVCache(m.num_layers, self.kv_pool.num_slots, m.num_kv_heads, m.head_dim, self.dtype, device)
        self.req_to_token = ReqToTokenPool(config.max_running_requests, config.table_width, device)
        self.future_map = FutureMap(config.max_running_requests, device)
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PiecewisePrefill | None = None
        self.prefill_graphs_off: str | None = "piecewise_cuda_graph=False"  # why prefill runs eagerly
        # Deterministic mode runs eagerly: FlashInfer's unsplit tensor-core decode in CUDA graphs crashed
        # every engine after the first in a process ("illegal memory access"; benchmarks/RESULTS.md).
        if isinstance(self.backend, FlashInferBackend) and self.mechanisms.on("cuda_graph") and not config.deterministic:
            self.graphs = CudaGraphRunner(m, self.kv, self.backend, config.max_running_requests,
                                          self.kv_pool.num_slots, device)
        if config.piecewise_cuda_graph:
            self.prefill_graphs = self._piecewise_prefill()
        # Last: on CPU the stream starts a worker thread, which a failure above would leak.
        self.stream: Stream = make_device_stream("engine", device)
        self.tracer = Tracer(enabled=False)
        if device.type == "cuda":
            cuda_lifecycle.engine_started(self)

    def _piecewise_prefill(self) -> PiecewisePrefill | None:
        """The prefill graphs, where they can run: else prefill_graphs_off says why not (no warning:
        the setting is on by default, as fast_decode_plan is, and means "where it can run")."""
        config = self.config
        # Only where the qkv epilogue writes the new K/V itself: else each piece would keep its own
        # k and v buffers alive, a forward's worth per layer. A speculative verify runs its own forwards.
        why_not = ("the decode graphs are off (CUDA, FlashInfer, cuda_graph on, deterministic off)" if self.graphs is None
                   else "the qkv epilogue is not fused (fused_kernels, head size)" if not writes_kv_in_epilogue(self.model)
                   else "speculation runs its own forwards" if config.speculative_algorithm is not None else None)
        self.prefill_graphs_off = why_not
        if why_not is not None:
            return None
        # The most tokens a forward outside the decode graphs holds: a prompt chunk, and the running
        # decodes when mixed (config.max_batch_tokens also counts a decode step's rows).
        max_tokens = config.chunk_size + (config.max_running_requests if config.enable_mixed_chunk else 0)
        return PiecewisePrefill(self.model, self.kv, self.backend, max_tokens, self.device)

    def _make_backend(self) -> AttentionBackend:
        """The attention backend the config resolved ("auto" is already torch or flashinfer)."""
        if self.config.attention_backend == "flashinfer":
            return self.flashinfer_backend(self.model, plan_sets=2)
        return TorchAttentionBackend(deterministic=self.invariant)

    def flashinfer_backend(self, model: CausalLM, plan_sets: int) -> FlashInferBackend:
        """A FlashInfer backend with the config's settings, for `model`'s heads (the engine's own, or
        a draft model's); `plan_sets`: see flashinfer_backend.py."""
        config = self.config
        return FlashInferBackend(model.config.num_attention_heads, model.num_kv_heads, model.head_dim, self.dtype,
                                 self.device, config.max_running_requests, deterministic=config.deterministic,
                                 tensor_core_min_batch=config.tensor_core_decode_min_batch,
                                 fast_decode_plan=config.fast_decode_plan, plan_sets=plan_sets)

    def launch(self, batch: ForwardBatch, after: Stream) -> ForwardResult:
        """Queue batch's forward + sampling on the engine stream; return without waiting."""
        B = batch.num_reqs
        # Keep-alive: allocated on the host's stream, written on the engine stream; the ForwardResult
        # holds both until commit, which waits for copy_done, the event after their last use.
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
        # The engine first waits for the scheduler's stream, so that what the scheduler wrote for this
        # batch (request-table rows of new requests) is visible (lessons/readings §3, §12).
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
            step = batch.device_step or self  # speculation: its own forwards and sampling
            step._forward_and_sample(batch, inputs.pop(), next_tokens, next_tokens_host, logprobs, held)
            self.tracer.device_end(span.pop(), SpanName.FORWARD, self.stream.name, self.device, iteration, batch.batch_id)

        self.stream.launch(forward)
        copy_done = self.stream.record_event()  # a delayed sampling replaces it (launch_sample)
        return ForwardResult(batch.batch_id, next_tokens, next_tokens_host, copy_done, logprobs,
                             DelayedSample(batch, held) if batch.delay_sample else None)

    def close(self) -> None:
        """Give back everything this engine holds on the device and stop the stream's thread; idempotent.
        Waits for queued work first (a kernel may still read what is freed), unless `hung`."""
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
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.close()
        if isinstance(self.backend, FlashInferBackend):
            self.backend.close()
        # The scheduler still holds the request table's object: its device tensor is dropped here.
        self.req_to_token.table = self.req_to_token.table.new_empty(0)
        self.graphs = self.prefill_graphs = None
        self.model = self.kv = self.future_map = self.backend = None  # type: ignore[assignment]
        self.closed = True
        if self.device.type == "cuda":
            cuda_lifecycle.engine_closed(self, self.device, synchronized=cuda_ok)

    def _emulated_delay(self) -> None:
        """Extra device time: a sleep on the CPU stream's thread, a spinning kernel on CUDA."""
        if self.device.type == "cuda":
            cuda_lifecycle.sleep_on_device(self.device_delay_s, self.device)
        else:
            time.sleep(self.device_delay_s)  # releases the GIL, like a long kernel would

    def _forward_and_sample(self, batch: ForwardBatch, inp: DeviceInputs, next_tokens: torch.Tensor,
                            next_tokens_host: torch.Tensor, logprobs: Any,
                            held: list[tuple[torch.Tensor, DeviceInputs]]) -> None:
        """Engine stream: the forward, then its sampling, unless delayed (the logits wait in `held`)."""
        table = self.req_to_token.table
        input_ids = self.future_map.resolve(inp.input_ids)
        # New positions' slots enter the request table on the device, in stream order (prefix slots: the scheduler).
        table[inp.token_rows, inp.positions] = inp.out_slots
        meta = paged_metadata(batch.qo_lens, batch.kv_lens, batch.is_prefill, inp, table)
        parity = batch.batch_id % 2  # alternate plan buffers: see flashinfer_backend.py
        if self.graphs is not None and self.graphs.can_run(meta):
            logits = self.graphs.run(input_ids, meta, parity)  # one launch for the whole decode step
        else:
            self.backend.plan(meta, parity)
            if self.prefill_graphs is not None and self.prefill_graphs.can_run(meta):
                logits = self.prefill_graphs.run(input_ids, meta)  # a launch per layer, and attention
            else:
                logits = self.model(input_ids, meta, self.kv, self.backend)
        if batch.delay_sample:
            held.append((logits, inp))  # sampled later: launch_sample
        else:
            self.sample(batch, inp, logits, batch.mask, next_tokens, next_tokens_host, logprobs)

    def sample(self, batch: ForwardBatch, inp: DeviceInputs, logits: torch.Tensor, mask: Any,
                next_tokens: torch.Tensor, next_tokens_host: torch.Tensor, logprobs: Any) -> None:
        """Runs on the engine stream: mask, sample, publish, copy the tokens (and logprobs) to the host."""
        masked = logits
        if mask is not None and mask.constrains:
            masked = mask.apply(logits, self._to_device)
        tokens = sample(masked, inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.sample_steps,
                        batch.all_greedy)
        self.future_map.publish(inp.rows, tokens)  # materialized: batch n+1 may now read it
        next_tokens.copy_(tokens)
        # Device-to-host into pinned memory, queued: the host learns the values only at copy_done. Off
        # ("pinned_copy", GPU only) the copy blocks the host inside launch(): no overlap any more.
        non_blocking = self.mechanisms.on("pinned_copy")
        next_tokens_host.copy_(tokens, non_blocking=non_blocking)
        if logprobs is not None:  # of the raw logits: the model's distribution, not the mask's
            logprobs.copy_from_device(logits, tokens, self._to_device(logprobs.rows), non_blocking)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """A host list as an int64 device tensor; on CUDA through pinned memory, so the host does not wait
        (the caching host allocator keeps the pinned block until the copy has run)."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
