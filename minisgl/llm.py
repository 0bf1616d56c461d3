"""The public API: `LLM(...).generate(prompts, SamplingParams(...))`, plus an incremental
interface (`add_request`, `step`, `abort`, `collect`) for staggered arrivals and lessons."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

import torch

from .engine import Engine
from .mechanisms import MECHANISMS, check_disable
from .request import Req, RequestOutput, SamplingParams
from .scheduler import Scheduler

Prompt = str | Sequence[int]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model_path: str | Path, device: str | torch.device | None = None, loop: str = "overlap",
                 disable: Sequence[str] | str = (), device_delay_ms: float = 0.0,
                 dtype: str | torch.dtype | None = None, max_running_requests: int | None = None,
                 chunk_size: int | None = None, kv_tokens: int | None = None, trace: bool = False,
                 attention_backend: str = "auto", host_delay_ms: float = 0.0, deterministic: bool = False) -> None:
        disabled = check_disable(disable)
        if loop not in ("normal", "overlap"):
            raise ValueError(f"loop must be 'normal' or 'overlap', got {loop!r}")
        if device_delay_ms < 0:
            raise ValueError(f"device_delay_ms must be >= 0, got {device_delay_ms}")
        if host_delay_ms < 0:
            raise ValueError(f"host_delay_ms must be >= 0, got {host_delay_ms}")
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            # One intra-op thread: the host thread and the stream thread each get a core
            # (DESIGN.md, measured facts about the emulated stream).
            torch.set_num_threads(1)
        self.model_path = Path(model_path)
        try:
            self.engine = Engine(model_path, self.device, resolve_dtype(dtype, self.device),
                                 num_rows=max_running_requests or self._default_rows(),
                                 device_delay_ms=device_delay_ms, disabled=disabled,
                                 attention_backend=attention_backend, deterministic=deterministic)
        except OSError as exc:  # transformers reports an unreadable config.json as OSError
            raise ValueError(f"cannot load the model in {model_path}: {exc}") from exc
        self.engine.tracer.enabled = trace
        self.tokenizer = _load_tokenizer(self.model_path)
        config = self.engine.config
        kv_tokens = kv_tokens or self._default_kv_tokens()
        self.max_context = min(int(getattr(config, "max_position_embeddings", 4096)), kv_tokens)
        self.scheduler = Scheduler(
            self.engine, eos_ids=_eos_ids(config, self.tokenizer, self.model_path),
            max_running=max_running_requests or self._default_rows(),
            chunk_size=chunk_size or (8192 if self.device.type == "cuda" else 512),
            kv_tokens=kv_tokens, max_context=self.max_context, disabled=disabled, loop=loop,
            host_delay_ms=host_delay_ms)
        self._reqs: dict[int, Req] = {}
        self._next_rid = 0
        self._rng = random.Random(0)

    # ---------------------------------------------------------------- defaults
    def _default_rows(self) -> int:
        return 256 if self.device.type == "cuda" else 64

    def _default_kv_tokens(self) -> int:
        per_token = self.engine.bytes_per_token()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.8) - (4 << 30)  # headroom for activations, graphs and sampling
        else:
            budget = 2 << 30  # 2 GiB of host memory
        return max(1024, min(budget // per_token, 1 << 20 if self.device.type == "cuda" else 65536))

    # ---------------------------------------------------------------- incremental interface
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Bad input raises ValueError and changes nothing."""
        req = self._new_req(prompt, params or SamplingParams(), self._next_rid)
        self._queue(req)
        return req.rid

    def _new_req(self, prompt: Prompt, params: SamplingParams, rid: int) -> Req:
        """Validate everything about one request (raises ValueError) without queueing it."""
        params.validate()
        ids = self._tokenize(prompt)
        vocab = self.engine.model.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_context} "
                             f"(prompt plus at least one new token)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Req(rid, ids, params, self.scheduler.eos_ids, self.max_context, seed)
        self.scheduler.check_fits(req)
        return req

    def _queue(self, req: Req) -> None:
        self.scheduler.add(req)
        self._reqs[req.rid] = req
        self._next_rid = req.rid + 1

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; return the requests that finished in it."""
        done = self.scheduler.step()
        for req in done:
            del self._reqs[req.rid]
        return [self._output(r) for r in done]

    def abort(self, rid: int) -> None:
        if rid not in self._reqs:
            raise ValueError(f"unknown or finished request id {rid}")
        self.scheduler.abort(self._reqs[rid])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. Validates all input before starting."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        # Validate every request before queueing any, so bad input leaves nothing half-started.
        reqs = [self._new_req(p, sp, self._next_rid + i) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        for req in reqs:
            self._queue(req)
        rids = [req.rid for req in reqs]
        outputs: dict[int, RequestOutput] = {}
        while any(rid not in outputs for rid in rids):
            if not self.scheduler.has_work():
                # Only reachable with a mechanism switched off (e.g. batch_snapshot): results
                # went to the wrong requests and some can never be scheduled again.
                lost = [rid for rid in rids if rid not in outputs]
                raise RuntimeError(f"requests {lost[:8]} can no longer be scheduled: the scheduler lost "
                                   f"track of them (disabled: {sorted(self.scheduler.disabled)})")
            for out in self.step():
                outputs[out.rid] = out
            if on_step is not None:
                on_step(len(outputs))
        # Every request is out, but an overshoot step may still be in flight: commit it, so that
        # memory_report() shows the pool whole, unless the caller has other requests queued.
        while self.scheduler.has_work() and all(r.finished for r in self._reqs.values()):
            self.step()
        return [outputs[rid] for rid in rids]

    # ---------------------------------------------------------------- memory
    def memory_report(self) -> dict[str, int]:
        return self.scheduler.memory_report()

    def flush_cache(self) -> int:
        return self.scheduler.flush_cache()

    @property
    def stats(self):
        return self.scheduler.stats

    def reset_stats(self) -> None:
        """Zero the scheduler's counters and drop recorded spans (e.g. after a warm-up)."""
        self.scheduler.stats = type(self.scheduler.stats)()
        self.engine.tracer.clear()

    @property
    def mechanisms(self) -> dict[str, str]:
        return MECHANISMS

    # ---------------------------------------------------------------- helpers
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def _output(self, req: Req) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer else ""
        times = req.metrics["token_times"]
        metrics = {}
        if times:
            metrics = {"ttft": times[0] - req.metrics["arrival"], "e2e": times[-1] - req.metrics["arrival"]}
            if len(times) > 1:
                metrics["tpot"] = (times[-1] - times[0]) / (len(times) - 1)
        return RequestOutput(req.rid, req.prompt_ids, list(req.output_ids), text, req.finish_reason or "abort",
                             metrics)

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    if not (model_path / "tokenizer.json").exists() and not (model_path / "tokenizer_config.json").exists():
        return None
    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


def _eos_ids(config, tokenizer, model_path: Path) -> frozenset[int]:
    ids: set[int] = set()

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(config, "eos_token_id", None))
    gen_config = model_path / "generation_config.json"
    if gen_config.exists():
        import json

        add(json.loads(gen_config.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)
