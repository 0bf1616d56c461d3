"""Where a whole run's device time went, phase by phase, each against its own floor.

`bench --breakdown` records every launched batch (`Tracer.batches`: prefill or decode, how
many requests and tokens, how much KV it reads, the CUDA-graph size it was padded to) and its
device span, then attributes the run:

- prefill batches;            floor: their FLOPs at the measured matmul rate (or their bytes
                              at the measured HBM bandwidth, whichever is longer)
- decode at the full batch;   floor: per step, the GEMMs (the weights read once, or their FLOPs
                              at the measured matmul rate, whichever is longer) and attention
                              (every request's KV read once; ModelCost.decode_floor)
- decode in the tail, by batch size;  same floor, per step
- graph padding: dummy rows computed to reach a captured size (slots, and an upper bound on
  their time: the batch's time times their share of its rows)
- idle: device time with no forward running, between the first and the last forward.

Beside each phase's device time: the host work C per iteration of the iterations that
launched a batch of that phase (`host_by_phase`). The run's C is a mean over iterations of
every kind, so it moves with their mix (how many prefills, how full the decode batches are)
even where no kind grows; this column tells the two apart.

The sum of the floors is the floor *of this schedule*; the roofline in bench.py assumes a
better one (every request decodes at full batch from the first step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tracer import HOST_LANE, BatchRecord, Span, SpanName
from .trace import host_work_by_span, merge_intervals

TAIL_BUCKETS = (8, 32, 64, 128)  # upper bounds of the tail's batch-size buckets; the rest up to full


@dataclass
class ModelCost:
    """Bytes and FLOPs of one forward, from the model's config (bf16 weights and KV)."""

    matmul_params: int  # every GEMM's weights, the vocabulary projection included
    layers: int
    q_size: int  # query heads x head_dim
    kv_bytes_per_token: int  # K and V of one position, every layer

    @classmethod
    def from_config(cls, model_dir: str | Path) -> "ModelCost":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers, hidden, inter = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
        q_size, kv_size = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        layer_params = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
        return cls(layers * layer_params + hidden * cfg.vocab_size, layers, q_size, 2 * layers * kv_size * 2)

    @property
    def weight_bytes(self) -> int:
        return 2 * self.matmul_params

    def decode_floor(self, rows: int, attended_positions: int, hbm: float, flops: float) -> float:
        """One decode step of `rows` requests, as its two kinds of kernel run, one after the other:
        the GEMMs read the weights once and do 2 FLOPs per weight per row (at a few hundred rows
        an 8B model's GEMMs are bound by the FLOPs, not the bytes); attention reads the KV of
        every position once and does 4 FLOPs per query element per position (QK and PV). Each
        kind takes the longer of its bytes at the HBM bandwidth and its FLOPs at the matmul rate."""
        gemms = max(self.weight_bytes / hbm, 2 * self.matmul_params * rows / flops)
        attention = max(attended_positions * self.kv_bytes_per_token / hbm,
                        4 * self.layers * self.q_size * attended_positions / flops)
        return gemms + attention

    def prefill_floor(self, tokens: int, attention_pairs: int, attended_positions: int, hbm: float, flops: float) -> float:
        """GEMM FLOPs per token plus attention FLOPs per (query, key) pair, or the bytes if longer."""
        work = 2 * self.matmul_params * tokens + 2 * self.layers * self.q_size * attention_pairs
        return max(work / flops, (self.weight_bytes + attended_positions * self.kv_bytes_per_token) / hbm)


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(memory bytes/s, matmul FLOP/s) measured now: a 1 GiB copy and an 8192^3 bf16 matmul on a GPU;
    on the CPU, where those would take minutes before the run began, 64 MiB and a 1024^3 float32
    matmul (the CPU engine's dtype; bf16 matmuls are emulated there, far slower)."""
    cuda = device.type == "cuda"
    copy_bytes, n, dtype = (1 << 30, 8192, torch.bfloat16) if cuda else (64 << 20, 1024, torch.float32)
    x = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    a = torch.randn(n, n, dtype=dtype, device=device)
    hbm = 2 * x.numel() / timed(lambda: y.copy_(x), device)  # a copy reads and writes every byte
    flops = 2 * n ** 3 / timed(lambda: a @ a, device)
    return hbm, flops


def timed(fn, device: torch.device, repeat: int = 10, rounds: int = 5) -> float:
    """Seconds per call: the best of several rounds (clocks ramp up, neighbours interfere)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def phase_of(num_reqs: int, is_prefill: bool, full: int) -> str:
    if is_prefill:
        return "prefill"
    if num_reqs >= full:
        return f"decode, full batch ({full})"
    low = 1
    for high in TAIL_BUCKETS + (full - 1,):
        if num_reqs <= high:
            return f"decode, tail {low}-{high}"
        low = high + 1
    return f"decode, tail {low}-{full - 1}"


NO_LAUNCH = "no launch"  # an iteration that only committed (the last one, or a wait for memory)


def host_by_phase(spans: list[Span], batches: list[BatchRecord], full_batch: int) -> dict[str, dict[str, float]]:
    """{phase: {"iterations": n, "host_s": s, SpanName: s, ...}}: C's spans (schedule, launch,
    commit, sample; waiting excluded, as in `pipeline_metrics`) of each iteration, under the phase
    of the batch it launched, in all and by span: which part of C grows, when one does."""
    phases = {rec.batch_id: phase_of(rec.num_reqs, rec.is_prefill, full_batch) for rec in batches}
    launched = {sp.iteration: phases.get(sp.batch_id, NO_LAUNCH) for sp in spans
                if sp.lane == HOST_LANE and sp.name == SpanName.LAUNCH}
    out: dict[str, dict[str, float]] = {}
    for iteration, by_span in host_work_by_span(spans).items():
        totals = out.setdefault(launched.get(iteration, NO_LAUNCH), {"iterations": 0, "host_s": 0.0})
        totals["iterations"] += 1
        totals["host_s"] += sum(by_span.values())
        for name, seconds in by_span.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return out


def breakdown(spans: list[Span], batches: list[BatchRecord], cost: ModelCost, hbm: float, flops: float,
              full_batch: int) -> list[dict]:
    """Rows {phase, batches, device_s, floor_s, iterations, host_s, (slots)}: phases, then padding,
    idle and the total."""
    forwards = {sp.batch_id: sp for sp in spans if sp.lane != HOST_LANE and sp.name == SpanName.FORWARD}
    rows: dict[str, dict] = {}
    pad_slots = pad_rows = 0
    pad_time = 0.0
    for rec in batches:
        span = forwards.get(rec.batch_id)
        if span is None:  # launched before the trace was cleared (the warm-up)
            continue
        name = phase_of(rec.num_reqs, rec.is_prefill, full_batch)
        if rec.is_prefill:
            floor = cost.prefill_floor(rec.num_tokens, rec.attention_pairs, rec.attended_positions, hbm, flops)
        else:
            floor = cost.decode_floor(rec.num_reqs, rec.attended_positions, hbm, flops)
        row = rows.setdefault(name, {"phase": name, "batches": 0, "device_s": 0.0, "floor_s": 0.0, "tokens": 0,
                                     "iterations": 0, "host_s": 0.0})
        row["batches"] += 1
        row["device_s"] += span.duration
        row["floor_s"] += floor
        row["tokens"] += rec.num_tokens
        if rec.padded_reqs > rec.num_reqs:
            pad_slots += rec.padded_reqs - rec.num_reqs
            pad_rows += rec.padded_reqs
            pad_time += span.duration * (rec.padded_reqs - rec.num_reqs) / rec.padded_reqs
    host = host_by_phase(spans, batches, full_batch)
    for name, totals in host.items():
        if name in rows:
            rows[name].update(iterations=totals["iterations"], host_s=totals["host_s"],
                              host_by_span={str(k): v for k, v in totals.items() if k not in ("iterations", "host_s")})
    order = sorted(rows.values(), key=lambda r: (r["phase"] != "prefill", "full" not in r["phase"],
                                                  _bucket_low(r["phase"])))
    device = merge_intervals([(sp.start, sp.end) for sp in forwards.values()])
    window = device[-1][1] - device[0][0] if device else 0.0
    idle = window - sum(end - start for start, end in device)
    total_floor = sum(r["floor_s"] for r in order)
    order.append({"phase": "graph padding (upper bound)", "batches": 0, "device_s": pad_time, "floor_s": 0.0,
                  "tokens": pad_slots, "padded_share": pad_slots / pad_rows if pad_rows else 0.0})
    order.append({"phase": "idle (no forward running)", "batches": 0, "device_s": idle, "floor_s": 0.0, "tokens": 0})
    order.append({"phase": "total (first to last forward)", "batches": sum(r["batches"] for r in rows.values()),
                  "device_s": window, "floor_s": total_floor, "tokens": sum(r["tokens"] for r in rows.values()),
                  "iterations": sum(t["iterations"] for t in host.values()),
                  "host_s": sum(t["host_s"] for t in host.values())})
    for r in order:
        r["share"] = r["device_s"] / window if window else 0.0
    return order


def _bucket_low(phase: str) -> int:
    digits = phase.rsplit(" ", 1)[-1].split("-")[0]
    return int(digits) if digits.isdigit() else 0
