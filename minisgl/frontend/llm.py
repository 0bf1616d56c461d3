"""The public API: `LLM(...).generate(prompts, SamplingParams(...))`, plus an incremental
interface (`add_request`, `step`, `abort`, `collect`) for staggered arrivals and lessons."""

from __future__ import annotations

import os
import random
import threading
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from ..checks import INT64_MAX, check_int, check_token_ids
from ..config import EngineConfig, resolve_config
from ..engine import Engine
from ..interrupts import interrupts_deferred
from ..invariants import check_invariants, memory_report
from ..mechanisms import Mechanisms
from ..models.checkpoint import read_json_object
from ..request import Req, RequestOutput, SamplingParams
from ..scheduler import Scheduler
from .validation import Prompt, check_params, params_list, prompt_list


class LLM:
    """An engine on one device. Not thread-safe by design: one LLM serves one thread at a time,
    and a call while another thread is inside it raises RuntimeError at once (state is never
    shared half-updated). `close()` frees it; any later use raises RuntimeError."""

    def __init__(self, model_path: str | os.PathLike, device: str | torch.device | None = None,
                 loop: str = "overlap", disable: Sequence[str] | str = (), device_delay_ms: float = 0.0,
                 dtype: str | torch.dtype | None = None, max_running_requests: int | None = None,
                 chunk_size: int | None = None, kv_tokens: int | None = None, trace: bool = False,
                 attention_backend: str = "auto", host_delay_ms: float = 0.0, deterministic: bool = False,
                 admission: str = "reserve") -> None:
        # Every argument is checked before anything is started, so a bad one leaves nothing behind.
        self.config: EngineConfig = resolve_config(
            model_path, device=device, loop=loop, disable=disable, device_delay_ms=device_delay_ms, dtype=dtype,
            max_running_requests=max_running_requests, chunk_size=chunk_size, kv_tokens=kv_tokens, trace=trace,
            attention_backend=attention_backend, host_delay_ms=host_delay_ms, deterministic=deterministic,
            admission=admission)
        self.device = self.config.device
        self.model_path = self.config.model_path
        self._closed = False
        self._guard = threading.RLock()  # held by the one thread inside a call (see the class doc)
        self._driving = False  # inside generate() or step(): its on_step callback may not drive the engine too
        self._reqs: dict[int, Req] = {}  # queued or running
        self._results: dict[int, RequestOutput] = {}  # finished, not yet handed to the caller
        self._abandoned: set[int] = set()  # started by a generate() that raised: results dropped
        self._next_rid = 0
        self._rng = random.Random(0)
        try:
            self.engine = Engine(self.config)
        except OSError as exc:  # transformers reports an unreadable config.json as OSError
            raise ValueError(f"cannot load the model in {model_path}: {exc}") from exc
        # Stops the engine's worker thread if this LLM is dropped or the interpreter exits
        # unclosed (a torch kernel still running during interpreter teardown can abort it).
        self._stop_engine = weakref.finalize(self, self.engine.close)
        try:  # from here on the engine's stream runs: a failure must stop it again
            self.engine.tracer.enabled = self.config.trace
            self.tokenizer = _load_tokenizer(self.model_path)
            self.eos_ids = _eos_ids(self.engine.model.config, self.tokenizer, self.model_path)
            self.scheduler = Scheduler(self.config, self.engine)
        except BaseException:
            self._stop_engine()
            raise

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + new tokens this engine holds (see EngineConfig.max_seq_len)."""
        return self.config.max_seq_len

    # ---------------------------------------------------------------- lifecycle
    @contextmanager
    def _use(self, drives: bool = False) -> Iterator[None]:
        """Enter a call: refuse another thread, a closed engine and a failed one, each at once.

        `drives`: the call runs the scheduler (generate, step). From inside a running one (an
        on_step callback) it would hand the outer call's results to the inner one: refused."""
        if not self._guard.acquire(blocking=False):
            raise RuntimeError(_IN_USE)
        try:
            if self._closed:
                raise RuntimeError("this LLM is closed")
            if drives and self._driving:
                raise RuntimeError(_REENTRANT)
            error = self.scheduler.error  # an exception escaped a step: the state may be half moved
            if error is not None:
                raise RuntimeError(f"the engine failed earlier ({type(error).__name__}: {error}) and refuses "
                                   f"further work; close() it and build a new LLM") from error
            self._driving, outer = drives or self._driving, self._driving
            try:
                yield
            finally:
                self._driving = outer
        finally:
            self._guard.release()

    def close(self) -> None:
        """Commit the batch in flight, stop the engine and free its memory. Idempotent. Raises only
        when another thread is inside a call; a failure while finishing is a warning, and the
        engine stops anyway (no worker thread is left behind)."""
        if self._closed:
            return
        if not self._guard.acquire(blocking=False):
            raise RuntimeError(_IN_USE)
        if self._driving:  # from an on_step callback: the generate() around it would run on a closed engine
            self._guard.release()
            raise RuntimeError(_REENTRANT)
        self._closed = True
        try:
            self.scheduler.close()  # commits the batch in flight unless an error stopped the scheduler
        except Exception as exc:  # noqa: BLE001 - closing must still stop the engine below
            warnings.warn(f"LLM.close(): the batch in flight failed: {exc!r}", RuntimeWarning, stacklevel=2)
        finally:
            self._stop_engine()
            self._guard.release()

    def __enter__(self) -> "LLM":
        if self._closed:
            raise RuntimeError("this LLM is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- incremental interface
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Bad input raises ValueError/TypeError and changes nothing."""
        with self._use():
            req = self._new_req(prompt, check_params(params), self._next_rid)
            self._queue(req)
            return req.rid

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; return the requests that finished in it, plus any
        finished earlier (during a generate()) and not collected yet."""
        with self._use(drives=True):
            self._step()
            return self._take_results()

    def collect(self) -> list[RequestOutput]:
        """The finished requests not handed out yet, without running the engine."""
        with self._use():
            return self._take_results()

    def abort(self, rid: int) -> None:
        """Stop request `rid`; it finishes with reason "abort" at the next step. A request that
        already finished (its result not collected yet) is left as it is."""
        with self._use():
            check_int("rid", rid, 0, INT64_MAX)
            if rid in self._reqs:
                self.scheduler.abort(self._reqs[rid])
            elif rid not in self._results:
                raise ValueError(f"unknown or finished request id {rid}")

    def has_unfinished(self) -> bool:
        """True while a request is queued or running, or a result waits to be collected."""
        with self._use():
            return self.scheduler.has_work() or bool(self._results)

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. Validates all input before starting.

        Requests queued with add_request() run alongside; their results stay collectable
        (step(), collect()). If anything escapes (KeyboardInterrupt included), the requests
        this call started are aborted: the next drain gives back their rows and KV slots.
        `on_step(n_done)` runs after every step; it may add_request(), abort(), read memory,
        but not step(), generate() or close() (RuntimeError)."""
        with self._use(drives=True):
            if on_step is not None and not callable(on_step):
                raise TypeError(f"on_step must be callable, got {type(on_step).__name__}")
            prompts = prompt_list(prompts)
            params = params_list(sampling_params, len(prompts))
            # Validate every request before queueing any, so bad input leaves nothing half-started.
            reqs = [self._new_req(p, sp, self._next_rid + i) for i, (p, sp) in enumerate(zip(prompts, params))]
            outputs: dict[int, RequestOutput] = {}
            try:
                for req in reqs:
                    self._queue(req)
                self._run_until_done(reqs, outputs, on_step)
            except BaseException:
                for req in reqs:
                    self._results.pop(req.rid, None)  # finished, not handed out: dropped with the rest
                    # Only those queued: a Ctrl-C between two _queue() calls leaves the rest
                    # unqueued, and their ids are handed out again by the next request.
                    if req.rid in self._reqs:
                        self._abandoned.add(req.rid)
                        self.scheduler.abort(req)
                raise
            return [outputs[req.rid] for req in reqs]

    def _run_until_done(self, reqs: list[Req], outputs: dict[int, RequestOutput],
                        on_step: Callable[[int], None] | None) -> None:
        mine = {req.rid for req in reqs}
        while len(outputs) < len(mine):
            if not self.scheduler.has_work():
                # Only reachable with a mechanism switched off (e.g. batch_snapshot): results
                # went to the wrong requests and some can never be scheduled again.
                lost = sorted(mine - outputs.keys())
                raise RuntimeError(f"requests {lost[:8]} can no longer be scheduled: the scheduler lost "
                                   f"track of them (disabled: {sorted(self.scheduler.mechanisms.disabled)})")
            self._step()
            for rid in mine & self._results.keys():
                outputs[rid] = self._results.pop(rid)
            if on_step is not None:
                on_step(len(outputs))
        # Every request is out, but an overshoot step may still be in flight: commit it, so that
        # memory_report() shows the pool whole, unless the caller has other requests queued.
        while self.scheduler.has_work() and not self._reqs:
            self._step()

    def _step(self) -> None:
        """One scheduler iteration; the requests that finished go to self._results. An error
        (not a deferred Ctrl-C) stops the scheduler: it is raised here once, and every later
        call refuses (see _use)."""
        nothing_in_flight, launched = self.scheduler.last is None, self.scheduler.stats.batches
        # Ctrl-C waits until the finished requests are stored in self._results: landing between
        # the scheduler handing them over and here, it would lose them for good.
        with interrupts_deferred():
            for req in self.scheduler.step():
                del self._reqs[req.rid]
                if req.rid in self._abandoned:
                    self._abandoned.discard(req.rid)
                else:
                    self._results[req.rid] = self._output(req)
        if nothing_in_flight and self.scheduler.stats.batches == launched:
            self._check_not_stuck()

    def _check_not_stuck(self) -> None:
        """After a step that had nothing in flight and launched nothing: if requests still wait
        while nothing runs, no later step can admit them (nobody will free a slot or a row), and
        generate() or a step() loop would spin forever. With every mechanism on this cannot
        happen (admission promises, check_fits); it is a leak, e.g. release_allocated off."""
        s = self.scheduler
        if s.waiting and not (s.prefilling or s.running.reqs or s.releasing):
            mem = memory_report(s)
            raise RuntimeError(f"{len(s.waiting)} request(s) wait for KV slots or rows that nothing running will free "
                               f"(kv_free {mem['kv_free']} + kv_cached {mem['kv_cached']} of {mem['kv_total']}, "
                               f"rows_free {mem['rows_free']} of {mem['rows_total']}): leaked, see check_invariants() "
                               f"(disabled: {sorted(s.mechanisms.disabled)})")

    def _take_results(self) -> list[RequestOutput]:
        results, self._results = list(self._results.values()), {}
        return results

    def _new_req(self, prompt: Prompt, params: SamplingParams, rid: int) -> Req:
        """Validate everything about one request (raises ValueError/TypeError) without queueing it."""
        vocab = self.engine.model.vocab_size
        params.validate(vocab)
        ids = self._tokenize(prompt)
        max_seq_len, model_window = self.config.max_seq_len, self.config.model_window
        if len(ids) >= max_seq_len:
            limit = "the model" if max_seq_len == model_window else "kv_tokens"
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {max_seq_len} "
                             f"(prompt plus at least one new token; {limit} sets it)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        # max_new_tokens is cut at the model's window (finish "length"), never at the pool's
        # size: a request the pool is too small for is refused by check_fits() instead.
        req = Req(rid, ids, params, self.eos_ids, model_window, seed)
        self.scheduler.check_fits(req)
        return req

    def _queue(self, req: Req) -> None:
        with interrupts_deferred():  # queued and known by id, or neither
            self.scheduler.add(req)
            self._reqs[req.rid] = req
            self._next_rid = req.rid + 1

    # ---------------------------------------------------------------- memory
    def memory_report(self) -> dict[str, int]:
        with self._use():
            return memory_report(self.scheduler)

    def flush_cache(self) -> int:
        with self._use():
            return self.scheduler.cache.flush()

    def check_invariants(self) -> None:
        """Raise InvariantError unless every KV slot, request row and request is owned exactly once
        (see minisgl/invariants.py). Cheap enough to call between any two steps."""
        with self._use():
            check_invariants(self.scheduler)

    @property
    def stats(self):
        return self.scheduler.stats

    def reset_stats(self) -> None:
        """Zero the scheduler's counters and drop recorded spans (e.g. after a warm-up)."""
        with self._use():
            self.scheduler.stats = type(self.scheduler.stats)()
            self.engine.tracer.clear()  # its batch records too

    @property
    def mechanisms(self) -> Mechanisms:
        """This engine's switches (`minisgl.MECHANISMS` describes every one)."""
        return self.config.mechanisms

    # ---------------------------------------------------------------- helpers
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer: pass token ids instead of text")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # the tokenizer's own message does not say what is wrong
                raise ValueError(f"prompt is not valid Unicode text ({exc.reason} at index {exc.start})") from None
            ids = self.tokenizer.encode(prompt)
        else:
            ids = check_token_ids("prompt", prompt, self.engine.model.vocab_size)
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def _output(self, req: Req) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(req.rid, req.prompt_ids, list(req.output_ids), text, req.finish_reason or "abort",
                             req.times.latency(), list(req.logprobs) if req.params.logprobs is not None else None)


_IN_USE = "this LLM is in use by another thread; one LLM serves one thread at a time"
_REENTRANT = ("generate(), step() and close() cannot be called from inside generate() (its on_step callback): "
              "they would take over the running call's requests")

def _load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    if not (model_path / "tokenizer.json").exists() and not (model_path / "tokenizer_config.json").exists():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except Exception as exc:  # the tokenizers library raises its own types for a corrupt file
        raise ValueError(f"cannot load the tokenizer in {str(model_path)!r}: {exc}") from exc


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
        add(read_json_object(gen_config).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)

